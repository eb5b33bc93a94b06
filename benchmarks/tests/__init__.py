"""Tests of the benchmarks' analysis tools (no engines); `make test` runs them (pytest testpaths)."""

"""Benchmark scripts and tools: benchmarks/README.md says what each measures and how long it runs."""

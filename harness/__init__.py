"""What the tests and the benchmarks share to run real engines on this machine.

- :mod:`harness.ports`: loopback ports below the kernel's ephemeral range, each handed out once;
- :mod:`harness.engines`: deployments brought up and down through the real CLI (``disagg up``),
  requests and metrics against them;
- :mod:`harness.own_proxy`: a proxy of a test's own (other proxy settings) in front of a running
  deployment's engines;
- :mod:`harness.vllm_pair`: a prefill/decode pair of vLLM engines started by hand (no proxy);
- :mod:`harness.local_1p1d`: a 1P1D on this machine under the engine lock, a request timed to its
  first token.

tests/ and benchmarks/ import this package and never each other (``lint-imports`` checks it);
this package imports neither. It is not part of the installed product (pyproject's packages).
"""

"""disagg: prefill/decode disaggregated LLM serving over ordinary links."""

__version__ = "0.1.0"

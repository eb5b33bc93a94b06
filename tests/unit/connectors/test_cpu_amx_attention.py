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

#: one vLLM process (one import of vLLM, ~8 s of CPU) answers for the three environments: with
#: the variable ``off`` the plugins load as in every vLLM process at start; then, with vLLM's own
#: ``_get_attn_isa`` put back, the plugin's ``register`` (what that load calls) runs again with the
#: variable unset and ``on``
PROBE = (
    "import json, os, torch\n"
    "from vllm.v1.attention.backends import cpu_attn\n"
    "original = cpu_attn._get_attn_isa\n"
    "args = [(torch.bfloat16, 128, 64), (torch.bfloat16, 32, 128), (torch.float32, 128, 64),\n"
    "        (torch.bfloat16, 16, 64)]\n"
    "def isas():\n"
    "    return [[original(*a), cpu_attn._get_attn_isa(*a)] for a in args]\n"
    f"os.environ[{ENV!r}] = {OFF!r}\n"
    "from vllm.plugins import load_general_plugins\n"
    "load_general_plugins()\n"
    "found = {'off': isas()}\n"
    "from disagg_connectors.cpu_amx_attention import register\n"
    "for value in (None, 'on'):\n"
    "    cpu_attn._get_attn_isa = original\n"
    f"    os.environ.pop({ENV!r}, None)\n"
    "    if value is not None:\n"
    f"        os.environ[{ENV!r}] = value\n"
    "    register()\n"
    "    found[str(value)] = isas()\n"
    "print(json.dumps(found))\n"
)


def test_registered_as_a_vllm_general_plugin() -> None:
    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("disagg_cpu_amx_attention") == "disagg_connectors.cpu_amx_attention:register"


def test_amx_is_answered_as_vec_and_nothing_else_changes() -> None:
    isa = without_amx(lambda dtype, block: "amx" if block % 32 == 0 else "vec16")
    assert isa("bf16", 128) == FALLBACK_ISA == "vec"
    assert isa("bf16", 16) == "vec16"
    assert isa.__wrapped__("bf16", 128) == "amx"  # type: ignore[attr-defined]


def _isas() -> dict[str, list[list[str]]]:
    """Per environment (``off``, ``None``: unset, ``on``): [original, patched] ISA for each probe."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.engine
def test_in_a_vllm_process_amx_is_never_chosen_with_the_variable_and_untouched_without() -> None:
    """Machine-independent: where the CPU has AMX the original answers ``amx`` for bf16 at block 128
    and the plugin ``vec``; elsewhere both answer the same."""
    found = _isas()
    on = found["off"]
    assert all(patched != "amx" for _, patched in on)
    assert all(patched == (FALLBACK_ISA if original == "amx" else original) for original, patched in on)
    for value in ("None", "on"):
        assert all(original == patched for original, patched in found[value]), value

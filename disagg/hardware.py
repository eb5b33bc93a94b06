"""Spec sheets for the devices ``disagg plan`` knows: compute and memory.

A topology host may name its accelerator (``gpu: rtx-4090``); the planner
uses the spec here to *estimate* prefill time and decode KV memory when no
measurement exists. These are vendor peak figures (dense BF16 tensor math,
no sparsity), not what an engine reaches: the planner applies
:data:`PREFILL_UTILISATION` and says so wherever it prints an estimate.

Keep this module free of heavy imports: topology.py imports it to validate
the ``gpu`` field.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Fraction of peak FLOP/s a serving engine reaches in a long prefill (an
#: assumption: large GEMMs reach 50-70% of peak, attention and small layers less).
PREFILL_UTILISATION = 0.5


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or a CPU) as a spec sheet gives it."""

    name: str                   # the value written in a topology's ``gpu`` field
    label: str                  # human-readable name
    bf16_tflops: float          # dense BF16 tensor peak, TFLOP/s
    memory_gb: float | None     # device memory in GB (None: varies, e.g. CPU RAM)
    note: str = ""              # where the figure comes from, when not obvious
    memory_gbps: float | None = None  # memory bandwidth in GB/s, spec sheet (None: varies, e.g. CPU)

    @property
    def bf16_flops(self) -> float:
        """Dense BF16 peak in FLOP/s."""
        return self.bf16_tflops * 1e12


DEVICES: dict[str, DeviceSpec] = {d.name: d for d in (
    DeviceSpec("rtx-4090", "RTX 4090", 165.2, 24.0, "BF16 with FP32 accumulate (GeForce rate)", memory_gbps=1008),
    DeviceSpec("rtx-6000-ada", "RTX 6000 Ada", 364.2, 48.0, memory_gbps=960),
    DeviceSpec("a100", "A100 80GB SXM", 312.0, 80.0, memory_gbps=2039),
    DeviceSpec("a100-40gb", "A100 40GB", 312.0, 40.0, memory_gbps=1555),
    DeviceSpec("h100", "H100 SXM", 989.0, 80.0, memory_gbps=3350),
    DeviceSpec("h100-pcie", "H100 PCIe", 756.0, 80.0, memory_gbps=2000),
    DeviceSpec("h200", "H200", 989.0, 141.0, memory_gbps=4800),
    DeviceSpec("gb10", "GB10 (DGX Spark)", 125.0, 128.0,
               "derived from NVIDIA's 1 PFLOP sparse FP4; 128 GB shared with the CPU", memory_gbps=273),
    DeviceSpec("cpu", "CPU", 2.0, None,
               "a rough figure for a modern server socket with AVX-512/AMX; measure it"),
)}

#: Other spellings accepted in a topology's ``gpu`` field.
ALIASES: dict[str, str] = {
    "4090": "rtx-4090", "rtx4090": "rtx-4090",
    "6000-ada": "rtx-6000-ada", "rtx6000-ada": "rtx-6000-ada",
    "a100-80gb": "a100", "h100-sxm": "h100",
    "dgx-spark": "gb10", "spark": "gb10",
}


def device_names() -> tuple[str, ...]:
    """Every accepted ``gpu`` value (canonical names first, then aliases)."""
    return tuple(DEVICES) + tuple(ALIASES)


def lookup_device(name: str) -> DeviceSpec | None:
    """The spec for a canonical name or alias (case-insensitive), else None."""
    key = name.strip().lower()
    return DEVICES.get(ALIASES.get(key, key))

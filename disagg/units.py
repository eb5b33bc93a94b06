"""Human-readable sizes, durations and rates for command output."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """``268435456`` -> ``256 MiB`` (binary units, 3 significant digits)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{value:.0f} B"
    return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"


def fmt_seconds(s: float) -> str:
    """``0.0234`` -> ``23.4 ms``; ``2.3`` -> ``2.30 s``; ``0.00005`` -> ``50 µs``."""
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s" if s < 100 else f"{s:.0f} s"


def fmt_rate(bps: float) -> str:
    """Bits per second: ``2.35e9`` -> ``2.35 Gb/s``."""
    for scale, unit in ((1e12, "Tb/s"), (1e9, "Gb/s"), (1e6, "Mb/s"), (1e3, "kb/s")):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.0f} b/s"


def fmt_count(n: int) -> str:
    """``12345`` -> ``12,345``."""
    return f"{n:,}"

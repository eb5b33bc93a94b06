"""A :class:`~disagg.watch.snapshot.Snapshot` as terminal lines (pure), and the ANSI codes that
redraw a screen in place.

Callers: :mod:`disagg.watch.top` (each refresh, and ``--once`` without ``--json``). No curses:
a refresh homes the cursor, writes the lines and clears what is left of the old screen.
"""

from __future__ import annotations

from disagg.units import fmt_seconds
from disagg.watch.snapshot import EngineRow, Latency, Snapshot

#: cursor home, and clear from the cursor to the end of the screen
HOME = "\x1b[H"
CLEAR_BELOW = "\x1b[J"
CLEAR_LINE = "\x1b[K"
HIDE_CURSOR = "\x1b[?25l"
SHOW_CURSOR = "\x1b[?25h"
#: how many reasons a line lists before "..."
MAX_ITEMS = 6


def fmt_bytes_rate(bps: float) -> str:
    """Bytes per second, decimal: ``1.2e9`` -> ``1.20 GB/s``."""
    for scale, unit in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
        if bps >= scale:
            return f"{bps / scale:.2f} {unit}"
    return f"{bps:.0f} B/s"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _latency(name: str, lat: Latency) -> str:
    if lat.count == 0 or lat.p50 is None or lat.p99 is None:
        return f"{name} -"
    return f"{name} p50 {fmt_seconds(lat.p50)}  p99 {fmt_seconds(lat.p99)}  ({lat.count} requests)"


def _items(counts: dict[str, float], total: float | None = None) -> str:
    if not counts:
        return "none"
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = []
    for key, value in ordered[:MAX_ITEMS]:
        share = f" ({100 * value / total:.0f}%)" if total else ""
        parts.append(f"{key} {value:g}{share}")
    if len(ordered) > MAX_ITEMS:
        parts.append("...")
    return ", ".join(parts)


def _health(row: EngineRow) -> str:
    if row.healthy is None:
        return "down"
    return "ok" if row.healthy else "unhealthy"


ENGINE_HEADER = f"{'ENGINE':<12} {'ROLE':<8} {'HOST':<12} {'HEALTH':<9} {'STATUS':<9} " \
                f"{'RUN':>4} {'WAIT':>5} {'KV':>6} {'RESTARTS':>8}"


def _engine(row: EngineRow) -> str:
    kv = "-" if row.kv_use is None else f"{100 * row.kv_use:.1f}%"
    line = (f"{row.name:<12} {row.role:<8} {row.host:<12} {_health(row):<9} {row.status:<9} "
            f"{_num(row.running, '{:.0f}'):>4} {_num(row.waiting, '{:.0f}'):>5} {kv:>6} {row.restarts:>8}")
    return line + (f"  ({row.error})" if row.error and row.healthy is not True else "")


def render(snap: Snapshot, clock: str = "") -> list[str]:
    """The lines of one screen (no colours, no escape codes)."""
    head = f"disagg top - {snap.run}   proxy {snap.proxy_url}" + (f"   {clock}" if clock else "")
    lines = [head]
    if snap.proxy_error is not None:
        lines.append(f"proxy metrics: unavailable ({snap.proxy_error})")
    interval = f"   (rates over {snap.rate_interval_s:.1f} s)" if snap.rate_interval_s else ""
    handoff = "-" if snap.handoff_bytes_per_s is None else fmt_bytes_rate(snap.handoff_bytes_per_s)
    lines.append(f"requests {_num(snap.requests_per_s, '{:.1f}/s')}   routing decisions "
                 f"{_num(snap.decisions_per_s, '{:.1f}/s')}   active {_num(snap.active_requests, '{:.0f}')}   "
                 f"handoff {handoff}{interval}")
    lines.append(f"{snap.window}:")
    lines.append(f"  {_latency('TTFT', snap.ttft)}")
    lines.append(f"  {_latency('TPOT', snap.tpot)}")
    routed = sum(snap.routes.values())
    lines.append(f"  routes     {_items(snap.routes, routed)}")
    if snap.route_reasons:
        lines.append(f"  reasons    {_items(snap.route_reasons)}")
    lines.append(f"  fallbacks  {_items(snap.fallbacks)}")
    lines.append(f"  errors     {_items(snap.errors)}")
    lines.append("")
    lines.append(ENGINE_HEADER)
    lines += [_engine(row) for row in snap.engines]
    return lines


def redraw(lines: list[str]) -> str:
    """The text that replaces the screen with ``lines`` in place (no flicker: no full clear)."""
    return HOME + "".join(line + CLEAR_LINE + "\n" for line in lines) + CLEAR_BELOW

"""The doctor's table: one line per check and host, columns aligned, and a closing summary line."""

from __future__ import annotations

from disagg.doctor.checks import FAIL, WARN, Row


def render(found: list[Row], *, elapsed: float | None = None) -> str:
    """``CHECK  HOST  STATUS  DETAIL`` lines, then ``N checks: all pass`` or what failed."""
    header = Row("CHECK", "HOST", "STATUS", "DETAIL")
    widths = [max(len(getattr(r, f)) for r in (header, *found)) for f in ("check", "host", "status")]
    lines = [f"{r.check:<{widths[0]}}  {r.host:<{widths[1]}}  {r.status:<{widths[2]}}  {r.detail}"
             for r in (header, *found)]
    failed = [r for r in found if r.status == FAIL]
    warned = sum(1 for r in found if r.status == WARN)
    took = f" in {elapsed:.1f} s" if elapsed is not None else ""
    if failed:
        lines.append(f"{len(found)} checks{took}: {len(failed)} failed ("
                     + ", ".join(f"{r.check} on {r.host}" for r in failed) + ")")
    else:
        lines.append(f"{len(found)} checks{took}: all pass" + (f" ({warned} warnings)" if warned else ""))
    return "\n".join(lines)

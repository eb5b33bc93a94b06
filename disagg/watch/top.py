"""``disagg top``: the refresh loop (a screen redrawn in place each second) and ``--once``.

Callers: :mod:`disagg.commands.watch`. Each refresh re-reads the run's state file (restarts and
the supervisor's statuses change while it runs), scrapes the run (:mod:`disagg.watch.scrape`) and
keeps the scrapes of the last minute (:class:`Window`): rates are over the last refresh,
percentiles, route mix, fallbacks and errors over the window. ``--once`` scrapes twice, ``gap``
seconds apart: rates over that gap, distributions since the proxy started (one minute of
history would take a minute), and its output says so.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from typing import TextIO

from disagg.launch.state import RunState
from disagg.watch.render import HIDE_CURSOR, SHOW_CURSOR, redraw, render
from disagg.watch.scrape import DEFAULT_TIMEOUT_S, processes, scrape
from disagg.watch.snapshot import Scrape, Snapshot, build_snapshot

#: the span of the distributions in the live view
WINDOW_S = 60.0
#: the alternate screen (what `top` and `less` draw on): the shell's screen comes back on exit
ALT_SCREEN_ON = "\x1b[?1049h"
ALT_SCREEN_OFF = "\x1b[?1049l"

Load = Callable[[], RunState]


class Window:
    """The scrapes of the last ``span`` seconds: the newest, and the oldest not older than that."""

    def __init__(self, span: float = WINDOW_S) -> None:
        self.span = span
        self.scrapes: deque[Scrape] = deque()

    def add(self, now: Scrape) -> tuple[Scrape | None, Scrape | None]:
        """Keep ``now``; returns (the scrape before it, the window's base: None on the first)."""
        previous = self.scrapes[-1] if self.scrapes else None
        self.scrapes.append(now)
        while len(self.scrapes) > 2 and now.at - self.scrapes[1].at >= self.span:
            self.scrapes.popleft()
        return previous, (self.scrapes[0] if len(self.scrapes) > 1 else None)


def snapshot_of(run: RunState, now: Scrape, previous: Scrape | None, base: Scrape | None) -> Snapshot:
    """The snapshot of ``run`` at ``now``."""
    return build_snapshot(run.name, run.proxy_url, processes(run), now, previous, base)


def once(load: Load, *, gap: float = 1.0, timeout: float = DEFAULT_TIMEOUT_S,
         sleep: Callable[[float], None] = time.sleep) -> Snapshot:
    """Two scrapes ``gap`` seconds apart: rates over the gap, distributions since the proxy started."""
    first = scrape(load(), timeout)
    sleep(max(0.0, gap - (time.monotonic() - first.at)))
    run = load()
    return snapshot_of(run, scrape(run, timeout), first, None)


def emit_once(snap: Snapshot, out: TextIO, *, as_json: bool) -> None:
    """``--once``: the snapshot as one JSON object or as the screen's lines."""
    if as_json:
        out.write(json.dumps(snap.to_json(), indent=2) + "\n")
    else:
        out.write("\n".join(render(snap, clock=time.strftime("%H:%M:%S"))) + "\n")
    out.flush()


def live(load: Load, out: TextIO, *, interval: float = 1.0, as_json: bool = False, span: float = WINDOW_S,
         timeout: float = DEFAULT_TIMEOUT_S, frames: int | None = None,
         sleep: Callable[[float], None] = time.sleep) -> None:
    """Refresh every ``interval`` seconds until interrupted (or ``frames`` refreshes).

    A terminal gets the screen redrawn in place (the alternate screen; the shell's comes back on
    exit); anything else (a pipe, a file) gets each screen after the last, or with ``as_json`` one
    JSON object per line."""
    window = Window(span)
    screen = out.isatty() and not as_json
    if screen:
        out.write(ALT_SCREEN_ON + HIDE_CURSOR)
    try:
        count = 0
        while frames is None or count < frames:
            run = load()
            now = scrape(run, timeout)
            previous, base = window.add(now)
            snap = snapshot_of(run, now, previous, base)
            if as_json:
                out.write(json.dumps(snap.to_json()) + "\n")
            else:
                lines = render(snap, clock=time.strftime("%H:%M:%S"))
                out.write(redraw(lines) if screen else "\n".join(lines) + "\n\n")
            out.flush()
            count += 1
            if frames is None or count < frames:
                sleep(max(0.0, interval - (time.monotonic() - now.at)))
    finally:
        if screen:
            out.write(SHOW_CURSOR + ALT_SCREEN_OFF)
            out.flush()

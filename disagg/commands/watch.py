"""``disagg top`` and ``disagg logs``: watching a running topology (:mod:`disagg.watch`).

Both find the run as ``disagg status`` does: the named topology's state file, or the only run
under ``--run-dir`` (default ``.disagg``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from disagg.commands.stopping import sigterm_as_ctrl_c
from disagg.launch.launcher import resolve_state
from disagg.launch.state import RunState
from disagg.topology import DEFAULT_RUN_DIR, load_topology
from disagg.watch import logs, top


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``top`` and ``logs``."""
    p = sub.add_parser("top", help="a live view of a running topology: engines, route mix, TTFT/TPOT, handoff rate")
    p.add_argument("topology", nargs="?", metavar="TOPOLOGY.yaml", help="which run (default: the only one running)")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--once", action="store_true",
                   help="scrape twice, a second apart, print one view and exit (percentiles since the proxy started)")
    p.add_argument("--json", action="store_true",
                   help="JSON instead of the screen (with --once: one object; else one object per line)")
    p.add_argument("--interval", type=_positive, default=1.0, help="seconds between refreshes (default 1)")
    p.set_defaults(handler=cmd_top)

    p = sub.add_parser("logs", help="the logs of a running topology's processes, local or over SSH")
    p.add_argument("which", nargs="?", metavar="ROLE",
                   help="a role (prefill, decode, both, proxy, supervisor) or a process name (decode[0]); default: all")
    p.add_argument("--topology", "-t", default=None, metavar="TOPOLOGY.yaml",
                   help="which run (default: the only one running)")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--follow", "-f", action="store_true", help="keep printing what is written (tail -F)")
    p.add_argument("--lines", "-n", type=int, default=logs.DEFAULT_LINES, help="lines of each log to start with")
    p.set_defaults(handler=cmd_logs)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value > 3600:
        raise argparse.ArgumentTypeError(f"seconds between 0 and 3600, not {text}")
    return value


def _loader(topology: str | None, run_dir: str | None) -> Callable[[], RunState]:
    """What reads the run's state afresh (each refresh of ``top``); without ``--run-dir`` a run is
    found from any directory, as ``status`` finds it (``resolve_state(anywhere=True)``)."""
    anywhere = run_dir is None
    if topology:
        topo = load_topology(topology, run_dir=run_dir)
        return lambda: resolve_state(topo.run_dir, topo.name, anywhere=anywhere, topology_file=topo.file)
    return lambda: resolve_state(run_dir or DEFAULT_RUN_DIR, None, anywhere=anywhere)


def cmd_top(args: argparse.Namespace) -> int:
    """Redraw the view each ``--interval`` seconds until Ctrl-C or SIGTERM (exit 0); ``--once``: one view."""
    load = _loader(args.topology, args.run_dir)
    if args.once:
        top.emit_once(top.once(load), sys.stdout, as_json=args.json)
        return 0
    try:
        with sigterm_as_ctrl_c():
            top.live(load, sys.stdout, interval=args.interval, as_json=args.json)
    except KeyboardInterrupt:
        return 0
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    """Print (``-f``: follow) the logs of the run's processes of one role, or all."""
    if args.lines < 0:
        raise logs.LogsError(f"--lines: a count of lines, not {args.lines}")
    chosen = logs.sources(_loader(args.topology, args.run_dir)(), args.which)
    if not args.follow:
        return logs.show(chosen, sys.stdout, lines=args.lines)
    try:
        with sigterm_as_ctrl_c():
            return logs.follow(chosen, sys.stdout, lines=args.lines)
    except KeyboardInterrupt:
        return 0

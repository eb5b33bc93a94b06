"""``disagg probe-link``: measure the prefill -> decode link for ``disagg plan``."""

from __future__ import annotations

import argparse
import json

from disagg.errors import LinkError
from disagg.measurements import LinkMeasurement, store_link
from disagg.probe import DEFAULT_SECONDS, DEFAULT_STREAMS, probe_topology
from disagg.topology import load_topology
from disagg.units import fmt_rate, fmt_seconds


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``probe-link``."""
    p = sub.add_parser(
        "probe-link", help="measure TCP throughput (1, 2, 4 streams) and RTT between prefill and decode hosts",
        description="Runs a small sender on the prefill host and a receiver on the decode host (locally, "
                    "over SSH, or across an emulated link) and stores the result next to the topology "
                    "(<name>.probe.json), where `disagg plan` picks it up.")
    p.add_argument("topology", metavar="TOPOLOGY.yaml")
    p.add_argument("--seconds", type=float, default=DEFAULT_SECONDS,
                   help=f"duration of each throughput run (default {DEFAULT_SECONDS:g})")
    p.add_argument("--streams", default=",".join(map(str, DEFAULT_STREAMS)), metavar="N,N,...",
                   help="parallel stream counts to try (default 1,2,4)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(handler=cmd_probe_link)


def _streams(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1 or max(values) > 64:
        raise LinkError(f"--streams: expected stream counts from 1 to 64 like 1,2,4, got {text!r}")
    return values


def render_probe(m: LinkMeasurement) -> str:
    """The measurement as a few readable lines."""
    lines = [f"link {m.prefill_host} ({m.sender}) -> {m.decode_host} ({m.receiver}), {m.path}:"]
    for n, bps in sorted(m.streams_bps.items()):
        best = "  <- best" if n == m.best_streams else ""
        lines.append(f"  {n} stream{'s' if n > 1 else ' '}  {fmt_rate(bps):>11}{best}")
    lines.append(f"  round trip {fmt_seconds(m.rtt_s)}")
    return "\n".join(lines)


def cmd_probe_link(args: argparse.Namespace) -> int:
    """Probe, print, store."""
    if args.seconds <= 0:
        raise LinkError("--seconds must be positive")
    topo = load_topology(args.topology)
    m = probe_topology(topo, streams=_streams(args.streams), seconds=args.seconds)
    path = store_link(topo.file, m)
    if args.json:
        print(json.dumps(m.to_json(), indent=2))
    else:
        print(render_probe(m))
        print(f"stored in {path}; `disagg plan {topo.file}` now uses the measured rate")
    return 0

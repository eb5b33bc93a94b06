"""``disagg check`` and ``disagg make-model``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from disagg.deployment import describe, plan_deployment
from disagg.errors import DisaggError
from disagg.modelgen import EMBEDDED_MODELS, build_model
from disagg.topology import load_topology


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``check`` and ``make-model``."""
    p = sub.add_parser("check", help="validate topology files and print the resolved plan")
    p.add_argument("topologies", nargs="+", metavar="TOPOLOGY.yaml")
    p.set_defaults(handler=cmd_check)

    p = sub.add_parser("make-model", help="build an embedded tiny random-weight model (offline)")
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--embedded", default="tiny", choices=sorted(EMBEDDED_MODELS),
                   help="which embedded model (default: tiny, 1 KiB KV per token)")
    p.set_defaults(handler=cmd_make_model)


def cmd_check(args: argparse.Namespace) -> int:
    """Validate each file; print its plan. Exit 2 if any file is invalid."""
    failed = 0
    for index, path in enumerate(args.topologies):
        if index:
            print()
        try:
            print(describe(plan_deployment(load_topology(path))))
        except DisaggError as exc:
            if len(args.topologies) == 1:
                raise
            print(f"disagg: error: {exc}", file=sys.stderr)
            failed += 1
    return 2 if failed else 0


def cmd_make_model(args: argparse.Namespace) -> int:
    """Build the embedded model into DIR."""
    out = build_model(args.embedded, Path(args.directory))
    cfg = EMBEDDED_MODELS[args.embedded]
    print(f"built embedded model {args.embedded!r} in {out} "
          f"({cfg.layers} layers, KV {cfg.kv_bytes_per_token} bytes/token)")
    return 0

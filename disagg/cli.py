"""The ``disagg`` command line: argparse entry point and the only place that
turns errors into exit codes.

Each feature module contributes its subcommands through ``add_commands``
(listed in ``COMMAND_MODULES``); a subcommand's handler takes the parsed
arguments and returns an exit status. Library code raises ``DisaggError``;
here it becomes ``disagg: error: ...`` on stderr and exit status 2 (a
traceback only with ``--debug``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from disagg import __version__
from disagg.commands.bench import old_spelling
from disagg.errors import DisaggError
from disagg.yamlsrc import did_you_mean

#: modules whose ``add_commands(subparsers)`` registers subcommands
COMMAND_MODULES = (
    "disagg.commands.basic",      # check, make-model
    "disagg.commands.lifecycle",  # up, down, status
    "disagg.commands.plan",       # plan
    "disagg.commands.probe_link",  # probe-link
    "disagg.commands.proxy",      # proxy
    "disagg.commands.bench",      # bench, bench compare
    "disagg.commands.doctor",     # doctor, setup
    "disagg.commands.watch",      # top, logs
    "disagg.commands.export",     # export k8s
)


class _Parser(argparse.ArgumentParser):
    """argparse, with a did-you-mean hint for a mistyped subcommand (``disagg chek``)."""

    def error(self, message: str) -> NoReturn:
        match = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if match:
            choices = re.findall(r"'([^']*)'", match.group(2))
            message += did_you_mean(match.group(1), choices)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    """The full parser with every subcommand registered."""
    parser = _Parser(
        prog="disagg",
        description="Prefill/decode disaggregated LLM serving from one topology YAML.")
    parser.add_argument("--version", action="version", version=f"disagg {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit status. A reader that closed our stdout (``disagg
    check ... | head``) ends the command quietly, as it would a C program (status 141, SIGPIPE's)."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # Python's advice (the signal module's docs): point stdout at devnull so that the
        # interpreter's last flush does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    # `disagg bench URL` is the old spelling of `disagg bench serve URL`
    args = parser.parse_args(old_spelling(sys.argv[1:] if argv is None else argv))
    try:
        return int(args.handler(args) or 0)
    except DisaggError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"disagg: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("disagg: interrupted", file=sys.stderr)
        return 130

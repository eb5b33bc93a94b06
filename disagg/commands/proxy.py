"""``disagg proxy``: the OpenAI-compatible proxy alone, in front of engines
someone else started."""

from __future__ import annotations

import argparse
import logging

from disagg.proxy.config import ProxyConfig


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``proxy``: every setting of :class:`ProxyConfig` as its fields declare it, and the
    process's own options (access log, event loop)."""
    p = sub.add_parser(
        "proxy", help="run the OpenAI-compatible proxy in front of running engines",
        description="Serve an OpenAI-compatible endpoint that sends each request to a prefill "
                    "instance, then to a decode instance (without --prefill: a plain load balancer "
                    "over --decode servers). SIGTERM/SIGINT drain in-flight requests, then exit 0.")
    ProxyConfig.add_arguments(p)
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                   help="event loop (default: auto = uvloop when installed)")
    p.set_defaults(handler=cmd_proxy)


def cmd_proxy(args: argparse.Namespace) -> int:
    """Run the proxy until SIGTERM/SIGINT."""
    from disagg.proxy.server import run_proxy  # aiohttp loads only for this command

    config = ProxyConfig.from_args(args)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format="%(asctime)s disagg-proxy %(levelname)s %(message)s")
    if config.log_level == "debug":   # the proxy's own lines only, not every library's
        logging.getLogger("disagg").setLevel(logging.DEBUG)
    return run_proxy(config, access_log=args.access_log, loop=args.loop)

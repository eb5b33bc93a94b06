"""``disagg proxy``: the OpenAI-compatible proxy alone, in front of engines
someone else started."""

from __future__ import annotations

import argparse
import logging
import os

from disagg.errors import ProxyError
from disagg.proxy.config import (
    API_KEY_ENV,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_MAX_PROMPTS,
    ENGINE_KEY_ENV,
    SEED_ROLES,
    ProxyConfig,
    ProxyTimeouts,
    RoutingConfig,
)
from disagg.serving import FALLBACKS, PROXY_LOG_LEVELS, ROUTING_POLICIES


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``proxy``."""
    d = ProxyTimeouts()
    p = sub.add_parser(
        "proxy", help="run the OpenAI-compatible proxy in front of running engines",
        description="Serve an OpenAI-compatible endpoint that sends each request to a prefill "
                    "instance, then to a decode instance (without --prefill: a plain load balancer "
                    "over --decode servers). SIGTERM/SIGINT drain in-flight requests, then exit 0.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000; 0 = any free port)")
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill engine URLs")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode engine URLs (colocated servers when --prefill is absent)")
    p.add_argument("--handoff", "--engine", dest="handoff", default="vllm",
                   help="the KV handoff protocol between the engines: vllm (NIXL, the socket connector), "
                        "sglang, vllm-lmcache, vllm-socket-stream (the socket connector streaming the KV while "
                        "prefill computes), vllm-nixl-push (NixlPushConnector: decode registers its blocks while "
                        "prefill computes) (default vllm; --engine is its old name)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV} if set)")
    p.add_argument("--engine-key", default=None,
                   help=f"send 'Authorization: Bearer KEY' with every request to an engine "
                        f"(default: ${ENGINE_KEY_ENV} if set; prefer the variable, ps shows arguments)")
    p.add_argument("--fallback", choices=FALLBACKS, default="local",
                   help="when prefill fails: 'local' lets decode serve alone, 'never' answers 503")
    p.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY, metavar="N",
                   help=f"requests served at once; more are answered 429 with Retry-After "
                        f"(default: {DEFAULT_MAX_CONCURRENCY}); each prompt of a split batch counts")
    p.add_argument("--max-prompts", type=int, default=DEFAULT_MAX_PROMPTS, metavar="N",
                   help=f"prompts in one request; more are answered 400 (default: {DEFAULT_MAX_PROMPTS})")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="B",
                   help=f"largest request body; larger is answered 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--connect-timeout", type=float, default=d.connect, metavar="S")
    p.add_argument("--request-timeout", type=float, default=d.request, metavar="S",
                   help="longest wait for an engine's reply or the next chunk of its stream")
    p.add_argument("--health-interval", type=float, default=d.health_interval, metavar="S")
    p.add_argument("--health-timeout", type=float, default=d.health_timeout, metavar="S")
    p.add_argument("--drain-timeout", type=float, default=d.drain, metavar="S",
                   help="on SIGTERM, how long in-flight requests may finish")
    p.add_argument("--client-header-timeout", type=float, default=d.client_header, metavar="S",
                   help="a client connection's request headers must arrive within S (also: idle keep-alive)")
    p.add_argument("--client-body-timeout", type=float, default=d.client_body, metavar="S",
                   help="a request's whole body must arrive within S of its headers (else 408)")
    p.add_argument("--send-timeout", type=float, default=d.send, metavar="S",
                   help="a client that reads nothing of its stream for S is let go, its engine requests aborted")
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument("--log-level", choices=PROXY_LOG_LEVELS, default="info",
                   help="debug: also a line per routing decision (every option's predicted TTFT) and per "
                        "prompt's first token (observed against predicted) (default: info)")
    p.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                   help="event loop (default: auto = uvloop when installed)")
    p.add_argument("--handoff-option", action="append", default=[], metavar="KEY=VALUE",
                   help="engine-specific handoff setting, repeatable (sglang: bootstrap_ports=P1,P2 "
                        "one per --prefill URL; vllm-socket-stream: kv_peers=H1:P1,H2:P2, each --prefill "
                        "URL's KV listener)")
    r = RoutingConfig()
    p.add_argument("--routing-policy", choices=ROUTING_POLICIES, default=r.policy,
                   help="per prompt: 'split' always through the KV handoff (default), 'local' decode "
                        "prefills itself, 'auto' the path with the lowest predicted TTFT (needs the "
                        "--route-* seed figures; `disagg up` passes them from the topology)")
    p.add_argument("--route-kv-bytes-per-token", type=float, metavar="B", help="auto: KV cache bytes per token")
    p.add_argument("--route-prefill-rate", type=float, metavar="TOK/S", help="auto: prefill engines' seed rate")
    p.add_argument("--route-decode-rate", type=float, metavar="TOK/S",
                   help="auto: decode engines' seed prefill rate (default: the prefill rate)")
    p.add_argument("--route-measured-rates", type=_roles, default=(), metavar="ROLE[,ROLE]",
                   help="auto: the roles (prefill, decode) whose seed rate was measured on their hosts, "
                        "not estimated (`disagg up` passes it)")
    p.add_argument("--route-link-rate", type=float, metavar="B/S", help="auto: seed link rate, bytes per second")
    p.add_argument("--route-handoff-fixed", type=float, metavar="S",
                   help="auto: seed fixed cost of one handoff (default: the largest measured per connector)")
    p.add_argument("--route-overhead", type=float, default=r.overhead_s, metavar="S",
                   help="auto: seed per-request engine cost besides the prompt's tokens")
    p.add_argument("--route-stall-weight", type=float, default=r.stall_weight, metavar="W",
                   help="auto: TTFT seconds one second of stall imposed on each running decode is worth")
    p.add_argument("--route-streaming-layers", type=int, metavar="N",
                   help="auto, --handoff vllm-socket-stream: the model's layers; a split is predicted with only "
                        "the part of the KV transfer the streamed prefill does not hide, and splits take no "
                        "samples of the link (1: priced as if the KV followed the prefill)")
    p.add_argument("--route-whole", action="store_true",
                   help="auto: an idle prefill engine may serve a request alone while decode engines are backed up")
    p.add_argument("--route-chars-per-token", type=float, default=r.chars_per_token, metavar="C",
                   help="prompt length estimate without --tokenizer (calibrated live)")
    p.add_argument("--tokenizer", metavar="TOKENIZER.json", help="the model's tokenizer, for exact prompt lengths")
    p.add_argument("--route-explore-after", type=float, default=r.explore_after_s, metavar="S",
                   help="auto: re-measure a path untaken for S seconds ... (default %(default)s)")
    p.add_argument("--route-explore-decisions", type=int, default=r.explore_decisions, metavar="N",
                   help="... and N decisions ... (default %(default)s)")
    p.add_argument("--route-explore-within", type=float, default=r.explore_within, metavar="F",
                   help="... whose score is within F x the best one's (0: never explore; default %(default)s)")
    p.set_defaults(handler=cmd_proxy)


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """The :class:`ProxyConfig` the parsed arguments describe."""
    timeouts = ProxyTimeouts(connect=args.connect_timeout, request=args.request_timeout,
                             health_interval=args.health_interval, health_timeout=args.health_timeout,
                             drain=args.drain_timeout, client_header=args.client_header_timeout,
                             client_body=args.client_body_timeout, send=args.send_timeout)
    return ProxyConfig(decode=tuple(args.decode), prefill=tuple(args.prefill), host=args.host, port=args.port,
                       handoff=args.handoff, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                       engine_key=args.engine_key or os.environ.get(ENGINE_KEY_ENV) or None,
                       fallback=args.fallback, max_concurrency=args.max_concurrency, max_prompts=args.max_prompts,
                       max_body_bytes=args.max_body_bytes, timeouts=timeouts,
                       handoff_options=parse_handoff_options(args.handoff_option),
                       routing=RoutingConfig(
                           policy=args.routing_policy, kv_bytes_per_token=args.route_kv_bytes_per_token,
                           prefill_tokens_per_s=args.route_prefill_rate,
                           decode_tokens_per_s=args.route_decode_rate, link_bytes_per_s=args.route_link_rate,
                           handoff_fixed_s=args.route_handoff_fixed, overhead_s=args.route_overhead,
                           stall_weight=args.route_stall_weight, whole=args.route_whole,
                           tokenizer=args.tokenizer, chars_per_token=args.route_chars_per_token,
                           explore_after_s=args.route_explore_after, explore_decisions=args.route_explore_decisions,
                           explore_within=args.route_explore_within,
                           streaming_layers=args.route_streaming_layers,
                           measured_rates=args.route_measured_rates),
                       log_level=args.log_level)


def parse_handoff_options(items: list[str]) -> tuple[tuple[str, str], ...]:
    """``["bootstrap_ports=8998"]`` -> ``(("bootstrap_ports", "8998"),)``; raises ProxyError."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ProxyError(f"--handoff-option {item!r}: expected KEY=VALUE")
        out.append((key.strip(), value.strip()))
    return tuple(out)


def _roles(text: str) -> tuple[str, ...]:
    """``"prefill,decode"`` -> ``("prefill", "decode")``: roles among :data:`SEED_ROLES`."""
    roles = tuple(r.strip() for r in text.split(",") if r.strip())
    unknown = [r for r in roles if r not in SEED_ROLES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown role(s) {', '.join(unknown)}; expected {', '.join(SEED_ROLES)}")
    return roles


def cmd_proxy(args: argparse.Namespace) -> int:
    """Run the proxy until SIGTERM/SIGINT."""
    from disagg.proxy.server import run_proxy  # aiohttp loads only for this command

    config = config_from_args(args)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format="%(asctime)s disagg-proxy %(levelname)s %(message)s")
    if config.log_level == "debug":   # the proxy's own lines only, not every library's
        logging.getLogger("disagg").setLevel(logging.DEBUG)
    return run_proxy(config, access_log=args.access_log, loop=args.loop)

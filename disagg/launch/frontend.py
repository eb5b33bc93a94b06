"""The front door's command line: the built-in proxy, or a Rust router from PyPI.

``proxy.kind`` in the topology picks it:

- ``builtin``: ``python -m disagg proxy`` with the handoff of the topology's
  engine and connector (``--handoff vllm | sglang | vllm-lmcache |
  vllm-socket-stream | vllm-nixl-push``) and its ``--handoff-option`` settings
  (SGLang: the prefill bootstrap ports; LMCache: decode receiver ports and the
  notification port; the streaming socket connector: each prefill instance's KV
  listener; NIXL push needs none: the proxy learns each prefill engine's NIXL
  coordinates from its replies).
- ``vllm-router`` (PyPI ``vllm-router``, module ``vllm_router.launch_router``):
  ``--vllm-pd-disaggregation --prefill URL --decode URL`` (its default KV
  connector is NIXL, the only one it shares with disagg).
- ``sglang-router`` (PyPI ``sglang-router``, module
  ``sglang_router.launch_router``): ``--pd-disaggregation --prefill URL
  BOOTSTRAP_PORT --decode URL``.

Colocated topologies give the routers ``--worker-urls`` (plain load balancing).
The routers are started with the interpreter that runs disagg; install them
there (``pip install vllm-router`` / ``sglang-router``).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import fields
from pathlib import Path

from disagg.deployment import Deployment
from disagg.errors import DeploymentError, DisaggError
from disagg.planning import route_seeds
from disagg.proxy.config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_MAX_PROMPTS,
    ProxyConfig,
    ProxyTimeouts,
    RoutingConfig,
)
from disagg.registry import engine_adapter

log = logging.getLogger("disagg")

ROUTER_MODULES = {"vllm-router": "vllm_router.launch_router", "sglang-router": "sglang_router.launch_router"}
#: proxy kind -> the engine it can route P/D requests for
ROUTER_ENGINES = {"vllm-router": "vllm", "sglang-router": "sglang"}


def handoff_kind(dep: Deployment) -> str:
    """The proxy's handoff for a planned topology: the engine adapter's, which asks its connector
    (:meth:`disagg.engines.base.EngineAdapter.handoff`); colocated, the engine's name."""
    topo = dep.topology
    return topo.engine if topo.colocated else engine_adapter(topo.engine).handoff(topo)


def handoff_options(dep: Deployment) -> tuple[tuple[str, str], ...]:
    """The proxy's handoff options for a planned topology (SGLang: the prefill bootstrap ports;
    vLLM + LMCache: decode receiver ports and the notify port; the streaming socket connector:
    each prefill instance's KV listener, in the order of the proxy's ``--prefill`` URLs), as the
    engine adapter and its connector say."""
    topo = dep.topology
    return () if topo.colocated else engine_adapter(topo.engine).handoff_options(topo)


def routing_config(dep: Deployment) -> RoutingConfig:
    """The proxy's routing for a planned topology: ``routing.policy`` and, for ``auto``, the seed
    figures ``disagg plan`` works with (:func:`disagg.planning.route_seeds`: with the socket
    connector's ``streaming``, the model's layers, so that splits are priced as streamed) and
    the model's tokenizer when it is on this machine, and ``routing.slo``. When the seeds cannot be worked out (a
    model whose config is not at hand), the proxy splits every prompt, and says so."""
    topo = dep.topology
    engine = engine_adapter(topo.engine)
    if topo.colocated or not engine.decode_prefills:  # nothing to choose: one server, or decode cannot prefill
        return RoutingConfig()
    if topo.routing.policy != "auto":
        return RoutingConfig(policy=topo.routing.policy)
    try:
        seeds = route_seeds(topo)
    except DisaggError as exc:
        log.warning("routing: policy auto needs the model's KV size and the hosts' rates (%s); "
                    "the proxy splits every prompt", exc)
        return RoutingConfig(policy="split")
    tokenizer = Path(topo.model.path).expanduser() / "tokenizer.json"
    return RoutingConfig(
        policy="auto", kv_bytes_per_token=seeds.kv_bytes_per_token, prefill_tokens_per_s=seeds.prefill_tokens_per_s,
        decode_tokens_per_s=seeds.decode_tokens_per_s, link_bytes_per_s=seeds.link_bytes_per_s,
        handoff_fixed_s=seeds.handoff_fixed_s,
        whole=engine.serves_whole(topo),
        tokenizer=str(tokenizer) if tokenizer.is_file() else None,
        explore_after_s=topo.routing.explore_after_s, explore_decisions=topo.routing.explore_decisions,
        explore_within=topo.routing.explore_within, streaming_layers=seeds.streaming_layers,
        measured_rates=seeds.measured_rates, slo_ttft_s=topo.routing.slo_ttft_s, slo_tpot_s=topo.routing.slo_tpot_s)


def proxy_config(dep: Deployment) -> ProxyConfig:
    """The built-in proxy's configuration for a planned topology: URLs, the handoff kind and its
    options (role ``both`` instances act as decode servers)."""
    topo = dep.topology
    t = topo.timeouts
    return ProxyConfig(
        decode=tuple(e.url for e in dep.role("decode") + dep.role("both")),
        prefill=tuple(e.url for e in dep.role("prefill")),
        host=topo.proxy.host, port=topo.proxy.port, handoff=handoff_kind(dep),
        api_key=topo.proxy.api_key, fallback=topo.proxy.fallback,
        max_concurrency=topo.proxy.max_concurrency or DEFAULT_MAX_CONCURRENCY,
        max_prompts=topo.proxy.max_prompts or DEFAULT_MAX_PROMPTS,
        max_body_bytes=topo.proxy.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
        timeouts=ProxyTimeouts(**{f.name: getattr(t, f.name) for f in fields(ProxyTimeouts)}),
        handoff_options=handoff_options(dep), routing=routing_config(dep), log_level=topo.proxy.log_level)


def builtin_argv(dep: Deployment) -> list[str]:
    """``python -m disagg proxy ...`` for this deployment; the API key and the engine key are
    left to the environment (``DISAGG_PROXY_API_KEY``, ``DISAGG_ENGINE_KEY``), never the command line."""
    return [sys.executable, "-m", "disagg", *proxy_config(dep).to_argv(with_api_key=False)]


def router_argv(dep: Deployment, python: str | None = None) -> list[str]:
    """The Rust router's command line for ``proxy.kind`` vllm-router or sglang-router."""
    topo = dep.topology
    kind = topo.proxy.kind
    if ROUTER_ENGINES[kind] != topo.engine:
        raise DeploymentError(f"{topo.located('proxy.kind')}: proxy.kind {kind} routes engine {ROUTER_ENGINES[kind]}, "
                        f"but the topology's engine is {topo.engine}")
    if kind == "vllm-router" and not topo.colocated and topo.connector != "nixl":
        raise DeploymentError(f"{topo.located('proxy.kind')}: proxy.kind vllm-router speaks vLLM's NIXL handoff; "
                        f"connector {topo.connector} needs proxy.kind builtin")
    if topo.proxy.api_key:
        raise DeploymentError(f"{topo.located('proxy.api_key')}: proxy.api_key is enforced by the builtin proxy only; "
                        f"remove it or use proxy.kind builtin instead of {kind}")
    argv = [python or sys.executable, "-m", ROUTER_MODULES[kind],
            "--host", topo.proxy.host, "--port", str(topo.proxy.port)]
    if topo.colocated:
        return [*argv, "--worker-urls", *(e.url for e in dep.role("both"))]
    argv.append("--vllm-pd-disaggregation" if kind == "vllm-router" else "--pd-disaggregation")
    for eng in dep.role("prefill"):
        argv += ["--prefill", eng.url]
        if kind == "sglang-router":
            argv.append(str(eng.instance.kv_port))
    for eng in dep.role("decode"):
        argv += ["--decode", eng.url]
    return argv


def frontend_argv(dep: Deployment) -> list[str]:
    """The front door's command line for the topology's ``proxy.kind``."""
    if dep.topology.proxy.kind == "builtin":
        return builtin_argv(dep)
    return router_argv(dep)

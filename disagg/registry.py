"""Lazy name -> implementation registries (engines, KV connectors).

Modules are imported only when a topology names them, so an unused engine's
dependencies never load.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, cast

from disagg.errors import DeploymentError

if TYPE_CHECKING:
    from disagg.engines.base import EngineAdapter
    from disagg.kv.base import VllmKVAdapter

ENGINE_ADAPTERS: dict[str, str] = {
    "vllm": "disagg.engines.vllm:VllmEngine",
    "sglang": "disagg.engines.sglang:SglangEngine",
}

VLLM_KV_ADAPTERS: dict[str, str] = {
    "nixl": "disagg.kv.nixl:NixlVllmAdapter",
    "nixl-push": "disagg.kv.nixl:NixlPushVllmAdapter",
    "socket": "disagg.kv.socket:SocketVllmAdapter",
    "lmcache": "disagg.kv.lmcache:LmcacheVllmAdapter",
}


def _load(table: dict[str, str], name: str, what: str) -> object:
    try:
        target = table[name]
    except KeyError:
        raise DeploymentError(f"{what} {name!r} is not supported yet; supported: {', '.join(table)}") from None
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)()


def engine_adapter(name: str) -> EngineAdapter:
    """The adapter for the topology's ``engine:`` value."""
    # an import by name from the table above, which the checker cannot follow
    return cast("EngineAdapter", _load(ENGINE_ADAPTERS, name, "engine"))


def vllm_kv_adapter(name: str) -> VllmKVAdapter:
    """The vLLM connector adapter for the topology's ``connector:`` value."""
    # an import by name from the table above, which the checker cannot follow
    return cast("VllmKVAdapter", _load(VLLM_KV_ADAPTERS, name, "connector (with engine vllm)"))

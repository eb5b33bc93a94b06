"""The OpenAI-compatible proxy: prefill -> decode handoff, balancing, health,
metrics. Public API: :class:`ProxyConfig`, :class:`ProxyTimeouts`,
:func:`build_app`, :class:`ProxyServer`, :func:`run_proxy` (imported lazily,
so ``disagg.proxy.config`` loads without aiohttp)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ProxyConfig": "disagg.proxy.config",
    "ProxyTimeouts": "disagg.proxy.config",
    "build_app": "disagg.proxy.app",
    "ProxyServer": "disagg.proxy.server",
    "run_proxy": "disagg.proxy.server",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'disagg.proxy' has no attribute {name!r}") from None
    return getattr(importlib.import_module(module), name)

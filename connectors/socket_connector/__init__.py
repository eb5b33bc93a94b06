"""Our TCP KV connector for vLLM (``kv_connector_module_path`` target).

The transport (wire.py, auth.py, layout.py, leases.py, server.py, client.py,
config.py) does not import vLLM; connector.py and its halves do, lazily
through ``SocketKVConnector`` below.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SocketKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "SocketKVConnector":
        from .connector import SocketKVConnector

        return SocketKVConnector
    raise AttributeError(name)

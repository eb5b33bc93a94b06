"""Our TCP KV connector for vLLM (``kv_connector_module_path`` target).

wire.py, auth.py, layout.py, wireformat.py, leases.py, counters.py and
config.py do not import vLLM; server.py, client.py and streams.py reach it
only through metadata.py (whose classes subclass vLLM's
``KVConnectorMetadata``), and connector.py and its halves import it
directly, lazily through ``SocketKVConnector`` below.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SocketKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "SocketKVConnector":
        from .connector import SocketKVConnector

        return SocketKVConnector
    raise AttributeError(name)

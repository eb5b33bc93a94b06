"""What several benchmark scripts share: a streamed completion timed to its first
token, and free local ports for a topology they write themselves.

The scripts run as ``.venv/bin/python benchmarks/NAME.py``, so this directory is
on ``sys.path`` and they ``import _common``. Server-sent events are parsed by
:class:`disagg.sse.SSEParser`, the one SSE parser of the project (correct
wherever a read splits an event).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from typing import Any

from disagg.sse import SSEParser

#: bytes asked of the socket per read: whatever has arrived, up to this much
READ_BYTES = 64 * 1024


def streamed_ttft(url: str, body: dict[str, Any], key: str | None = None, *,
                  timeout: float = 600.0) -> tuple[float, dict[str, Any]]:
    """POST ``body`` to ``url`` (a completions endpoint) as a streamed request with usage.

    Returns (seconds from sending to the first event with choices, the usage of
    the last event that had one). ``key``: sent as ``Authorization: Bearer``
    (what an engine guarded by the run's engine key wants).
    """
    headers = {"content-type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url, data=data, headers=headers)
    parser = SSEParser()
    t0 = time.perf_counter()
    ttft, usage = 0.0, {}
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        while chunk := resp.read1(READ_BYTES):
            for event in parser.feed(chunk):
                if event.done:
                    continue
                payload = event.json()
                if payload.get("choices") and not ttft:
                    ttft = time.perf_counter() - t0
                usage = payload.get("usage") or usage
    return ttft, usage


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that are free on 127.0.0.1 right now."""
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports

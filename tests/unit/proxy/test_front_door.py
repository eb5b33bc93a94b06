"""The proxy's front door against hostile clients, in front of stand-in engines that record
every request they get (tests/e2e/test_front_door.py repeats the engine-facing cases against
real vLLM engines).

- paths with dot segments, or any route the proxy does not serve, never reach an engine;
- a batch cannot multiply the proxy's work: ``max_prompts``, slots per engine request;
- a client that stops reading a streamed batch is let go after ``timeouts.send``;
- slow headers and slow bodies are cut off (``client_header`` / ``client_body``), and a slow
  body holds no concurrency slot;
- a client's ``X-Request-Id`` reaches engines only when short and printable.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import replace

import pytest
from proxy_standin import FAST, wait_for

from disagg.prometheus_text import sample_sum
from disagg.proxy.admission import MAX_REQUEST_ID_CHARS, REQUEST_ID_REPLACED
from disagg.proxy.engine_routes import path_problem

HOSTILE_PATHS = [
    "/v1/../invocations",
    "/v1/%2e%2e/invocations",
    "/v1/%2E%2E/invocations",
    "/v1/x/../../invocations",
    "/v1/../../collective_rpc",
    "/v1/x/../../sleep",
    "/v1/%2e%2e/inference/v1/generate",
    "/v1/./completions",
    "/v1/%2e/completions",
    "/v1//completions",
    "/v1/models%2f..%2f..%2finvocations",
    "/v1/models%5c..%5cinvocations",
    "/v1/completions%00",
]


async def raw_request(url: str, head: bytes, body: bytes = b"", timeout: float = 5.0) -> tuple[int, bytes]:
    """Send bytes as they are (no client library resolves anything); the status and the rest."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head + body)
        await writer.drain()
        async with asyncio.timeout(timeout):
            data = await reader.read(65536)
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
        return status, data
    finally:
        writer.close()


def post_head(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n").encode()


@pytest.mark.parametrize("path", HOSTILE_PATHS)
def test_a_path_that_normalises_differently_is_refused(path: str) -> None:
    assert path_problem(path) is not None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions?x=1", "/health", "/v1/models/",
                                  "/v1/responses/resp_a%20b"])
def test_a_plain_path_passes(path: str) -> None:
    assert path_problem(path) is None


async def test_dot_segments_never_reach_an_engine(standin, proxy) -> None:
    p = await standin("P")
    d = await standin("D")
    server = await proxy(prefill=[p.url], decode=[d.url], engine_key="engine-secret")
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2}).encode()
    for path in HOSTILE_PATHS:
        status, data = await raw_request(server.url, post_head(path, body), body)
        assert status == 404, (path, data[:300])
    for path in ("/invocations", "/inference/v1/generate", "/v1/embeddings", "/v1/unknown", "/collective_rpc",
                 "/sleep", "/ping", "/load", "/openapi.json"):
        status, data = await raw_request(server.url, post_head(path, body), body)
        assert status in (404, 405), (path, data[:300])
    assert p.received == [] and d.received == [], "an engine saw a request it must not"
    metrics = await _metrics(server)
    assert sample_sum(metrics, "disagg_proxy_rejected_total", reason="path") == len(HOSTILE_PATHS)


async def test_more_prompts_than_max_prompts_is_400_before_any_engine(standin, proxy, http) -> None:
    p = await standin("P")
    d = await standin("D")
    server = await proxy(prefill=[p.url], decode=[d.url], max_prompts=8)
    async with http.post(server.url + "/v1/completions",
                         json={"model": "tiny", "prompt": ["a"] * 9, "max_tokens": 2}) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["param"] == "prompt" and "max_prompts" in error["message"], error
    async with http.post(server.url + "/v1/completions",
                         json={"model": "tiny", "prompt": ["a"] * 8, "max_tokens": 2}) as resp:
        assert resp.status == 200
        assert len((await resp.json())["choices"]) == 8
    assert len(d.generations()) == 8


async def test_max_prompts_bounds_only_what_the_proxy_splits(standin, proxy, http) -> None:
    p = await standin("P")
    d = await standin("D")
    server = await proxy(prefill=[p.url], decode=[d.url], max_prompts=2)
    body = {"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 2, "n": 2}   # n > 1: one request, whole
    async with http.post(server.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
    assert len(d.generations()) == 1 and p.received == []


async def test_a_prompt_failing_after_a_batch_stream_began_ends_the_stream(standin, proxy, http) -> None:
    """Two routes run at once (max_concurrency 2); the fourth prompt's prefill is refused once the
    stream is under way: its error arrives in-stream and the reply ends, its slots freed."""
    p = await standin("P", fail_on_prompt="d")
    d = await standin("D", tokens=3)
    server = await proxy(prefill=[p.url], decode=[d.url], max_concurrency=2)
    body = {"model": "tiny", "prompt": ["a", "b", "c", "d"], "max_tokens": 3, "stream": True}
    async with asyncio.timeout(10):
        async with http.post(server.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            events = [line async for line in resp.content if line.startswith(b"data: ")]
    assert b"prompt refused" in events[-2] and events[-1] == b"data: [DONE]\n", events[-3:]
    await wait_for(lambda: server.app_state.slots.used == 0)


async def test_bodies_read_at_once_are_bounded_before_any_byte_is_read(standin, proxy, http,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("disagg.proxy.app.BODY_READ_BYTES", 1000)
    d = await standin("D")
    server = await proxy(decode=[d.url], max_body_bytes=1000)
    host, port = server.url.removeprefix("http://").split(":")
    _reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(post_head("/v1/completions", b"x" * 700) + b'{"model": ')    # 700 announced, slow
    await wait_for(lambda: server.app_state.reading.used == 700)
    big = json.dumps({"model": "tiny", "prompt": "y" * 400}).encode()
    status, data = await raw_request(server.url, post_head("/v1/completions", big), big)
    assert status == 429, data[:300]
    async with http.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
        assert resp.status == 200, "a small body still fits"
    writer.close()
    await wait_for(lambda: server.app_state.reading.used == 0)
    assert len(d.generations()) == 1


async def test_a_client_that_never_reads_a_whole_reply_is_let_go(standin, proxy) -> None:
    d = await standin("D", tokens=300_000)      # a ~2 MB JSON reply
    server = await proxy(decode=[d.url], timeouts=replace(FAST, send=0.5))
    body = json.dumps({"model": "tiny", "prompt": "x"}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    try:
        sock.sendall(post_head("/v1/completions", body) + body)
        await wait_for(lambda: len(d.generations()) == 1)
        aiohttp_server = server._runner.server   # the proxy's own view of its client connections
        assert aiohttp_server is not None and len(aiohttp_server.connections) == 1
        # the reply is written, the client reads nothing: the proxy drops the connection (a proxy that
        # waited for the client would hold it for as long as the client does, here past the deadline)
        await wait_for(lambda: not aiohttp_server.connections, timeout=15)

        def read_to_the_end() -> bool:
            """True once the connection ends (EOF or reset); False if it stays open 5 s without a byte."""
            sock.settimeout(5)
            try:
                while sock.recv(1 << 20):
                    pass
            except ConnectionResetError:
                return True
            except TimeoutError:
                return False
            return True

        assert await asyncio.to_thread(read_to_the_end), "the proxy dropped the client but its socket stays open"
    finally:
        sock.close()


async def test_a_batch_takes_a_slot_per_engine_request_it_runs(standin, proxy, http) -> None:
    gate = asyncio.Event()
    p = await standin("P")
    d = await standin("D", tokens=2, gate=gate)
    server = await proxy(prefill=[p.url], decode=[d.url], max_concurrency=4)
    body = {"model": "tiny", "prompt": ["a", "b", "c", "d", "e", "f"], "max_tokens": 2, "stream": True}
    batch = await http.post(server.url + "/v1/completions", json=body)
    await wait_for(lambda: d.running == 4)
    assert server.app_state.slots.used == 4
    async with http.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
        assert resp.status == 429, "a batch running 4 engine requests fills a cap of 4"
    gate.set()
    events = [line async for line in batch.content if line.startswith(b"data: {")]
    batch.close()
    assert len({json.loads(e[6:])["choices"][0]["index"] for e in events if json.loads(e[6:])["choices"]}) == 6
    await wait_for(lambda: server.app_state.slots.used == 0)


async def test_a_client_that_stops_reading_a_streamed_batch_is_let_go(standin, proxy) -> None:
    p = await standin("P")
    d = await standin("D", tokens=10**7)      # an endless stream per prompt
    server = await proxy(prefill=[p.url], decode=[d.url], timeouts=replace(FAST, send=0.5))
    body = json.dumps({"model": "tiny", "prompt": ["a", "b", "c", "d"], "max_tokens": 10**7,
                       "stream": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(post_head("/v1/completions", body) + body)       # and never reads
    try:
        await wait_for(lambda: d.running == 4, timeout=5)
        # let go once the socket buffers are full and a send waits out its 0.5 s: 3-4 s here when
        # idle, up to 8 s with the machine's two cores loaded (filling the buffers is CPU work)
        await wait_for(lambda: d.running == 0, timeout=15)
    finally:
        sock.close()
    assert d.aborted == 4, "every engine request of the stalled client was aborted"
    await wait_for(lambda: server.app_state.slots.used == 0)


async def test_slow_headers_are_cut_off_and_others_are_served(standin, proxy, http) -> None:
    d = await standin("D")
    server = await proxy(decode=[d.url], timeouts=replace(FAST, client_header=0.5))
    host, port = server.url.removeprefix("http://").split(":")
    slow = []
    for _ in range(20):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")   # never ends its head
        slow.append((reader, writer))
    started = time.monotonic()
    async with http.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
        assert resp.status == 200
    for reader, writer in slow:
        async with asyncio.timeout(5):
            assert await reader.read() == b"", "the proxy closes a connection whose head never ends"
        writer.close()
    assert time.monotonic() - started < 3


async def test_a_slow_body_is_408_and_holds_no_slot(standin, proxy, http) -> None:
    d = await standin("D")
    server = await proxy(decode=[d.url], max_concurrency=1, timeouts=replace(FAST, client_body=0.5))
    host, port = server.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(post_head("/v1/completions", b"x" * 100) + b'{"model": ')   # 10 of 100 bytes
    async with http.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
        assert resp.status == 200, "a client sending its body slowly takes no slot"
    async with asyncio.timeout(5):
        head = await reader.read(65536)
    writer.close()
    assert head.startswith(b"HTTP/1.1 408"), head[:200]
    assert d.generations()[0].body["prompt"] == "x" and len(d.generations()) == 1


@pytest.mark.parametrize(("given", "kept"), [
    ("a" * MAX_REQUEST_ID_CHARS, True),
    ("a" * (MAX_REQUEST_ID_CHARS + 1), False),
    ("tab\there", False),
    ("space here", False),
    ("ok-id_1.2:3", True),
])
async def test_a_client_request_id_reaches_engines_only_short_and_printable(standin, proxy, http, given: str,
                                                                            kept: bool) -> None:
    d = await standin("D")
    server = await proxy(decode=[d.url])
    async with http.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"},
                         headers={"X-Request-Id": given}) as resp:
        assert resp.status == 200
        seen = d.generations()[0].headers["X-Request-Id"]
        assert resp.headers["X-Request-Id"] == seen
        assert (seen == given) is kept
        assert (REQUEST_ID_REPLACED in resp.headers) is not kept
    if not kept:
        assert len(seen) <= MAX_REQUEST_ID_CHARS and seen.isalnum()
    body = {"model": "tiny", "prompt": ["x", "y"], "stream": True}
    async with http.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": given}) as resp:
        assert resp.status == 200
        assert (REQUEST_ID_REPLACED in resp.headers) is not kept, "a streamed reply says so too"
        await resp.read()


async def _metrics(server) -> str:
    import aiohttp
    async with aiohttp.ClientSession() as session, session.get(server.url + "/metrics") as resp:
        return (await resp.read()).decode()

"""The engine guard (vLLM ``--middleware``): only the engine key opens an engine, except read-only probes.

First at the ASGI level around a fake app that records what reached it; then
around a small Starlette app routed like vLLM's, served by uvicorn (the
server vLLM uses), with raw HTTP so odd paths reach the server unchanged:
whatever the router would route to ``/invocations`` must be refused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest
from disagg_connectors.engine_guard import KEY_ENV, OPEN_PATHS, EngineGuard

KEY = "k3y-0123456789abcdef"


class FakeApp:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def __call__(self, scope, receive, send) -> None:
        self.seen.append((scope["type"], scope.get("path", "")))
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})


async def call(guard: EngineGuard, method: str, path: str, *, auth: str | None = None, root_path: str = "",
               kind: str = "http", extensions: dict | None = None) -> list[dict]:
    headers = [(b"host", b"engine")]
    if auth is not None:
        headers.append((b"Authorization", auth.encode("latin-1")))
    scope = {"type": kind, "path": path, "root_path": root_path, "headers": headers,
             "query_string": b"", "extensions": extensions or {}}
    if kind == "http":
        scope["method"] = method
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await guard(scope, receive, send)
    return sent


def status(sent: list[dict]) -> int:
    return next(m["status"] for m in sent if m["type"].endswith("response.start"))


@pytest.fixture
def app() -> FakeApp:
    return FakeApp()


@pytest.fixture
def guard(app: FakeApp) -> EngineGuard:
    return EngineGuard(app, key=KEY)


@pytest.mark.parametrize("path", sorted(OPEN_PATHS))
@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_read_only_probes_need_no_key(guard: EngineGuard, app: FakeApp, method: str, path: str) -> None:
    assert status(await call(guard, method, path)) == 200
    assert app.seen == [("http", path)]


async def test_open_probes_are_exactly_these() -> None:
    assert {"/health", "/ping", "/metrics", "/version", "/load"} == OPEN_PATHS


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
    ("POST", "/v1/responses"), ("POST", "/invocations"), ("POST", "/tokenize"), ("POST", "/detokenize"),
    ("POST", "/pooling"), ("POST", "/classify"), ("POST", "/score"), ("POST", "/rerank"),
    ("POST", "/inference/v1/generate"), ("POST", "/sleep"), ("POST", "/reset_prefix_cache"),
    ("POST", "/collective_rpc"), ("POST", "/scale_elastic_ep"), ("GET", "/openapi.json"), ("GET", "/docs"),
    ("GET", "/server_info"), ("GET", "/is_sleeping"),
    # probes with a method that writes (SageMaker's POST /ping runs a health check)
    ("POST", "/ping"), ("POST", "/health"), ("POST", "/metrics"), ("DELETE", "/health"),
])
async def test_everything_else_needs_the_key(guard: EngineGuard, app: FakeApp, method: str, path: str) -> None:
    for auth in (None, "Bearer wrong", f"Basic {KEY}", "Bearer", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}",
                 f"Bearer  {KEY}", KEY):
        sent = await call(guard, method, path, auth=auth)
        assert status(sent) == 401, auth
        start = sent[0]
        assert (b"www-authenticate", b"Bearer") in start["headers"]
        assert (b"content-type", b"application/json") in start["headers"]
        error = json.loads(sent[1]["body"])["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == 401 and error["type"] == "AuthenticationError" and "engine key" in error["message"]
        assert KEY not in sent[1]["body"].decode()
    assert app.seen == []  # nothing reached the engine
    assert status(await call(guard, method, path, auth=f"Bearer {KEY}")) == 200
    assert status(await call(guard, method, path, auth=f"bearer {KEY}")) == 200  # the scheme is case-insensitive
    assert app.seen == [("http", path)] * 2


@pytest.mark.parametrize("path", [
    "//invocations", "/Invocations", "/INVOCATIONS", "/invocations/", "/./invocations", "/health/../invocations",
    "//health", "/Health", "/health/", "/metrics/", "/metricsx", "/metrics/../invocations", "/health%2F",
    "", "/",
])
async def test_odd_paths_are_not_probes(guard: EngineGuard, app: FakeApp, path: str) -> None:
    assert status(await call(guard, "GET", path)) == 401
    assert status(await call(guard, "POST", path)) == 401
    assert app.seen == []


async def test_options_passes_for_cors_preflight(guard: EngineGuard, app: FakeApp) -> None:
    assert status(await call(guard, "OPTIONS", "/v1/completions")) == 200
    assert app.seen == [("http", "/v1/completions")]


async def test_root_path_is_stripped_as_the_router_does(guard: EngineGuard, app: FakeApp) -> None:
    assert status(await call(guard, "GET", "/api/health", root_path="/api")) == 200
    assert status(await call(guard, "POST", "/api/invocations", root_path="/api")) == 401
    assert status(await call(guard, "GET", "/apihealth", root_path="/api")) == 401
    assert app.seen == [("http", "/api/health")]


async def test_websocket_handshake_needs_the_key(guard: EngineGuard, app: FakeApp) -> None:
    assert await call(guard, "", "/v1/realtime", kind="websocket") == [{"type": "websocket.close", "code": 1008}]
    sent = await call(guard, "", "/v1/realtime", kind="websocket", extensions={"websocket.http.response": {}})
    assert [m["type"] for m in sent] == ["websocket.http.response.start", "websocket.http.response.body"]
    assert sent[0]["status"] == 401
    assert app.seen == []
    await call(guard, "", "/v1/realtime", kind="websocket", auth=f"Bearer {KEY}")
    assert app.seen == [("websocket", "/v1/realtime")]


async def test_lifespan_passes(guard: EngineGuard, app: FakeApp) -> None:
    async def receive() -> dict:
        return {"type": "lifespan.startup"}

    async def send(message: dict) -> None:
        pass

    await guard({"type": "lifespan"}, receive, send)
    assert app.seen == [("lifespan", "")]


async def test_key_comes_from_vllm_api_key(monkeypatch: pytest.MonkeyPatch, app: FakeApp) -> None:
    monkeypatch.setenv(KEY_ENV, "from-env")
    guard = EngineGuard(app)  # how vLLM builds it: app.add_middleware(EngineGuard)
    assert status(await call(guard, "POST", "/invocations", auth=f"Bearer {KEY}")) == 401
    assert status(await call(guard, "POST", "/invocations", auth="Bearer from-env")) == 200


async def test_without_a_key_everything_passes_and_the_log_says_so(
        monkeypatch: pytest.MonkeyPatch, app: FakeApp, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="disagg_connectors.engine_guard"):
        guard = EngineGuard(app)
    assert f"{KEY_ENV} is not set" in caplog.text
    assert status(await call(guard, "POST", "/invocations")) == 200
    monkeypatch.setenv(KEY_ENV, "")  # empty is no key, as for vLLM
    assert status(await call(EngineGuard(app), "POST", "/invocations")) == 200


# -- through uvicorn and a router like vLLM's -----------------------------------------------------------


def _starlette_app(hits: list[str]):
    pytest.importorskip("starlette")
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route

    def handler(name: str):
        async def endpoint(request) -> PlainTextResponse:
            hits.append(name)
            return PlainTextResponse(name)
        return endpoint

    async def metrics_app(scope, receive, send) -> None:
        hits.append("metrics")
        await PlainTextResponse("metrics")(scope, receive, send)

    metrics = Mount("/metrics", metrics_app)
    metrics.path_regex = re.compile("^/metrics(?P<path>.*)$")  # vLLM's workaround (instrumentator/metrics.py)
    app = Starlette(routes=[Route("/invocations", handler("invocations"), methods=["POST"]),
                            Route("/health", handler("health"), methods=["GET"]), metrics])
    app.add_middleware(EngineGuard, key=KEY)  # as vLLM's --middleware does
    return app


async def _raw(port: int, method: str, target: str, auth: str | None = None) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"{method} {target} HTTP/1.1\r\nHost: engine\r\nContent-Length: 2\r\nConnection: close\r\n"
    if auth:
        head += f"Authorization: {auth}\r\n"
    writer.write(head.encode() + b"\r\n{}")
    await writer.drain()
    line = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    return int(line.split()[1])


async def test_through_uvicorn_nothing_routes_to_invocations_without_the_key() -> None:
    uvicorn = pytest.importorskip("uvicorn")
    hits: list[str] = []
    server = uvicorn.Server(uvicorn.Config(_starlette_app(hits), host="127.0.0.1", port=0, log_level="error",
                                           lifespan="off"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done(), "uvicorn did not start"
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        odd = ["/invocations", "/%69nvocations", "/%69%6e%76ocations", "//invocations", "/Invocations",
               "/invocations/", "/./invocations", "/health/../invocations"]
        for target in odd:
            assert await _raw(port, "POST", target) == 401, target
            assert await _raw(port, "POST", target, auth="Bearer wrong") == 401, target
        assert hits == []
        # The router does take the percent-encoded form for /invocations: refusing it mattered.
        assert await _raw(port, "POST", "/%69nvocations", auth=f"Bearer {KEY}") == 200
        assert hits == ["invocations"]
        hits.clear()
        assert await _raw(port, "GET", "/heal%74h") == 200  # decoded to the open probe, and routed there
        assert await _raw(port, "GET", "/metrics") == 200
        assert await _raw(port, "GET", "/metrics/anything") == 401  # vLLM's mount would serve it: not a probe
        assert hits == ["health", "metrics"]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)

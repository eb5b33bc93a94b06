"""The vLLM plan loads the engine guard (``--middleware``) behind the built-in proxy, and
vLLM 0.32's own parser and middleware set-up take it: the guard ends up outermost, so it
answers every unkeyed request before vLLM's own key check or any route."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import textwrap

import pytest

from disagg.deployment import build_deployment
from disagg.engines.vllm import GUARD_MIDDLEWARE, KEY_ENV, VllmEngine
from disagg.topology import parse_topology

TOPOLOGY = """\
model: {path: /models/m}
engine: vllm
connector: nixl
proxy: {kind: KIND}
hosts: {a: {address: 127.0.0.1}}
roles:
  prefill: [{host: a, port: 8100}]
  decode: [{host: a, port: 8200}]
"""


def plan(kind: str = "builtin", text: str = TOPOLOGY):
    return build_deployment(parse_topology(textwrap.dedent(text).replace("KIND", kind), "t.yaml", run_dir="/tmp/r"))


def middleware_of(argv: tuple[str, ...]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--middleware"]


def test_builtin_proxy_plans_the_guard_for_every_engine_and_no_key() -> None:
    dep = plan()
    for eng in dep.engines:
        assert middleware_of(eng.argv) == [GUARD_MIDDLEWARE]
        assert KEY_ENV not in dict(eng.env)  # per run: the launcher adds it, never the plan
    assert VllmEngine().key_env(dep.topology) == "VLLM_API_KEY"


def test_colocated_servers_are_guarded_too() -> None:
    text = TOPOLOGY.replace("  prefill: [{host: a, port: 8100}]\n  decode: [{host: a, port: 8200}]",
                            "  both: [{host: a, port: 8300}]")
    (eng,) = plan(text=text).engines
    assert middleware_of(eng.argv) == [GUARD_MIDDLEWARE]


def test_a_rust_router_cannot_send_the_key_so_nothing_is_guarded() -> None:
    dep = plan("vllm-router")
    assert all(middleware_of(e.argv) == [] for e in dep.engines)
    assert VllmEngine().key_env(dep.topology) is None


def test_the_guard_is_a_class_vllm_can_add() -> None:
    module, _, name = GUARD_MIDDLEWARE.rpartition(".")
    assert inspect.isclass(getattr(importlib.import_module(module), name))  # vLLM: class -> app.add_middleware


def test_vllm_parses_the_planned_argv() -> None:
    cli_args = pytest.importorskip("vllm.entrypoints.launchers.cli_args")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = list(plan().role("decode")[0].argv)
    args = cli_args.make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    assert args.middleware == [GUARD_MIDDLEWARE] and args.api_key is None


async def _asgi(app, method: str, path: str, auth: str | None = None) -> tuple[int, dict]:
    headers = [(b"host", b"e"), (b"content-type", b"application/json"), (b"content-length", b"2")]
    if auth:
        headers.append((b"authorization", auth.encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "root_path": "", "scheme": "http", "query_string": b"", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8200)}
    sent: list[dict] = []
    body = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> dict:
        if body:
            return body.pop()
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    raw = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(raw) if raw else {}


async def test_in_vllms_middleware_stack_the_guard_answers_first(monkeypatch: pytest.MonkeyPatch) -> None:
    register = pytest.importorskip("vllm.entrypoints.serve.middleware.register")
    from argparse import Namespace

    from fastapi import FastAPI

    monkeypatch.setenv(KEY_ENV, "the-key")
    app = FastAPI()
    reached: list[str] = []

    @app.post("/v1/completions")
    async def completions() -> dict:
        reached.append("completions")
        return {"ok": True}

    @app.post("/invocations")
    async def invocations() -> dict:
        reached.append("invocations")
        return {"ok": True}

    @app.get("/health")
    async def health() -> dict:
        return {}

    args = Namespace(allowed_origins=["*"], allow_credentials=False, allowed_methods=["*"], allowed_headers=["*"],
                     api_key=None, enable_request_id_headers=False, middleware=[GUARD_MIDDLEWARE])
    register.init_entrypoints_middleware(args, app, ("generate",))
    for path in ("/v1/completions", "/invocations"):
        status, body = await _asgi(app, "POST", path)
        # the guard's OpenAI-style body, not vLLM's {"error": "Unauthorized"}: the guard ran first
        assert (status, body["error"]["type"]) == (401, "AuthenticationError"), path
        assert (await _asgi(app, "POST", path, auth="Bearer wrong"))[0] == 401
    assert reached == []
    assert (await _asgi(app, "GET", "/health"))[0] == 200
    assert (await _asgi(app, "POST", "/v1/completions", auth="Bearer the-key"))[0] == 200
    assert (await _asgi(app, "POST", "/invocations", auth="Bearer the-key"))[0] == 200
    assert reached == ["completions", "invocations"]

"""SGLang's P/D router protocol (as SGLang's ``mini_lb.py`` and sglang-router speak it).

Prefill and decode receive the same request body plus three fields:
``bootstrap_host`` (the prefill host's address), ``bootstrap_port`` (that
prefill instance's ``--disaggregation-bootstrap-port``) and ``bootstrap_room``
(a random 63-bit integer naming this transfer). Both are sent at once: the
decode server registers the room with the prefill's bootstrap server, the
prefill computes the prompt and pushes the KV, decode generates. The client
gets decode's reply; prefill's is read and dropped. If either side fails the
other one's request is closed, which makes SGLang abort it.

Unlike vLLM, a decode-mode SGLang server cannot prefill by itself, so there
is no fallback to decode alone: a prefill failure is the client's error (503
when no prefill instance is healthy).

Prompt logprobs: with SGLang's ``return_logprob`` set, prefill's
``meta_info.input_token_logprobs`` are put in front of decode's, in whole
replies and in every event of a stream (what ``mini_lb`` does).

The proxy needs each prefill instance's bootstrap port:
``--handoff-option bootstrap_ports=P1,P2`` (one per ``--prefill`` URL, in
order, or one port for all).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from typing import Any, cast
from urllib.parse import urlsplit

import aiohttp

from disagg.errors import ProxyError
from disagg.proxy.backends import Backend, BackendPool
from disagg.proxy.errors import NoHealthyBackend, PrefillUnavailable, UpstreamBadReply, UpstreamConnectError
from disagg.proxy.handoff import DecodeReply, EngineErrorReply, GenerationRequest, Handoff
from disagg.proxy.metrics import ProxyMetrics
from disagg.proxy.routes import PromptRoute
from disagg.proxy.upstream import Upstream, finish
from disagg.serving import SGLANG_HANDOFF
from disagg.sse import DONE_EVENT, SSEError, SSEEvent, SSEParser, encode_event, encode_json_event

log = logging.getLogger("disagg.proxy")

BOOTSTRAP_PORTS = "bootstrap_ports"
#: SGLang's bootstrap rooms are random integers below 2**63
ROOM_BITS = 63


def bootstrap_ports(prefill_urls: tuple[str, ...], option: str | None) -> dict[str, int]:
    """Prefill URL -> bootstrap port, from ``bootstrap_ports=P1,P2`` (one per URL or one for all)."""
    if not option:
        raise ProxyError("engine sglang needs the prefill instances' bootstrap ports: "
                         "--handoff-option bootstrap_ports=P1,P2 (one per --prefill URL)")
    try:
        ports = [int(p) for p in option.split(",")]
    except ValueError:
        raise ProxyError(f"bootstrap_ports={option!r}: expected comma-separated port numbers") from None
    if any(not 0 < p < 65536 for p in ports):
        raise ProxyError(f"bootstrap_ports={option!r}: ports must be in 1..65535")
    if len(ports) == 1:
        ports = ports * len(prefill_urls)
    if len(ports) != len(prefill_urls):
        raise ProxyError(f"bootstrap_ports has {len(ports)} ports for {len(prefill_urls)} prefill URLs")
    return dict(zip(prefill_urls, ports, strict=True))


def bootstrap_body(body: Mapping[str, Any], host: str, port: int, room: int) -> dict[str, Any]:
    """The body both sides receive: the client's request plus the bootstrap fields.

    A batch of native prompts (``text``/``input_ids`` lists) gets one room per
    prompt, as in ``mini_lb``.
    """
    out = dict(body)
    batch = _batch_size(body)
    if batch is None:
        out.update(bootstrap_host=host, bootstrap_port=port, bootstrap_room=room)
    else:
        out.update(bootstrap_host=[host] * batch, bootstrap_port=[port] * batch,
                   bootstrap_room=[room] + [random.getrandbits(ROOM_BITS) for _ in range(batch - 1)])
    return out


def _batch_size(body: Mapping[str, Any]) -> int | None:
    text = body.get("text")
    if text is not None:
        return None if isinstance(text, str) else len(text)
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and not isinstance(ids[0], int):
        return len(ids)
    return None


def merge_input_logprobs(prefill: Mapping[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
    """``decode`` with prefill's ``meta_info.input_token_logprobs`` in front of its own."""
    p_meta, d_meta = prefill.get("meta_info"), decode.get("meta_info")
    if isinstance(p_meta, dict) and isinstance(d_meta, dict) and "input_token_logprobs" in d_meta:
        d_meta["input_token_logprobs"] = list(p_meta.get("input_token_logprobs") or []) + list(
            d_meta["input_token_logprobs"] or [])
    return decode


def first_event(body: bytes) -> dict[str, Any]:
    """Prefill's reply as one JSON object: the first ``data:`` event of an SSE
    body, or the whole body when it is plain JSON (empty if neither)."""
    with suppress(SSEError):
        for event in SSEParser().feed(body + b"\n\n"):
            if not event.done:
                with suppress(ValueError):
                    value = event.json()
                    return value if isinstance(value, dict) else {}
    with suppress(ValueError, UnicodeDecodeError):
        value = json.loads(body)
        return value if isinstance(value, dict) else {}
    return {}


class _MergedContent:
    """Decode's SSE body, each event rewritten with prefill's prompt logprobs."""

    def __init__(self, source: aiohttp.StreamReader, prefill: dict[str, Any], whole: bytes | None) -> None:
        self._source = source
        self._prefill = prefill
        self._whole = whole        # a non-streamed decode body, already merged
        self._parser = SSEParser()
        self._eof = False

    def at_eof(self) -> bool:
        return self._eof

    async def readany(self) -> bytes:
        if self._whole is not None:
            chunk, self._whole = self._whole, b""
            self._eof = not chunk
            return chunk
        while True:
            chunk = await self._source.readany()
            if not chunk:
                self._eof = True
                return b""
            out = b"".join(self._rewrite(event) for event in self._parser.feed(chunk))
            if out:
                return out

    def _rewrite(self, event: SSEEvent) -> bytes:
        if event.done:
            return DONE_EVENT
        try:
            value = event.json()
        except ValueError:
            return encode_event(event.data)
        return encode_json_event(merge_input_logprobs(self._prefill, value) if isinstance(value, dict) else value)


class MergedResponse:
    """Decode's response as the proxy relays it, with prefill's prompt logprobs merged in.

    Offers the part of :class:`aiohttp.ClientResponse` the proxy's relay uses
    (status, headers, content type, ``content.readany``, ``read``,
    ``release``/``close``) and closes decode's response with it.
    """

    def __init__(self, resp: aiohttp.ClientResponse, prefill: dict[str, Any], whole: bytes | None) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers = resp.headers
        self.content_type = resp.content_type
        self.content = _MergedContent(resp.content, prefill, whole)

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.content.readany():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        finish(self._resp)

    def close(self) -> None:
        self._resp.close()


class SglangHandoff(Handoff):
    """SGLang prefill and decode in parallel, joined by a bootstrap room."""

    kind = SGLANG_HANDOFF
    serves_local = False

    def __init__(self, upstream: Upstream, prefill: BackendPool, decode: BackendPool,
                 metrics: ProxyMetrics, options: Mapping[str, str] | None = None) -> None:
        super().__init__(upstream, prefill, decode, metrics, options)
        self.ports = bootstrap_ports(tuple(b.url for b in prefill.backends), self.options.get(BOOTSTRAP_PORTS))

    async def _prefill(self, backend: Backend, req: GenerationRequest, data: bytes,
                       keep: bool) -> bytes:
        """Prefill's whole reply (kept only when ``keep``); raises on any failure."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            resp = await self.upstream.send(backend, "POST", req.endpoint, data=data, headers=req.headers)
        except UpstreamConnectError as exc:
            self.prefill.mark_down(backend, exc.message)
            raise
        try:
            body = await self.upstream.read(backend, resp)
        finally:
            finish(resp)
        if 400 <= resp.status < 500:
            raise EngineErrorReply(backend.url, resp.status, body, resp.headers)
        if resp.status != 200:
            raise UpstreamBadReply(backend.url, f"prefill answered {resp.status}: "
                                   f"{body[:300].decode(errors='replace')}")
        self.metrics.prefill.observe(loop.time() - started)
        return body if keep else b""

    async def _watch(self, prefill: asyncio.Task[bytes], decode: aiohttp.ClientResponse, rid: str) -> None:
        """After decode answered: if prefill fails, close decode's stream (SGLang aborts it)."""
        try:
            await prefill
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("request %s: prefill failed after decode started (%s); aborting decode", rid, exc)
            decode.close()

    @asynccontextmanager
    async def serve(self, route: PromptRoute) -> AsyncIterator[DecodeReply]:
        """Send to one prefill and one decode at once; yield decode's reply."""
        req = route.request
        p_backend = self.prefill.pick()
        if p_backend is None:
            raise PrefillUnavailable(f"no healthy prefill instance: {self.prefill.describe()} "
                                     "(an SGLang decode server cannot serve a request alone)")
        d_backend = self.decode.pick()
        if d_backend is None:
            raise NoHealthyBackend(f"no healthy decode instance: {self.decode.describe()}")
        route.prefill, route.decode = p_backend, d_backend
        host = urlsplit(p_backend.url).hostname or ""
        room = random.getrandbits(ROOM_BITS)
        data = json.dumps(bootstrap_body(req.body, host, self.ports[p_backend.url], room)).encode()
        merge = bool(req.body.get("return_logprob"))
        resp: aiohttp.ClientResponse | None = None
        with self.prefill.lease(p_backend), self.decode.lease(d_backend):
            p_task = asyncio.create_task(self._prefill(p_backend, req, data, keep=merge))
            d_task = asyncio.create_task(self.upstream.send(d_backend, "POST", req.endpoint, data=data,
                                                            headers=req.headers))
            watcher: asyncio.Task[None] | None = None
            try:
                await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
                if p_task.done() and p_task.exception() is not None:
                    p_task.result()          # prefill failed first: raise it (finally aborts decode)
                try:
                    resp = await d_task
                except UpstreamConnectError as exc:
                    self.decode.mark_down(d_backend, exc.message)
                    raise
                if resp.status != 200:
                    yield DecodeReply(d_backend, resp)   # decode's own error, as it answered
                    return
                if merge:
                    prefill_body = await p_task
                    yield DecodeReply(d_backend, await self._merged(d_backend, resp, prefill_body))
                    return
                watcher = asyncio.create_task(self._watch(p_task, resp, req.request_id))
                yield DecodeReply(d_backend, resp, companion=watcher)
            finally:
                for task in (watcher, p_task, d_task):
                    if task is not None and not task.done():
                        task.cancel()
                for task in (watcher, p_task, d_task):
                    if task is not None:
                        with suppress(BaseException):
                            await task
                if resp is not None:
                    finish(resp)

    async def _merged(self, backend: Backend, resp: aiohttp.ClientResponse, prefill_body: bytes) -> Any:
        """Decode's reply with prefill's prompt logprobs merged (``return_logprob``)."""
        if resp.content_type == "text/event-stream":
            return cast(aiohttp.ClientResponse, MergedResponse(resp, first_event(prefill_body), None))
        decoded = await self.upstream.read_json(backend, resp)
        merged = merge_input_logprobs(json.loads(prefill_body), decoded)
        return cast(aiohttp.ClientResponse, MergedResponse(resp, {}, json.dumps(merged).encode()))

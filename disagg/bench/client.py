"""One streaming request to an OpenAI-compatible endpoint, timed like ``vllm bench serve``.

The request asks for ``stream: true`` with ``stream_options.include_usage`` so
the server reports the true prompt and completion token counts, and
``ignore_eos`` + ``max_tokens`` so the answer has exactly the wanted length.
Every SSE event with ``choices`` is a token chunk: its arrival time is
recorded; the first one is the first token. Errors never raise: they are
recorded in the request's record (HTTP status and body, or the exception).
Behind the project's proxy the record keeps the path that served the prompt
(its ``X-Disagg-Route`` header), so the report can show each class's paths.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

from disagg.bench.prompts import Prompt
from disagg.bench.records import RequestRecord
from disagg.bench.workload import Workload
from disagg.proxy.router import ROUTE_HEADER
from disagg.sse import SSEError, SSEParser

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"


def request_body(prompt: Prompt, model: str, workload: Workload) -> dict[str, Any]:
    """The JSON body for ``prompt`` under ``workload``'s API and sampling settings."""
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                            "temperature": workload.temperature}
    if workload.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
        body["max_completion_tokens"] = prompt.output_len
    else:
        body["prompt"] = prompt.text
        body["max_tokens"] = prompt.output_len
    if workload.ignore_eos:
        body["ignore_eos"] = True
    return body


async def send_request(session: aiohttp.ClientSession, url: str, prompt: Prompt, model: str,
                       workload: Workload, t0: float, headers: dict[str, str] | None = None) -> RequestRecord:
    """Send one streaming request to ``url`` (the full endpoint URL); times are relative to ``t0``."""
    body = request_body(prompt, model, workload)
    send = time.perf_counter()
    rec = RequestRecord(index=prompt.index, klass=prompt.klass, send=send - t0, prompt_tokens=prompt.input_len)
    usage_out: int | None = None
    try:
        timeout = aiohttp.ClientTimeout(total=workload.timeout_s)
        async with session.post(url, json=body, headers=headers, timeout=timeout) as resp:
            rec.route = resp.headers.get(ROUTE_HEADER)
            if resp.status != 200:
                text = (await resp.text())[:300]
                rec.error = f"HTTP {resp.status}: {text}"
                return rec
            parser = SSEParser()
            async for piece in resp.content.iter_any():
                now = time.perf_counter() - t0
                for event in parser.feed(piece):
                    if event.done:
                        continue
                    data = event.json()
                    if "error" in data and not data.get("choices"):
                        rec.error = f"stream error: {json.dumps(data['error'])[:300]}"
                        continue
                    if data.get("choices"):
                        rec.chunk_times.append(now)
                    if usage := data.get("usage"):
                        usage_out = usage.get("completion_tokens", usage_out)
                        if usage.get("prompt_tokens") is not None:
                            rec.prompt_tokens = int(usage["prompt_tokens"])
            if not rec.chunk_times and rec.error is None:
                rec.error = "the stream ended without a token chunk"
    except (TimeoutError, aiohttp.ClientError, SSEError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    rec.output_tokens = int(usage_out) if usage_out is not None else len(rec.chunk_times)
    return rec

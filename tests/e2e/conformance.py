"""The conformance suite: the proxy in front of 1P1D must answer like one vLLM server.

Plain functions and data, no fixtures (unit-tested in tests/unit/test_conformance_compare.py):

- :func:`build_cases`: every request shape, by name (:data:`CASE_NAMES`), as exact bytes;
- :data:`CASE_CLASS`: whether a connector takes part in a case's answer (:data:`CASE_CLASSES`):
  the NIXL pd runs every case, other deployments only :data:`HANDOFF_CASES`;
- :func:`send`: one HTTP request, the reply read as a client reads it (streams chunk by chunk);
- :func:`normalise`: a reply -> :class:`Reply` (non-deterministic fields dropped, choices keyed
  by index, streams joined per choice index and checked for well-formedness);
- :func:`compare`: a reference :class:`Reply` against the proxy's, as a list of differences.

Comparison rules: status equal; errors by status and ``error.type`` (never the message);
successes field by field, per choice index: strings (text, tokens, finish_reason, stop_reason)
and integers (usage, ranks, offsets) exactly, floats (logprobs) within :data:`TOLERANCE`; dict
keys (top_logprobs tokens) identical. ``id``, ``created``, ``system_fingerprint`` and
``metrics`` (per-request timings) are ignored.
"""

from __future__ import annotations

import copy
import http.client
import json
import math
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from disagg.prometheus_text import sample_label, sample_sum
from disagg.prompts import exact_prompt
from harness.engines import get_text, settled_metrics

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODEL = "tiny"
MAX_TOKENS = 12
#: max_model_len of every e2e topology (tests/e2e/engines.py write_topology)
MAX_MODEL_LEN = 8192
#: absolute tolerance on every float (the logprobs)
TOLERANCE = 1e-3
#: top-level fields that differ between two runs of the same server
IGNORED_KEYS = frozenset({"id", "created", "system_fingerprint", "metrics"})
#: nesting depth of the deeply-nested-json case
NESTING = 100_000


# ---------------------------------------------------------------------------- cases

@dataclass(frozen=True)
class Case:
    """One request: ``body`` as JSON, or ``raw`` bytes sent as they are (malformed requests)."""

    name: str
    endpoint: str
    body: dict[str, Any] | None = None
    raw: bytes | None = None
    #: the final body, made from the reference server's reply to ``body`` (stop strings)
    derive: Callable[[dict[str, Any], Reply], dict[str, Any]] | None = field(default=None, compare=False)

    def payload(self) -> bytes:
        if self.raw is not None:
            return self.raw
        return json.dumps(self.body).encode()


def request_flags(payload: bytes) -> tuple[bool, bool]:
    """(stream, include_usage) of a request body; (False, False) if it is not a JSON object."""
    try:
        body = json.loads(payload)
    except (ValueError, RecursionError):
        return False, False
    if not isinstance(body, dict):
        return False, False
    options = body.get("stream_options")
    usage = isinstance(options, dict) and bool(options.get("include_usage"))
    return body.get("stream") is True, usage


#: every case the parametrised suites run, in order
CASE_NAMES: tuple[str, ...] = (
    "completion-string",
    "completion-token-ids",
    "batch-strings-equal",
    "batch-strings-different",
    "batch-token-ids-equal",
    "batch-token-ids-different",
    "n2",
    "n3-batch2",
    "n2-greedy",
    "echo",
    "logprobs2",
    "prompt-logprobs1",
    "echo-logprobs",
    "stop-string",
    "min-tokens",
    "stream-single",
    "stream-batch",
    "stream-n2",
    "stream-logprobs",
    "chat-single",
    "chat-multi-turn",
    "chat-stream",
    "chat-n2",
    "over-context",
    "over-context-batch-second",
    "over-input",
    "over-input-batch-second",
    "invalid-max-tokens",
    "invalid-temperature",
    "invalid-prompt",
    "batch-stream-as-string",
    "batch-stream-invalid",
    "unknown-model",
    "malformed-json",
    "deeply-nested-json",
    "empty-body",
)
#: the case classes, each with why it runs where it does: the route the proxy plans for a case
#: (disagg.proxy.routes.plan_request) says whether a connector takes part in its answer
CASE_CLASSES: dict[str, str] = {
    "handoff": "split routes: the prompt's KV crosses the connector, or the prefill engine's refusal comes back "
               "through the handoff: every connector's deployment runs it",
    "local": "sent whole to the decode engine (n > 1, prompt logprobs, a field or prompt vLLM refuses, a body "
             "that is not a JSON object): no connector takes part, the reference and the NIXL pd run it",
}
#: every case's class (tests/unit/test_conformance_classes.py checks it against the proxy's plan)
CASE_CLASS: dict[str, str] = {
    "completion-string": "handoff",
    "completion-token-ids": "handoff",
    "batch-strings-equal": "handoff",
    "batch-strings-different": "handoff",
    "batch-token-ids-equal": "handoff",
    "batch-token-ids-different": "handoff",
    "n2": "local",
    "n3-batch2": "local",
    "n2-greedy": "local",
    "echo": "handoff",
    "logprobs2": "handoff",
    "prompt-logprobs1": "local",
    "echo-logprobs": "local",
    "stop-string": "handoff",
    "min-tokens": "handoff",
    "stream-single": "handoff",
    "stream-batch": "handoff",
    "stream-n2": "local",
    "stream-logprobs": "handoff",
    "chat-single": "handoff",
    "chat-multi-turn": "handoff",
    "chat-stream": "handoff",
    "chat-n2": "local",
    "over-context": "handoff",
    "over-context-batch-second": "handoff",
    "over-input": "handoff",
    "over-input-batch-second": "handoff",
    "invalid-max-tokens": "local",
    "invalid-temperature": "handoff",
    "invalid-prompt": "local",
    "batch-stream-as-string": "handoff",
    "batch-stream-invalid": "local",
    "unknown-model": "handoff",
    "malformed-json": "local",
    "deeply-nested-json": "local",
    "empty-body": "local",
    "kv-batch": "handoff",
}
#: the cases a deployment of another connector (or routing) runs besides the NIXL pd, in order
HANDOFF_CASES: tuple[str, ...] = tuple(name for name in CASE_NAMES if CASE_CLASS.get(name) == "handoff")
#: the batched request whose KV transfer each suite checks in the engines' metrics
KV_CASE = "kv-batch"
#: its prompts' token counts
KV_CASE_TOKENS = (64, 128, 192)


def pick_stop(text: str) -> str:
    """A stop string taken from the middle of a greedy answer (not at its start, not blank)."""
    start = max(1, len(text) // 2)
    while start < len(text) and text[start].isspace():
        start += 1
    stop = text[start:start + 3]
    if len(text) < 4 or not stop.strip():
        raise AssertionError(f"no usable stop string in the reference answer {text!r}")
    return stop


def _derive_stop(body: dict[str, Any], reply: Reply) -> dict[str, Any]:
    assert reply.status == 200 and reply.kind == "json", f"stop probe failed: {reply.status} {reply.raw[:300]!r}"
    return {**body, "stop": [pick_stop(reply.body["choices"][0]["text"])]}


def build_cases(tokenizer: Tokenizer) -> dict[str, Case]:
    """Every case by name: :data:`CASE_NAMES` plus :data:`KV_CASE`.

    Every prompt carries its own tag (``cf-<case>[-i]``), so no case's prompt shares a cached
    prefix with another case's or another test's. Greedy (temperature 0), few tokens; n > 1 is
    seeded sampling.
    """

    def text(tokens: int, tag: str) -> str:
        return exact_prompt(tokenizer, tokens, f"cf-{tag}")

    def ids(tokens: int, tag: str) -> list[int]:
        out = tokenizer.encode(text(tokens, tag)).ids
        assert len(out) == tokens
        return out

    def cmpl(**fields: Any) -> dict[str, Any]:
        return {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}

    def chat(messages: list[dict[str, str]], **fields: Any) -> dict[str, Any]:
        return {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": messages, **fields}

    def user(tokens: int, tag: str) -> dict[str, str]:
        return {"role": "user", "content": text(tokens, tag)}

    usage = {"stream": True, "stream_options": {"include_usage": True}}
    # vLLM refuses n > 1 with greedy sampling (400, the n2-greedy case): the n cases sample at
    # temperature 1 with a seed, which vLLM makes deterministic (child i gets seed + i).
    seeded = {"temperature": 1.0, "seed": 1234}
    # Over-context: prompt + max_tokens beyond max_model_len (vLLM 0.32 clamps max_tokens), and a
    # prompt beyond max_model_len on its own (rejected).
    over_out, over_in = MAX_MODEL_LEN - 16 + 4, MAX_MODEL_LEN + 8
    nested = b"[" * NESTING + b"]" * NESTING
    cases = [
        Case("completion-string", COMPLETIONS, cmpl(prompt=text(48, "string"))),
        Case("completion-token-ids", COMPLETIONS, cmpl(prompt=ids(52, "ids"))),
        Case("batch-strings-equal", COMPLETIONS, cmpl(prompt=[text(56, f"bse-{i}") for i in range(3)])),
        Case("batch-strings-different", COMPLETIONS,
             cmpl(prompt=[text(n, f"bsd-{i}") for i, n in enumerate((40, 64, 96))])),
        Case("batch-token-ids-equal", COMPLETIONS, cmpl(prompt=[ids(44, f"bie-{i}") for i in range(3)])),
        Case("batch-token-ids-different", COMPLETIONS,
             cmpl(prompt=[ids(n, f"bid-{i}") for i, n in enumerate((36, 60, 84))])),
        Case("n2", COMPLETIONS, cmpl(prompt=text(50, "n2"), n=2, **seeded)),
        Case("n3-batch2", COMPLETIONS, cmpl(prompt=[text(46, "n3b-0"), text(66, "n3b-1")], n=3, **seeded)),
        Case("n2-greedy", COMPLETIONS, cmpl(prompt=text(50, "n2-greedy"), n=2)),
        Case("echo", COMPLETIONS, cmpl(prompt=text(42, "echo"), echo=True)),
        Case("logprobs2", COMPLETIONS, cmpl(prompt=text(54, "logprobs"), logprobs=2)),
        Case("prompt-logprobs1", COMPLETIONS, cmpl(prompt=text(58, "plogprobs"), prompt_logprobs=1)),
        Case("echo-logprobs", COMPLETIONS, cmpl(prompt=text(62, "echo-lp"), echo=True, logprobs=1)),
        Case("stop-string", COMPLETIONS, cmpl(prompt=text(68, "stop"), max_tokens=16), derive=_derive_stop),
        Case("min-tokens", COMPLETIONS, cmpl(prompt=text(72, "min-tokens"), min_tokens=8, ignore_eos=False)),
        Case("stream-single", COMPLETIONS, cmpl(prompt=text(76, "stream"), **usage)),
        Case("stream-batch", COMPLETIONS,
             cmpl(prompt=[text(n, f"stream-b-{i}") for i, n in enumerate((38, 58, 78))], **usage)),
        Case("stream-n2", COMPLETIONS, cmpl(prompt=text(80, "stream-n2"), n=2, **seeded, **usage)),
        Case("stream-logprobs", COMPLETIONS, cmpl(prompt=text(84, "stream-lp"), logprobs=2, **usage)),
        Case("chat-single", CHAT, chat([user(40, "chat")])),
        Case("chat-multi-turn", CHAT, chat([
            {"role": "system", "content": text(24, "chat-mt-sys")},
            user(30, "chat-mt-u1"),
            {"role": "assistant", "content": text(20, "chat-mt-a1")},
            user(26, "chat-mt-u2")])),
        Case("chat-stream", CHAT, chat([user(44, "chat-stream")], **usage)),
        Case("chat-n2", CHAT, chat([user(48, "chat-n2")], n=2, **seeded)),
        Case("over-context", COMPLETIONS, cmpl(prompt=text(over_out, "over"), max_tokens=16)),
        Case("over-context-batch-second", COMPLETIONS,
             cmpl(prompt=[text(48, "over-b-0"), text(over_out, "over-b-1")], max_tokens=16)),
        Case("over-input", COMPLETIONS, cmpl(prompt=text(over_in, "over-in"))),
        Case("over-input-batch-second", COMPLETIONS,
             cmpl(prompt=[text(48, "over-in-b-0"), text(over_in, "over-in-b-1")])),
        Case("invalid-max-tokens", COMPLETIONS, cmpl(prompt=text(32, "bad-mt"), max_tokens="ten")),
        Case("invalid-temperature", COMPLETIONS, cmpl(prompt=text(32, "bad-t"), temperature="hot")),
        Case("invalid-prompt", COMPLETIONS, cmpl(prompt=5)),
        # fields of another type: "false" is false to vLLM (pydantic's lax mode), "maybe" is a 400
        Case("batch-stream-as-string", COMPLETIONS,
             cmpl(prompt=[text(36, "stream-str-0"), text(40, "stream-str-1")], stream="false")),
        Case("batch-stream-invalid", COMPLETIONS,
             cmpl(prompt=[text(36, "stream-bad-0"), text(40, "stream-bad-1")], stream="maybe")),
        Case("unknown-model", COMPLETIONS, {**cmpl(prompt=text(32, "bad-model")), "model": "no-such-model"}),
        Case("malformed-json", COMPLETIONS, raw=b'{"model": "tiny", "prompt": "x", "max_tokens": '),
        Case("deeply-nested-json", COMPLETIONS,
             raw=b'{"model": "tiny", "max_tokens": 8, "temperature": 0, "prompt": ' + nested + b"}"),
        Case("empty-body", COMPLETIONS, raw=b""),
        Case(KV_CASE, COMPLETIONS, cmpl(prompt=[text(n, f"kv-{i}") for i, n in enumerate(KV_CASE_TOKENS)])),
    ]
    out = {case.name: case for case in cases}
    assert tuple(out) == (*CASE_NAMES, KV_CASE), "CASE_NAMES and build_cases disagree"
    return out


# ---------------------------------------------------------------------------- replies

@dataclass
class Reply:
    """A reply, normalised for comparison.

    ``kind``: ``json`` (a 200 JSON body), ``stream`` (a 200 event stream, joined), ``error``
    (any other status). ``body``: the normalised JSON, the joined stream, or for errors
    ``{"type": ...}``. ``problems``: what is wrong with the reply's form (a stream's framing).
    """

    status: int
    kind: str
    body: Any
    problems: list[str] = field(default_factory=list)
    raw: bytes = b""


@dataclass(frozen=True)
class Recorded:
    """A case as sent to the reference server (its final payload) and the reply it got."""

    endpoint: str
    payload: bytes
    reply: Reply


class SSEReader:
    """Incremental reader of a ``text/event-stream`` body, fed the bytes as they arrive.

    Events end with a blank line (``\\n\\n``); an event split across reads is kept until its end.
    """

    def __init__(self) -> None:
        self._buf = b""
        self.events: list[str] = []

    def feed(self, data: bytes) -> None:
        self._buf += data
        while (end := self._buf.find(b"\n\n")) >= 0:
            event, self._buf = self._buf[:end], self._buf[end + 2:]
            self.events.append(event.decode("utf-8", errors="replace"))

    def leftover(self) -> bytes:
        """Bytes after the last complete event (a stream cut inside an event)."""
        return self._buf


def normalise_json(obj: Any) -> Any:
    """A 200 JSON reply without ignored fields; ``choices`` keyed by index (a dict)."""
    if not isinstance(obj, dict):
        return obj
    out = {k: v for k, v in obj.items() if k not in IGNORED_KEYS}
    if isinstance(out.get("choices"), list):
        choices: dict[Any, Any] = {}
        for pos, choice in enumerate(out["choices"]):
            index = choice.get("index", f"missing@{pos}") if isinstance(choice, dict) else f"bad@{pos}"
            choices[index if index not in choices else f"duplicate-{index}@{pos}"] = choice
        out["choices"] = choices
    return out


def _merge(acc: Any, new: Any) -> Any:
    """Join streamed pieces: strings and lists concatenate, dicts merge by key, else the last wins."""
    if new is None:
        return acc
    if acc is None:
        return copy.deepcopy(new)
    if isinstance(acc, str) and isinstance(new, str):
        return acc + new
    if isinstance(acc, list) and isinstance(new, list):
        return acc + copy.deepcopy(new)
    if isinstance(acc, dict) and isinstance(new, dict):
        out = dict(acc)
        for key, value in new.items():
            out[key] = _merge(out.get(key), value)
        return out
    return copy.deepcopy(new)


def join_stream(events: Iterable[str], expect_usage: bool) -> tuple[dict[str, Any], list[str]]:
    """Join a stream's events per choice index; returns (joined reply, form problems).

    Joined: ``choices`` (index -> text / delta / logprobs joined, ``finish_reason`` and
    ``stop_reason`` of the event that finished it), ``usage`` (the usage chunk's), ``object``
    and ``model`` (the values seen), ``errors`` (in-stream error types), ``chunk_usage`` (usage on
    choice chunks, if any). Problems: an event that is not ``data: {json}``, no ``data: [DONE]``
    or not exactly one at the end, a choice finished zero or several times, a usage chunk missing,
    repeated, not last, or present when not asked.
    """
    problems: list[str] = []
    events = list(events)
    choices: dict[Any, dict[str, Any]] = {}
    finishes: dict[Any, int] = {}
    objects: list[Any] = []
    models: list[Any] = []
    errors: list[Any] = []
    usage: Any = None
    usage_chunks: list[int] = []
    chunk_usage: Any = None
    done_at: list[int] = []
    for pos, event in enumerate(events):
        if not event.startswith("data: ") or "\n" in event:
            problems.append(f"event {pos} is not one `data: ` line: {event[:120]!r}")
            continue
        data = event[len("data: "):]
        if data == "[DONE]":
            done_at.append(pos)
            continue
        if done_at:
            problems.append(f"event {pos} after data: [DONE]")
        try:
            chunk = json.loads(data)
        except ValueError:
            problems.append(f"event {pos} is not JSON: {data[:120]!r}")
            continue
        if not isinstance(chunk, dict):
            problems.append(f"event {pos} is not a JSON object: {data[:120]!r}")
            continue
        if "error" in chunk:
            err = chunk["error"]
            errors.append(err.get("type") if isinstance(err, dict) else err)
            continue
        if not isinstance(chunk.get("choices"), list):
            problems.append(f"event {pos} has no choices list: {data[:120]!r}")
            continue
        for key, seen in (("object", objects), ("model", models)):
            if key in chunk and chunk[key] not in seen:
                seen.append(chunk[key])
        if not chunk["choices"]:
            if chunk.get("usage") is not None:
                usage = chunk["usage"]
                usage_chunks.append(pos)
            continue
        if chunk.get("usage") is not None:
            chunk_usage = chunk["usage"]
        for choice in chunk["choices"]:
            index = choice.get("index")
            if index in finishes and finishes[index] > 0:
                problems.append(f"event {pos}: choice {index} continues after its finish_reason")
            joined = choices.setdefault(index, {"index": index, "finish_reason": None, "stop_reason": None})
            finishes.setdefault(index, 0)
            for key, value in choice.items():
                if key in ("index", "finish_reason", "stop_reason"):
                    continue
                joined[key] = _merge(joined.get(key), value)
            if choice.get("finish_reason") is not None:
                finishes[index] += 1
                joined["finish_reason"] = choice["finish_reason"]
                joined["stop_reason"] = choice.get("stop_reason")
    if not done_at:
        problems.append("no data: [DONE]")
    elif len(done_at) > 1:
        problems.append(f"data: [DONE] {len(done_at)} times")
    elif done_at[0] != len(events) - 1:
        problems.append("data: [DONE] is not the last event")
    for index, count in finishes.items():
        if count != 1:
            problems.append(f"choice {index}: finish_reason {count} times")
    if expect_usage:
        if not usage_chunks:
            problems.append("include_usage asked, no usage chunk")
        elif len(usage_chunks) > 1:
            problems.append(f"{len(usage_chunks)} usage chunks")
        elif done_at and usage_chunks[0] != done_at[0] - 1:
            problems.append("the usage chunk is not the last event before data: [DONE]")
    elif usage_chunks:
        problems.append("a usage chunk without include_usage")
    joined_reply = {"object": objects, "model": models, "choices": choices, "usage": usage,
                    "chunk_usage": chunk_usage, "errors": errors}
    return joined_reply, problems


def error_type(raw: bytes) -> Any:
    """``error.type`` of an OpenAI/vLLM error body; a marker string if the body is not one."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return f"<not JSON: {raw[:60]!r}>"
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body["error"].get("type")
    return f"<not an error body: {raw[:60]!r}>"


def normalise(status: int, content_type: str, chunks: Iterable[bytes], expect_usage: bool = False) -> Reply:
    """A reply as read (status, Content-Type, the body's chunks in arrival order) -> :class:`Reply`."""
    media = content_type.split(";", 1)[0].strip().lower()
    if status == 200 and media == "text/event-stream":
        reader = SSEReader()
        raw = b""
        for chunk in chunks:
            raw += chunk
            reader.feed(chunk)
        body, problems = join_stream(reader.events, expect_usage)
        if reader.leftover():
            problems.append(f"stream ends inside an event: {reader.leftover()[:120]!r}")
        return Reply(status, "stream", body, problems, raw)
    raw = b"".join(chunks)
    if status != 200:
        return Reply(status, "error", {"type": error_type(raw)}, [], raw)
    try:
        obj = json.loads(raw)
    except ValueError:
        return Reply(status, "json", None, [f"200 reply is not JSON ({content_type}): {raw[:120]!r}"], raw)
    return Reply(status, "json", normalise_json(obj), [], raw)


def send(base_url: str, endpoint: str, payload: bytes, key: str | None = None, timeout: float = 300) -> Reply:
    """POST ``payload`` as JSON; read the reply as a client does (a stream chunk by chunk)."""
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request("POST", endpoint, body=payload, headers=headers)
        resp = conn.getresponse()
        chunks = []
        while chunk := resp.read1(65536):
            chunks.append(chunk)
        return normalise(resp.status, resp.getheader("content-type", ""), chunks, request_flags(payload)[1])
    finally:
        conn.close()


# ---------------------------------------------------------------------------- comparison

def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def diff_values(ref: Any, got: Any, path: str = "", tolerance: float = TOLERANCE) -> list[str]:
    """Where ``got`` differs from ``ref``: floats within ``tolerance``, everything else exactly."""
    if isinstance(ref, dict) and isinstance(got, dict):
        out = []
        for key in ref.keys() - got.keys():
            out.append(f"{path}.{key}: missing (reference: {_short(ref[key])})")
        for key in got.keys() - ref.keys():
            out.append(f"{path}.{key}: unexpected {_short(got[key])}")
        for key in ref.keys() & got.keys():
            out += diff_values(ref[key], got[key], f"{path}.{key}", tolerance)
        return sorted(out)
    if isinstance(ref, list) and isinstance(got, list):
        if len(ref) != len(got):
            return [f"{path}: {len(got)} items, reference {len(ref)}: {_short(got)} vs {_short(ref)}"]
        out = []
        for i, (a, b) in enumerate(zip(ref, got, strict=True)):
            out += diff_values(a, b, f"{path}[{i}]", tolerance)
        return out
    if _is_number(ref) and _is_number(got) and (isinstance(ref, float) or isinstance(got, float)):
        if math.isclose(ref, got, rel_tol=0, abs_tol=tolerance):
            return []
        return [f"{path}: {got!r}, reference {ref!r} (beyond {tolerance})"]
    if type(ref) is not type(got) or ref != got:
        return [f"{path}: {_short(got)}, reference {_short(ref)}"]
    return []


def _short(value: Any, limit: int = 160) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def compare(ref: Reply, got: Reply) -> list[str]:
    """Differences of ``got`` (the proxy's reply) from ``ref`` (one vLLM server's); [] = conforms."""
    out = [f"reference reply malformed: {p}" for p in ref.problems]
    out += [f"malformed: {p}" for p in got.problems]
    if got.status != ref.status:
        detail = f" (reference error type {ref.body.get('type')!r})" if ref.kind == "error" else ""
        got_detail = f" error type {got.body.get('type')!r}" if got.kind == "error" else ""
        out.append(f"status {got.status}{got_detail}, reference {ref.status}{detail}")
        return out
    if got.kind != ref.kind:
        out.append(f"reply kind {got.kind}, reference {ref.kind}")
        return out
    return out + diff_values(ref.body, got.body, "")


def explain(name: str, ref: Reply, got: Reply, diffs: list[str], limit: int = 25) -> str:
    """An assertion message: the differences, then both raw replies (shortened)."""
    lines = [f"{name}: {len(diffs)} difference(s) from one vLLM server:"]
    lines += [f"  {d}" for d in diffs[:limit]]
    if len(diffs) > limit:
        lines.append(f"  ... {len(diffs) - limit} more")
    lines.append(f"reference raw: {ref.raw[:600]!r}")
    lines.append(f"proxy raw:     {got.raw[:600]!r}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- recording

def record(base_url: str, cases: dict[str, Case], key: str | None = None) -> dict[str, Recorded]:
    """Send every case to one server (the reference); derived cases are probed first."""
    out: dict[str, Recorded] = {}
    for name, case in cases.items():
        payload = case.payload()
        if case.derive is not None:
            assert case.body is not None
            probe = send(base_url, case.endpoint, payload, key=key)
            payload = json.dumps(case.derive(case.body, probe)).encode()
        out[name] = Recorded(case.endpoint, payload, send(base_url, case.endpoint, payload, key=key))
    return out


def check_case(proxy_url: str, name: str, rec: Recorded) -> Reply:
    """Send a recorded case to the proxy; raise AssertionError with the differences, if any."""
    got = send(proxy_url, rec.endpoint, rec.payload, timeout=120)
    diffs = compare(rec.reply, got)
    assert not diffs, explain(name, rec.reply, got, diffs)
    return got


# ---------------------------------------------------------------------------- the KV really moved

#: KV bytes per token of the embedded tiny model (2 x 2 layers x 2 KV heads x 64 x bf16)
KV_BYTES_PER_TOKEN = 1024
#: per connector: (bytes fetched by decode, successful fetches or None, failed fetches) counters
KV_COUNTERS = {
    "nixl": ("vllm:nixl_bytes_transferred_sum", None, "vllm:nixl_num_failed_transfers_total"),
    "socket": ("vllm:socket_kv_bytes_received_total", "vllm:socket_kv_transfers_total",
               "vllm:socket_kv_failed_transfers_total"),
}


def kv_moved_problems(before: str, after: str, connector: str, tokens: Iterable[int], block: int) -> list[str]:
    """What the decode engine's metrics (``before``/``after`` one batched request) say went wrong.

    Every prompt's KV must have been fetched: the bytes cover each prompt but its last token (which
    vLLM recomputes) and at most one block more; ``prompt_tokens_by_source{external_kv_transfer}``
    grew by the batch's prompt tokens less at most one per prompt; no failed fetch.
    """
    def delta(metric: str, **labels: str) -> float:
        return sample_sum(after, metric, **labels) - sample_sum(before, metric, **labels)

    tokens = list(tokens)
    total, count = sum(tokens), len(tokens)
    moved_metric, fetches_metric, failed_metric = KV_COUNTERS[connector]
    problems = []
    moved = delta(moved_metric)
    low, high = (total - count) * KV_BYTES_PER_TOKEN, (total + count * block) * KV_BYTES_PER_TOKEN
    if not low <= moved <= high:
        problems.append(f"{moved_metric} grew by {moved:.0f}, expected {low}..{high} for prompts of {tokens} tokens")
    if fetches_metric is not None and delta(fetches_metric) != count:
        problems.append(f"{fetches_metric} grew by {delta(fetches_metric):.0f}, expected {count} (one per prompt)")
    if delta(failed_metric) != 0:
        problems.append(f"{failed_metric} grew by {delta(failed_metric):.0f}")
    external = delta("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    if not total - count <= external <= total:
        problems.append(f"prompt tokens from external_kv_transfer grew by {external:.0f}, "
                        f"expected {total - count}..{total}")
    local = delta("vllm:prompt_tokens_by_source_total", source="local_compute")
    if local > count:
        problems.append(f"prompt tokens from local_compute grew by {local:.0f}, expected at most {count}")
    return problems


def check_kv_batch(proxy_url: str, decode_url: str, rec: Recorded, connector: str,
                   tokens: Iterable[int] = KV_CASE_TOKENS, settle_s: float = 15) -> None:
    """Send the batched :data:`KV_CASE` through the proxy: it must conform and every prompt's KV
    must have reached the decode engine over ``connector`` (its /metrics before and after).

    Connector stats reach /metrics with the engine's next steps: read after
    :func:`~harness.engines.settled_metrics` (``step``), and poll for up to ``settle_s``.
    """
    before = settled_metrics(decode_url, step=True)
    block = int(sample_label(before, "vllm:cache_config_info", "block_size") or 0)
    assert block > 0
    got = send(proxy_url, rec.endpoint, rec.payload, timeout=120)
    deadline = time.monotonic() + settle_s
    while True:
        problems = kv_moved_problems(before, get_text(decode_url + "/metrics"), connector, tokens, block)
        if not problems or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    diffs = compare(rec.reply, got)
    assert not problems and not diffs, "\n".join(
        [f"{KV_CASE} over {connector}:", *(f"  KV: {p}" for p in problems)]
        + ([explain(KV_CASE, rec.reply, got, diffs)] if diffs else []))


# ---------------------------------------------------------------------------- what each case claims

def claim_problems(name: str, payload: bytes, reply: Reply) -> list[str]:
    """Whether the reference reply to a case shows what the case is meant to exercise
    (a stop string that stopped, a clamped over-context answer, prompt logprobs present, ...)."""
    expected_status = {"n2-greedy": 400, "over-input": 400, "over-input-batch-second": 400, "invalid-max-tokens": 400,
                       "invalid-temperature": 400, "invalid-prompt": 400, "batch-stream-invalid": 400,
                       "unknown-model": 404,
                       "malformed-json": 400, "empty-body": 400}
    if name == "deeply-nested-json":
        return []  # whatever vLLM answers is the reference (recorded, not judged)
    if name in expected_status:
        meant = expected_status[name]
        return [] if reply.status == meant else [f"status {reply.status}, meant {meant}"]
    if reply.status != 200:
        return [f"status {reply.status}: {reply.raw[:200]!r}"]
    stream = request_flags(payload)[0]
    if reply.kind != ("stream" if stream else "json"):
        return [f"reply kind {reply.kind}"]
    body = json.loads(payload)
    choices = reply.body["choices"]
    usage = reply.body["usage"] or {}
    prompts = body.get("prompt")
    n_prompts = len(prompts) if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int) else 1
    problems = []
    if sorted(choices) != list(range(n_prompts * body.get("n", 1))):
        problems.append(f"choices {sorted(choices)} for {n_prompts} prompt(s), n={body.get('n', 1)}")
    first = choices.get(0, {})
    if name == "stop-string":
        stop = body["stop"][0]
        if (first.get("finish_reason"), first.get("stop_reason")) != ("stop", stop) or stop in first.get("text", ""):
            problems.append(f"did not stop on {stop!r}: {first}")
    elif name == "over-context":
        if first.get("finish_reason") != "length" or usage.get("completion_tokens") != MAX_MODEL_LEN - usage.get(
                "prompt_tokens", 0) or usage.get("completion_tokens", 99) >= body["max_tokens"]:
            problems.append(f"max_tokens not clamped to the context: {usage}")
    elif name == "over-context-batch-second":
        second_prompt = usage.get("prompt_tokens", 0) - 48
        if usage.get("completion_tokens") != body["max_tokens"] + MAX_MODEL_LEN - second_prompt:
            problems.append(f"second prompt's max_tokens not clamped: {usage}")
    elif name == "prompt-logprobs1":
        plp = first.get("prompt_logprobs")
        if not isinstance(plp, list) or len(plp) != usage.get("prompt_tokens") or plp[0] is not None:
            problems.append(f"prompt_logprobs missing or of the wrong length: {str(plp)[:200]}")
    elif name in ("echo", "echo-logprobs"):
        if not first.get("text", "").startswith(body["prompt"]):
            problems.append("echo: the text does not start with the prompt")
        tokens = (first.get("logprobs") or {}).get("tokens", [])
        if name == "echo-logprobs" and len(tokens) != usage.get("total_tokens"):
            problems.append("echo+logprobs: not one logprob per prompt and generated token")
    elif name in ("logprobs2", "stream-logprobs"):
        tops = (first.get("logprobs") or {}).get("top_logprobs") or []
        # logprobs=2: the two most likely tokens plus the sampled one, keyed by decoded text
        # (tokens that decode alike share a key, so an entry may hold fewer)
        if len(tops) != usage.get("completion_tokens") or not tops or not all(tops) or max(map(len, tops)) < 2:
            problems.append(f"top_logprobs missing: {str(tops)[:200]}")
    elif name == "min-tokens" and usage.get("completion_tokens", 0) < body["min_tokens"]:
        problems.append(f"fewer than min_tokens: {usage}")
    if stream and not usage:
        problems.append("streamed with include_usage, no usage")
    return problems

"""Prompts of an exact token count.

With a server that has vLLM's ``POST /tokenize`` and ``/detokenize``, a prompt
is a unique tag followed by a slice of the shipped corpus's tokens, resized
until the server counts exactly the wanted number of prompt tokens (special
tokens included). Without them, the length comes from a characters-per-token
estimate and the true count is whatever the server reports in ``usage``.

Every prompt starts with a tag unique to (salt, seed, run, request), so no two
prompts share a first KV block and prefix caching cannot flatter the results:
not within a run, not across the runs of a sweep, and (with the random salt
the CLI picks per invocation) not across invocations against the same server.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar

import aiohttp

from disagg.bench.trace import cap_lengths
from disagg.bench.workload import Workload
from disagg.errors import DisaggError

DEFAULT_CHARS_PER_TOKEN = 4.0
_MAX_FIT_STEPS = 8
_MAX_BUSY_RETRIES = 50


@dataclass(frozen=True)
class Prompt:
    """The text of one request and how sure we are of its length."""

    index: int
    klass: str
    text: str
    input_len: int              # intended prompt tokens
    output_len: int             # max_tokens (exact with ignore_eos)
    exact: bool                 # True when the server confirmed the token count
    #: a trace request's lengths cut to the server's max_model_len (False: they fit; None: the
    #: server's max_model_len is unknown, nothing checked)
    capped: bool | None = False


def corpus_text() -> str:
    """The corpus shipped with disagg (also used to train the embedded tokenizer)."""
    return resources.files("disagg").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def _tag(salt: str, seed: int, round_index: int, index: int) -> str:
    return f"[{salt}{seed}-{round_index}-{index}] "


#: text (characters) or token ids
_Items = TypeVar("_Items", str, list[int])


def _cyclic(items: _Items, start: int, length: int) -> _Items:
    """``length`` items of ``items`` from ``start``, wrapping around."""
    reps = (start + length) // len(items) + 1
    return (items * reps)[start:start + length]


class ServerTokenizer:
    """vLLM's ``/tokenize`` and ``/detokenize`` on ``base_url``."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, chat: bool = False) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.chat = chat
        self.max_model_len: int | None = None

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to the server; a 429 (the disagg proxy at its ``max_concurrency``) is retried
        after its Retry-After (at most 1 s) up to ``_MAX_BUSY_RETRIES`` times."""
        for attempt in range(_MAX_BUSY_RETRIES + 1):
            async with self.session.post(self.base_url + path, json={"model": self.model, **body}) as resp:
                if resp.status == 429 and attempt < _MAX_BUSY_RETRIES:
                    wait = resp.headers.get("Retry-After", "")
                    await asyncio.sleep(min(1.0, float(wait)) if wait.replace(".", "", 1).isdigit() else 0.2)
                    continue
                if resp.status != 200:
                    raise DisaggError(f"{self.base_url}{path} answered HTTP {resp.status}: "
                                      f"{(await resp.text())[:200]}")
                data: dict[str, Any] = await resp.json()
                return data
        raise AssertionError("unreachable")

    async def ids(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        data = await self._post("/tokenize", {"prompt": text, "add_special_tokens": False})
        self.max_model_len = data.get("max_model_len", self.max_model_len)
        return list(data["tokens"])

    async def count(self, text: str) -> int:
        """How many prompt tokens the server will count for ``text`` as a request."""
        if self.chat:
            data = await self._post("/tokenize", {"messages": [{"role": "user", "content": text}],
                                                  "add_generation_prompt": True})
        else:
            data = await self._post("/tokenize", {"prompt": text, "add_special_tokens": True})
        return int(data["count"])

    async def text(self, ids: list[int]) -> str:
        """Detokenize ``ids``."""
        return str((await self._post("/detokenize", {"tokens": ids}))["prompt"])


async def _fit(tok: ServerTokenizer, corpus_ids: list[int], tag: str, want: int, start: int) -> tuple[str, bool]:
    """Resize a corpus slice after ``tag`` until the server counts ``want`` tokens."""
    overhead = await tok.count(tag)
    k = max(1, want - overhead)
    best: tuple[int, str] | None = None
    for _ in range(_MAX_FIT_STEPS):
        text = tag + await tok.text(_cyclic(corpus_ids, start, k))
        got = await tok.count(text)
        if got == want:
            return text, True
        if best is None or abs(got - want) < best[0]:
            best = (abs(got - want), text)
        k = max(1, k + want - got)
    assert best is not None
    return best[1], False


def _estimate(corpus: str, tag: str, want: int, start: int, chars_per_token: float) -> str:
    return tag + _cyclic(corpus, start, max(1, round(want * chars_per_token) - len(tag)))


async def build_prompts(session: aiohttp.ClientSession, tokenize_urls: Sequence[str], model: str,
                        workload: Workload, classes: list[str],
                        chars_per_token: float = DEFAULT_CHARS_PER_TOKEN, round_index: int = 0) -> list[Prompt]:
    """One prompt per entry of ``classes`` (the class of each request, in order).

    ``tokenize_urls``: base URLs of servers that may have ``/tokenize``, tried in
    order (the first that answers is used); none answering, or empty: estimate.
    Deterministic for a given salt, seed, round and tokenizer; each round (one run of a
    sweep) gets its own tags, hence no prefix-cache hits across runs. Raises DisaggError when a
    class does not fit the server's max_model_len. With a trace, request i has the lengths of
    the trace's request i, cut to the server's max_model_len where they do not fit
    (:func:`~disagg.bench.trace.cap_lengths`; ``Prompt.capped``).
    """
    corpus = corpus_text()
    rng = random.Random(workload.seed)
    starts = [rng.randrange(len(corpus)) for _ in classes]
    tok: ServerTokenizer | None = None
    corpus_ids: list[int] = []
    for url in tokenize_urls:
        tok = ServerTokenizer(session, url, model, chat=workload.api == "chat")
        try:
            corpus_ids = await tok.ids(corpus)
            await tok.text(corpus_ids[:4])
            break
        except (aiohttp.ClientError, DisaggError, KeyError, ValueError):
            tok = None
    max_len = tok.max_model_len if tok is not None else None
    if max_len and workload.trace is None:
        for c in workload.classes:
            if c.input_len + c.output_len > max_len:
                raise DisaggError(f"prompt class {c.name!r} needs {c.input_len}+{c.output_len} tokens but the "
                                  f"server's max_model_len is {max_len}")
    sem = asyncio.Semaphore(8)

    def lengths(i: int, name: str) -> tuple[int, int, bool | None]:
        if workload.trace is None:
            c = workload.klass(name)
            return c.input_len, c.output_len, False
        r = workload.trace.requests[i]
        if not max_len:
            return r.input_len, r.output_len, None
        inp, out = cap_lengths(r.input_len, r.output_len, max_len)
        return inp, out, (inp, out) != (r.input_len, r.output_len)

    async def one(i: int, name: str) -> Prompt:
        input_len, output_len, capped = lengths(i, name)
        tag = _tag(workload.salt, workload.seed, round_index, i)
        if tok is None:
            return Prompt(i, name, _estimate(corpus, tag, input_len, starts[i], chars_per_token),
                          input_len, output_len, exact=False, capped=capped)
        async with sem:
            start = starts[i] * len(corpus_ids) // len(corpus)
            text, exact = await _fit(tok, corpus_ids, tag, input_len, start)
        return Prompt(i, name, text, input_len, output_len, exact=exact, capped=capped)

    return list(await asyncio.gather(*(one(i, n) for i, n in enumerate(classes))))

"""Joining the replies to a batch's sub-requests into the one reply vLLM gives.

A single vLLM server answers a ``/v1/completions`` request whose ``prompt`` is
a list of k prompts (``n`` = 1) with (``completion/serving.py``):

- whole: one object; ``choices`` in prompt order with ``index`` 0..k-1;
  ``usage`` the sums of prompt, completion and total tokens; one ``id``
  (``cmpl-<X-Request-Id>``); per-request ``metrics`` suppressed;
- streamed: each prompt's events as they come, ``index`` = the prompt's
  position, one ``id``; with ``include_usage`` one usage-only chunk
  (``choices: []``) with the summed usage after every prompt ended; then one
  ``data: [DONE]``. An error ends the stream with vLLM's error event and
  ``[DONE]``.

The proxy sends each prompt as its own request (:mod:`disagg.proxy.routes`),
so every reply carries choice index 0 and its own usage: these functions put
the indices, ids and usage back. Callers: :mod:`disagg.proxy.batch`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def batch_id(request_id: str) -> str:
    """The ``id`` vLLM gives a completions reply for ``X-Request-Id: request_id``."""
    return f"cmpl-{request_id}"


def sum_usage(usages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Token counts summed over the prompts; other usage fields as the last prompt's (as vLLM does)."""
    out: dict[str, Any] = dict(usages[-1]) if usages else {}
    for key in USAGE_COUNTS:
        values = [u.get(key) for u in usages]
        if all(isinstance(v, int) for v in values):
            out[key] = sum(values)
    return out


def reindex(value: dict[str, Any], offset: int, reply_id: str) -> dict[str, Any]:
    """One reply or streamed chunk of the prompt at ``offset``, with the batch's indices and id."""
    value["id"] = reply_id
    for choice in value.get("choices") or []:
        if isinstance(choice, dict) and isinstance(choice.get("index"), int):
            choice["index"] += offset
    return value


def merge_replies(replies: Sequence[dict[str, Any]], request_id: str) -> dict[str, Any]:
    """The whole reply to a batch, from its prompts' whole replies (in prompt order)."""
    reply_id = batch_id(request_id)
    out = dict(replies[0])
    choices: list[Any] = []
    for offset, reply in enumerate(replies):
        choices += reindex(dict(reply), offset, reply_id).get("choices") or []
    out["choices"] = choices
    out["id"] = reply_id
    usages = [r["usage"] for r in replies if isinstance(r.get("usage"), dict)]
    if len(usages) == len(replies):
        out["usage"] = sum_usage(usages)
    if out.get("metrics") is not None:
        out["metrics"] = None  # per-request timings do not describe a batch
    return out


def is_usage_chunk(value: Mapping[str, Any]) -> bool:
    """The usage-only chunk of a stream (``include_usage``): no choices, a usage object."""
    return value.get("choices") == [] and isinstance(value.get("usage"), dict)


def is_error_event(value: Mapping[str, Any]) -> bool:
    """vLLM's in-stream error event: ``{"error": {...}}`` and no choices."""
    return "error" in value and not value.get("choices")


def merge_usage_chunks(chunks: Sequence[dict[str, Any]], request_id: str) -> dict[str, Any]:
    """The one usage chunk of a batch stream, from each prompt's (in prompt order)."""
    out = dict(chunks[0])
    out["id"] = batch_id(request_id)
    out["usage"] = sum_usage([c["usage"] for c in chunks])
    return out

"""The request fields the proxy reads itself, read as vLLM reads them.

vLLM validates a request body with pydantic in lax mode: ``"stream": "false"`` is
``False``, ``"n": "2"`` is 2, ``"stream": "abc"`` is a 400. The proxy decides
from some fields how to serve a request (stream or not, split or not); read with
other rules, the same body could be served differently from a single server (a
batch with ``"stream": "false"`` merged as a stream). So the proxy reads them with
pydantic's own rules, and a request whose field vLLM would refuse goes whole to a
decode engine for that engine's own 400 (:func:`disagg.proxy.routes.plan_request`,
reason ``invalid_field``).

Callers: :class:`disagg.proxy.routes.GenerationRequest` (``stream``) and
:func:`disagg.proxy.routes.plan_request`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError

_BOOL: TypeAdapter[bool | None] = TypeAdapter(bool | None)
_INT: TypeAdapter[int | None] = TypeAdapter(int | None)

#: the fields the proxy reads, with the type vLLM's request models give them (``logprobs``,
#: an int for completions and a bool for chat, is only tested for presence)
_FIELDS: dict[str, TypeAdapter[Any]] = {
    "stream": _BOOL,
    "echo": _BOOL,
    "use_beam_search": _BOOL,
    "n": _INT,
    "max_tokens": _INT,
    "max_completion_tokens": _INT,
    "prompt_logprobs": _INT,
}


def lax_bool(value: Any) -> bool:
    """``value`` as vLLM reads a boolean field (False where it would refuse it)."""
    try:
        return bool(_BOOL.validate_python(value))
    except ValidationError:
        return False


def read_field(body: Mapping[str, Any], name: str) -> Any:
    """Field ``name`` of ``body`` as vLLM reads it (None when absent or unreadable)."""
    try:
        return _FIELDS[name].validate_python(body.get(name))
    except ValidationError:
        return None


def invalid_field(body: Mapping[str, Any]) -> str | None:
    """The first field the proxy reads whose value vLLM would refuse with 400, or None."""
    for name, adapter in _FIELDS.items():
        if name in body:
            try:
                adapter.validate_python(body[name])
            except ValidationError:
                return name
    return None

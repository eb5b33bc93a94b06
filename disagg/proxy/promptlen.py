"""A prompt's length in tokens, in the proxy, without asking an engine.

With the model's ``tokenizer.json`` (``--tokenizer``; ``disagg up`` passes the
model's own when it is on the proxy's machine) the ``tokenizers`` library
counts a completion prompt of up to :data:`SAMPLE_CHARS` characters exactly;
a longer one is counted on :data:`SAMPLE_SLICES` slices of
:data:`SAMPLE_CHARS` characters in all, spread over it, and scaled by its
length (a full encode of a 2,000-token prompt costs 2-5 ms on one busy core;
a few percent off on a long prompt never changes a routing decision, which
fixed costs decide on short prompts). A chat
prompt is its messages' text plus a per-message allowance for the chat
template (which the proxy does not render). Without a tokenizer, characters /
``chars_per_token``.

Every estimate is corrected by a factor learned from the engines' own counts
(``usage.prompt_tokens`` in a prefill reply), per endpoint, and the mean
relative error of the last estimates is kept (:attr:`PromptLength.error`, the
gauge ``disagg_route_prompt_length_error_ratio``).

Who calls what: :func:`disagg.proxy.app._route` calls :meth:`PromptLength.tokens`
per route; the vLLM handoff calls :meth:`PromptLength.calibrate` with the
count its prefill engine answered.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("disagg.proxy")

#: longest text counted in full; longer prompts are sampled (see the module doc)
SAMPLE_CHARS = 1024
#: slices the sample of a longer prompt is taken in, spread over the prompt
SAMPLE_SLICES = 8
#: tokens a chat template adds around each message (role markers), before calibration
CHAT_TOKENS_PER_MESSAGE = 4
#: weight of one new engine count in the correction factor and the error average
DECAY = 0.1


def _chat_text(messages: Any) -> tuple[str, int]:
    """The text of every message and how many messages there are."""
    if not isinstance(messages, list):
        return "", 0
    parts: list[str] = []
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [c["text"] for c in content if isinstance(c, Mapping) and isinstance(c.get("text"), str)]
    return "\n".join(parts), len(messages)


class PromptLength:
    """Estimates prompt tokens from a request body; learns its error from engine counts."""

    def __init__(self, tokenizer: str | None = None, chars_per_token: float = 4.0) -> None:
        self._encode = None
        self._specials = 0
        self.exact = False                 # a tokenizer counts (exactly up to SAMPLE_CHARS)
        if tokenizer:
            try:
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(tokenizer)
                tok.no_truncation()
                tok.no_padding()
                self._encode = tok.encode
                self._specials = len(tok.encode("", add_special_tokens=True).ids)   # BOS and the like
                self.exact = True
            except Exception as exc:  # a missing or unreadable file must not stop the proxy
                log.warning("tokenizer %s unusable (%s); estimating prompt lengths from characters",
                            tokenizer, exc)
        self._chars_per_token = chars_per_token
        self._factor: dict[bool, float] = {False: 1.0, True: 1.0}   # chat? -> correction
        #: mean relative error |estimate - count| / count of recent estimates (None: no count yet)
        self.error: float | None = None

    def _raw(self, text: str) -> float:
        if self._encode is None:
            return len(text) / self._chars_per_token
        if len(text) <= SAMPLE_CHARS:
            return float(len(self._encode(text, add_special_tokens=True).ids))
        width = SAMPLE_CHARS // SAMPLE_SLICES
        step = len(text) // SAMPLE_SLICES
        counted = chars = 0
        for i in range(SAMPLE_SLICES):     # slices spread over the text, each cut between words
            start = text.find(" ", i * step, i * step + width // 2) + 1 if i else 0
            end = text.rfind(" ", start + width // 2, start + width)
            end = end if end > start else start + width
            counted += len(self._encode(text[start:end], add_special_tokens=False).ids)
            chars += end - start
        return self._specials + counted * len(text) / chars

    def tokens(self, body: Mapping[str, Any], chat: bool) -> int:
        """The estimated prompt tokens of one route's body (one prompt)."""
        if chat:
            text, messages = _chat_text(body.get("messages"))
            raw = self._raw(text) + CHAT_TOKENS_PER_MESSAGE * messages
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
                return len(prompt)             # token ids: exact
            raw = self._raw(prompt) if isinstance(prompt, str) else 0.0
        return max(1, round(raw * self._factor[chat]))

    def calibrate(self, estimate: int, count: int, chat: bool) -> None:
        """An engine counted ``count`` tokens for a prompt estimated at ``estimate``."""
        if count <= 0 or estimate <= 0:
            return
        err = abs(estimate - count) / count
        self.error = err if self.error is None else (1 - DECAY) * self.error + DECAY * err
        ratio = count / estimate
        self._factor[chat] *= (1 - DECAY) + DECAY * ratio

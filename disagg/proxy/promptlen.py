"""A prompt's length in tokens, in the proxy, without asking an engine.

With the model's ``tokenizer.json`` (``--tokenizer``; ``disagg up`` passes the
model's own when it is on the proxy's machine) the ``tokenizers`` library
counts a completion prompt exactly; a chat prompt is its messages' text plus a
per-message allowance for the chat template (which the proxy does not render),
corrected live. Without a tokenizer, characters / ``chars_per_token``.

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
        self.exact = False
        if tokenizer:
            try:
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(tokenizer)
                tok.no_truncation()
                tok.no_padding()
                self._encode = tok.encode
                self.exact = True
            except Exception as exc:  # a missing or unreadable file must not stop the proxy
                log.warning("tokenizer %s unusable (%s); estimating prompt lengths from characters",
                            tokenizer, exc)
        self._chars_per_token = chars_per_token
        self._factor: dict[bool, float] = {False: 1.0, True: 1.0}   # chat? -> correction
        #: mean relative error |estimate - count| / count of recent estimates (None: no count yet)
        self.error: float | None = None

    def _raw(self, text: str) -> float:
        if self._encode is not None:
            return float(len(self._encode(text, add_special_tokens=True).ids))
        return len(text) / self._chars_per_token

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

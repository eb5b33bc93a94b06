"""A :class:`~disagg.proxy.routes.RouteLearner` that records what a handoff reports
(a stand-in for the proxy's Router in handoff tests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.proxy.backends import Backend
from disagg.proxy.routes import PromptRoute, StreamProgress


@dataclass
class PrefillAnswers:
    """Records each ``prefill_done`` as (route, engine URL, seconds, prompt tokens counted);
    the other lifecycle points are ignored."""

    seen: list[tuple[PromptRoute, str, float, int | None]] = field(default_factory=list)

    def sent(self, route: PromptRoute, stream: bool, now: float | None = None) -> None:
        pass

    def prefill_done(self, route: PromptRoute, backend: Backend, seconds: float, prompt_tokens: int | None) -> None:
        self.seen.append((route, backend.url, seconds, prompt_tokens))

    def watch(self, route: PromptRoute, progress: StreamProgress) -> None:
        pass

    def first_token(self, route: PromptRoute, when: float) -> None:
        pass

    def decoded(self, route: PromptRoute, backend: Backend, token_events: int, first: float, last: float) -> None:
        pass

    def finished(self, route: PromptRoute) -> None:
        pass

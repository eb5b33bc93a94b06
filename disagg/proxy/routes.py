"""Per-prompt routes: how each prompt of a client's generation request reaches the engines.

The proxy turns every ``/v1/completions`` and ``/v1/chat/completions`` request
into a :class:`RequestPlan` of one :class:`PromptRoute` per prompt, before any
engine sees it (:func:`plan_request`). A route names its *path*:

- ``split``: prefill on a prefill engine, the prompt's KV over the link, decode
  on a decode engine (the handoff fills in ``prefill``, ``decode`` and the
  prompt's own ``kv_transfer_params`` as it goes);
- ``local``: the decode engine computes the prompt itself (colocated proxies,
  and requests the KV handoff cannot serve exactly).

Why one route per prompt: vLLM answers a list ``prompt`` with ONE
``kv_transfer_params``, the first prompt's, so a batch sent whole through a
prefill engine would hand every prompt's decode the first prompt's KV. Each
prompt of a batch therefore becomes a request of its own (a *sub-request*);
:mod:`disagg.proxy.merge` joins their replies into the single server's reply.

What goes ``local`` (with the reason, a metric label):

- ``n``: ``n > 1`` (or beam search). One prefill serves every sample on a
  single server; through the handoff, vLLM's parallel sampling would give all
  samples the one prompt's ``kv_transfer_params`` and they would race for one
  lease. The decode engine prefills once and samples ``n`` times, exactly as a
  single server does; no lease is taken.
- ``prompt_logprobs``: vLLM does not compute prompt logprobs for tokens whose KV
  was transferred; so also ``echo`` with ``logprobs`` (which needs them).
- ``max_tokens_0``: nothing to decode.
- ``invalid_field``: a field the proxy reads (``stream``, ``n``, ``max_tokens``, ...)
  has a value vLLM refuses (:mod:`disagg.proxy.fields`): the decode engine answers
  its own 400.
- ``prompt_shape``: a ``prompt`` the proxy does not recognise (not a string,
  token ids, or a list of either); the decode engine answers with its own error
  or result, exactly as a single server.
- ``unparsable``: a body that is not a JSON object (malformed, empty, nested too
  deeply for the ``json`` module): sent as it is, for the engine's own 400.
- ``colocated``: the proxy has no prefill pool.

Client-supplied ``kv_transfer_params`` (top level, or inside ``vllm_xargs``) are
removed from every request on every path (:func:`strip_kv_params`): only the
proxy may tell an engine where KV lives.

Callers: :func:`disagg.proxy.app._generate` plans each request; the routing
policy (:class:`disagg.proxy.router.Router`) may then move a route that is free
to split (no reason above) to ``local`` or ``whole`` (a prefill engine serves
the request alone) and preset its ``prefill`` / ``decode`` engines; handoffs
(:mod:`disagg.proxy.handoff`) serve ``split`` routes on the preset engines
while they are healthy and record the engines they used.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from multidict import CIMultiDict

from disagg.proxy.fields import invalid_field, lax_bool, read_field
from disagg.proxy.headers import REQUEST_ID

if TYPE_CHECKING:
    from disagg.proxy.backends import Backend

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

#: the request field an engine's KV connector reads (also accepted inside ``vllm_xargs``)
KV_PARAMS = "kv_transfer_params"


@dataclass(frozen=True)
class SharedFields:
    """A batch's fields other than ``prompt``, serialised once: each prompt's sub-request body
    is spliced from these bytes when it is sent (:attr:`GenerationRequest.raw`), so a large
    shared field (a 1 MB ``user``) is never copied once per prompt up front."""

    encoded: bytes          # the JSON object without "prompt", as json.dumps writes it

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> SharedFields:
        return cls(json.dumps({k: v for k, v in body.items() if k != "prompt"}).encode())

    def with_prompt(self, prompt: Any) -> bytes:
        """The sub-request body: ``{"prompt": PROMPT, <the shared fields>}``."""
        head = b'{"prompt": ' + json.dumps(prompt).encode()
        return head + b"}" if self.encoded == b"{}" else head + b", " + self.encoded[1:]


@dataclass(frozen=True)
class GenerationRequest:
    """One generation request as an engine should receive it (never mutated).

    For a client's whole request ``body``/``raw`` are what the client sent,
    less any ``kv_transfer_params``; for a sub-request of a batch, the same
    with one prompt (its bytes built from ``shared`` each time :attr:`raw` is read).
    """

    endpoint: str                       # COMPLETIONS or CHAT
    body: Mapping[str, Any]             # the parsed JSON object (empty when ``parsed`` is false)
    encoded: bytes | None               # ``body`` as bytes (the client's own bytes when unchanged)
    headers: Mapping[str, str]          # end-to-end headers for engines (X-Request-Id set)
    request_id: str
    #: False when ``encoded`` is not a JSON object: it then goes to an engine as it is
    parsed: bool = True
    #: a batch's sub-request: the other fields, serialised once for every prompt
    shared: SharedFields | None = field(default=None, repr=False)

    @property
    def raw(self) -> bytes:
        """The body's bytes as an engine receives them."""
        if self.encoded is not None:
            return self.encoded
        if self.shared is not None:
            return self.shared.with_prompt(self.body["prompt"])
        return json.dumps(self.body).encode()

    @property
    def stream(self) -> bool:
        """Whether the reply streams, as vLLM reads ``stream`` (``"false"`` is False)."""
        return lax_bool(self.body.get("stream"))

    def sub_request(self, index: int, prompt: Any, shared: SharedFields) -> GenerationRequest:
        """Prompt ``index`` of this batch as a request of its own (``X-Request-Id`` ``<id>-<index>``)."""
        request_id = f"{self.request_id}-{index}"
        headers = CIMultiDict(self.headers)
        headers[REQUEST_ID] = request_id
        return replace(self, body={**self.body, "prompt": prompt}, encoded=None, shared=shared, headers=headers,
                       request_id=request_id)


class RoutePath(enum.StrEnum):
    """How one prompt is served."""

    SPLIT = "split"     # prefill engine -> KV over the link -> decode engine
    LOCAL = "local"     # the decode engine computes the prompt itself
    WHOLE = "whole"     # a prefill engine serves the request alone (routing policy auto)


class StreamProgress(Protocol):
    """How far a streamed reply has come, as the relay counts it (:class:`~disagg.proxy.relay.StreamTiming`)."""

    @property
    def token_events(self) -> int: ...


class RouteLearner(Protocol):
    """What learns from routes as they run: the proxy's :class:`~disagg.proxy.router.Router`.

    Told through the route's own methods (:meth:`PromptRoute.sent` and the rest), at the
    points of its lifecycle listed there; each hook takes the route, which carries its
    learner's record of it in ``notes``.
    """

    def sent(self, route: PromptRoute, stream: bool, now: float | None = None) -> None: ...

    def prefill_done(self, route: PromptRoute, backend: Backend, seconds: float,
                     prompt_tokens: int | None) -> None: ...

    def watch(self, route: PromptRoute, progress: StreamProgress) -> None: ...

    def first_token(self, route: PromptRoute, when: float) -> None: ...

    def decoded(self, route: PromptRoute, backend: Backend, token_events: int, first: float,
                last: float) -> None: ...

    def finished(self, route: PromptRoute) -> None: ...


class Served(enum.StrEnum):
    """How a route was finally served: the proxy's ``requests_total`` path labels (a
    :class:`RoutePath` as planned, or ``fallback``/``colocated``)."""

    SPLIT = "split"             # the handoff served it: prefill engine, KV over the link, decode engine
    WHOLE = "whole"             # a prefill engine alone
    LOCAL = "local"             # the decode engine alone, by choice (a route's reason)
    COLOCATED = "colocated"     # the proxy has no prefill pool: one whole server
    FALLBACK = "fallback"       # the decode engine alone because the prefill side failed


@dataclass
class PromptRoute:
    """One prompt's way through the engines, and the record of its lifecycle in the proxy.

    ``index`` is the prompt's position in the client's request (its replies'
    choice indices start at ``index * choices``). ``path`` and ``reason`` are
    decided by :func:`plan_request` (a routing policy may change them before
    serving); ``prefill``, ``decode`` and ``kv_transfer_params`` are filled in
    by whoever serves the route; ``served`` says how it was finally served
    (:class:`Served`: the proxy's ``requests_total`` path labels).

    The lifecycle: the routing policy (:meth:`Router.route <disagg.proxy.router.Router.route>`)
    decides the route and becomes its ``learner``; then whoever serves it reports, on the
    route itself, each point the policy learns from, in this order:

    1. :meth:`sent` by the app as the route goes out (:func:`disagg.proxy.app._open_reply`);
    2. :meth:`prefill_answered` by the handoff when a split's prefill engine answers;
    3. :meth:`watch` by the app when a single-prompt, single-choice reply streams (the relay's
       count of its token events, read as it goes), then :meth:`first_token` by the relay's
       timing when a streamed single-prompt reply sends its first event;
    4. :meth:`decoded` by the app when such a reply (one choice) ended well;
    5. :meth:`finished` by the app when the route is over, whatever happened (always, once).

    Without a learner (no routing policy, tests) each is a no-op.
    """

    index: int
    request: GenerationRequest
    path: RoutePath
    reason: str = ""
    prefill: Backend | None = None
    decode: Backend | None = None
    kv_transfer_params: dict[str, Any] | None = field(default=None, repr=False)
    served: Served | None = None
    #: the routing policy's prompt-length estimate and predicted TTFT (0 / None: not predicted)
    tokens: int = 0
    predicted_s: float | None = None
    #: the output tokens the routing policy expects it to decode (its KV booking; 0: not predicted)
    expected_out: float = 0.0
    #: with an SLO: the predicted time per output token where it will decode (None: not predicted)
    predicted_tpot_s: float | None = None
    #: perf_counter when the client's request arrived (its TTFT is counted from there)
    started: float = 0.0
    #: told of each point of the lifecycle (set by the routing policy when it decides the route)
    learner: RouteLearner | None = field(default=None, repr=False, compare=False)
    #: the learner's own record of the route while it runs (nobody else reads it)
    notes: Any = field(default=None, repr=False, compare=False)

    def sent(self, stream: bool, now: float | None = None) -> None:
        """The route goes out now (``now``: perf_counter, default the clock); ``stream``:
        :meth:`first_token` will be reported (a streamed single-prompt reply)."""
        if self.learner is not None:
            self.learner.sent(self, stream, now)

    def prefill_answered(self, backend: Backend, seconds: float, prompt_tokens: int | None) -> None:
        """A split's prefill engine ``backend`` answered after ``seconds``, having counted
        ``prompt_tokens`` (None: its reply did not say)."""
        if self.learner is not None:
            self.learner.prefill_done(self, backend, seconds, prompt_tokens)

    def watch(self, progress: StreamProgress) -> None:
        """The reply (a single choice) streams; ``progress`` counts its token events as they are sent."""
        if self.learner is not None:
            self.learner.watch(self, progress)

    def first_token(self, when: float) -> None:
        """A streamed single-prompt reply sent its first event at ``when`` (perf_counter)."""
        if self.learner is not None:
            self.learner.first_token(self, when)

    def decoded(self, backend: Backend, token_events: int, first: float, last: float) -> None:
        """A streamed single-prompt, single-choice reply from ``backend`` ended well with
        ``token_events`` token events, the first at ``first`` and the last at ``last``."""
        if self.learner is not None:
            self.learner.decoded(self, backend, token_events, first, last)

    def finished(self) -> None:
        """The route is over (served, failed or cancelled); later reports are ignored."""
        learner, self.learner = self.learner, None
        if learner is not None:
            learner.finished(self)

    @property
    def taken(self) -> str:
        """The path that serves the prompt: ``path``, or ``fallback`` where the prefill side
        failed and a decode engine serves it alone (the route header's and the observed TTFT's label)."""
        return Served.FALLBACK.value if self.served is Served.FALLBACK else self.path.value


@dataclass
class RequestPlan:
    """All routes of one client request; ``batched``: replies must be merged."""

    request: GenerationRequest
    routes: list[PromptRoute]

    @property
    def batched(self) -> bool:
        return len(self.routes) > 1


def strip_kv_params(body: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """``body`` without client-supplied ``kv_transfer_params``; and whether any was there.

    vLLM reads them from the top level (an object, or null) and from
    ``vllm_xargs`` (which become the request's ``extra_args``, where a value of
    any type reaches the KV connector). A top-level value of another type is
    left for the engine to refuse with 400, as a single server does.
    """
    out = dict(body)
    changed = False
    if KV_PARAMS in out and (out[KV_PARAMS] is None or isinstance(out[KV_PARAMS], Mapping)):
        del out[KV_PARAMS]
        changed = True
    xargs = out.get("vllm_xargs")
    if isinstance(xargs, Mapping) and KV_PARAMS in xargs:
        out["vllm_xargs"] = {k: v for k, v in xargs.items() if k != KV_PARAMS}
        changed = True
    return out, changed


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def batch_prompts(body: Mapping[str, Any]) -> list[Any] | None:
    """The prompts of a completions batch (two or more), or None for one prompt.

    Raises ``ValueError`` for a ``prompt`` that is none of the shapes vLLM
    accepts (a string, token ids, a list of strings, a list of token-id lists).
    """
    prompt = body.get("prompt")
    if prompt is None or isinstance(prompt, str) or _is_token_ids(prompt):
        return None
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt shape")
    if all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt):
        return prompt if len(prompt) > 1 else None
    raise ValueError("prompt shape")


def local_reason(endpoint: str, body: Mapping[str, Any]) -> str | None:
    """Why a request cannot be served exactly through the KV handoff (see the module doc), or None."""
    if invalid_field(body) is not None:
        return "invalid_field"
    if read_field(body, "n") not in (None, 1) or read_field(body, "use_beam_search"):
        return "n"
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    if endpoint == COMPLETIONS and read_field(body, "echo") and body.get("logprobs") is not None:
        return "prompt_logprobs"
    if read_field(body, "max_tokens") == 0 or read_field(body, "max_completion_tokens") == 0:
        return "max_tokens_0"
    if endpoint == COMPLETIONS and body.get("prompt_embeds") is not None:
        return "prompt_embeds"
    return None


class TooManyPrompts(ValueError):
    """A batch would become more sub-requests than the proxy's ``max_prompts``."""

    def __init__(self, prompts: int, limit: int) -> None:
        super().__init__(f"this request has {prompts} prompts; this server serves at most {limit} prompts "
                         "in one request (max_prompts)")


def plan_request(req: GenerationRequest, *, split: bool, local: bool = True,
                 max_prompts: int | None = None) -> RequestPlan:
    """The routes of one client request (``split``: a prefill pool exists; ``local``: decode
    engines can serve a prompt alone, which SGLang's cannot: there every prompt goes ``split``).

    ``req`` must already be stripped of client ``kv_transfer_params``.
    A batch whose prompts can go ``split`` becomes one sub-request per prompt
    (``X-Request-Id`` ``<id>-<index>``, so engines never see one id twice), at most
    ``max_prompts`` of them (else :class:`TooManyPrompts`, before any is built);
    everything else is one route carrying the request whole.
    """
    if not split:
        return RequestPlan(req, [PromptRoute(0, req, RoutePath.LOCAL, "colocated")])
    if not req.parsed:
        return RequestPlan(req, [PromptRoute(0, req, RoutePath.LOCAL, "unparsable")])
    reason = local_reason(req.endpoint, req.body)
    prompts: Sequence[Any] | None = None
    if reason is None and req.endpoint == COMPLETIONS:
        try:
            prompts = batch_prompts(req.body)
        except ValueError:
            reason = "prompt_shape"
    if reason is not None and not local:
        return RequestPlan(req, [PromptRoute(0, req, RoutePath.SPLIT, reason)])
    if reason is not None:
        return RequestPlan(req, [PromptRoute(0, req, RoutePath.LOCAL, reason)])
    if prompts is None:
        return RequestPlan(req, [PromptRoute(0, req, RoutePath.SPLIT)])
    if max_prompts is not None and len(prompts) > max_prompts:
        raise TooManyPrompts(len(prompts), max_prompts)
    shared = SharedFields.of(req.body)
    routes = [PromptRoute(i, req.sub_request(i, p, shared), RoutePath.SPLIT) for i, p in enumerate(prompts)]
    return RequestPlan(req, routes)

"""The routing policy at work in the proxy: decide each route, then learn from how it went.

One :class:`Router` per app (built by :func:`disagg.proxy.app.build_app` from
``ProxyConfig.routing``). :meth:`Router.route` decides the plan of each client request
(:func:`~disagg.proxy.routes.plan_request`): every route free to split gets its path
and engines from :func:`disagg.proxy.policy.decide` (``auto``) or the static policy;
every route is counted in ``disagg_route_total``, logged at debug level, and gets the
router as its ``learner``. From then on the route itself is the one interface through
which the router learns (:class:`~disagg.proxy.routes.PromptRoute`, its lifecycle):

1. :meth:`Router.sent` as a route goes out (its prefill now counts in the engine's queue);
2. :meth:`Router.prefill_done` when a split route's prefill engine answers (from the handoff);
3. :meth:`Router.watch` when a single-choice reply streams (with a TPOT objective, the router
   follows its progress on the engine that decodes it, from its first token until the route is over: the
   ``decodes`` of that engine's cost), then :meth:`Router.first_token` when a streamed
   single-prompt reply sends its first event;
4. :meth:`Router.decoded` when such a reply (one choice) ended well: its time per output
   token is a sample of the decode line of the engine that served it, and its token count
   one of the output tokens a request is expected to decode (:func:`expected_output_tokens`);
5. :meth:`Router.finished` when the route is over, whatever happened.

What the router remembers of a route while it runs (:class:`_Flight`) is the route's
``notes``; nothing else reads it.

Measurements live in :class:`~disagg.proxy.measure.Measurements` (warm-up
samples dropped, outliers clipped: see there); what became of each sample is
counted in ``disagg_route_samples_total{fit, outcome}``.

A streamed handoff (``RoutingConfig.streaming_layers``: ``vllm-socket-stream``
sends prefill and decode their requests at once, and prefill's KV leaves layer
by layer as it is computed) gives no samples of the link's rate: prefill's
answer and decode's first token then overlap (decode may even answer first),
so the time between them is no handoff time. The rate stays at its seed (the
``disagg plan`` figures), and splits are predicted with the part of the
transfer the prefill does not hide (:func:`disagg.routecost.exposed_transfer_s`).
The fixed cost is learned: when a streamed split is sent, :meth:`Router.sent`
takes its :meth:`Measurements.streamed_arrival_s` (its prediction less the
fixed cost) and the decode engine's requests in flight; at its first token,
the time beyond that arrival is a sample of the fixed cost at that load
(:meth:`Measurements.observe_streamed_split`: a line in the decode engine's
requests in flight, beyond what that load adds to any first token there, the
engine's busy line, since the first token also waits for that engine's steps),
unless the prefill was sent behind a queue (``queued``, as for the engines'
lines); counted with ``fit="handoff_fixed"``. The policy asks the line at each
decode engine's requests in flight now. The prefill engines still learn from
prefill's answers. The router registers
:meth:`Measurements.forget` and :meth:`Explorer.forget
<disagg.proxy.policy.Explorer.forget>` with the pools' ``on_return``.

Exploration (``auto`` only; rule and cost in :mod:`disagg.proxy.policy`): the
router's :class:`~disagg.proxy.policy.Explorer` learns, at every auto decision,
which (path, prefill URL, decode URL) was taken, and tells :func:`decide` which
are stale; the clock is ``clock`` (``time.monotonic`` unless a test injects one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from disagg.proxy.backends import Backend, BackendPool
from disagg.proxy.config import RoutingConfig
from disagg.proxy.kvledger import KvHold, KvLedger
from disagg.proxy.measure import QUEUED_SHARE, Measurements, Transit
from disagg.proxy.metrics import ProxyMetrics
from disagg.proxy.policy import Candidate, Explorer, decide
from disagg.proxy.promptlen import PromptLength
from disagg.proxy.routes import CHAT, PromptRoute, RequestPlan, RoutePath, Served, StreamProgress
from disagg.routecost import DEFAULT_HANDOFF_FIXED_S, DEFAULT_PREDICTION_ERROR, Option, Progress

log = logging.getLogger("disagg.proxy")

#: the response header naming each prompt's path (comma-separated for a batch)
ROUTE_HEADER = "X-Disagg-Route"

#: a split's handoff (prefill reply -> first token) is no sample of the link when the decode engine had
#: more than this share of it, but not more than all of it, queued as prefill work of its own when
#: the prefill reply came
DECODE_BUSY_SHARE = 0.5

#: token events a streamed reply needs to be a sample of its engine's decode line (a chat reply's first
#: event is the role alone, sent with the first token: two or three events say little of the gaps)
MIN_DECODE_EVENTS = 4

#: what a completions request without ``max_tokens`` decodes at most (vLLM's default, as OpenAI's)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: caps above this say nothing more of a reply's length (nor overflow a float)
MAX_OUTPUT_CAP = 1 << 20

_PATHS = {Option.SPLIT: RoutePath.SPLIT, Option.LOCAL: RoutePath.LOCAL, Option.WHOLE: RoutePath.WHOLE}


@dataclass(slots=True)
class _Flight:
    """What the router remembers about one route while it runs."""

    sent: float = 0.0
    engine: Backend | None = None          # where its prefill is queued
    queued_ahead: float = 0.0              # prefill tokens queued there when it was sent
    in_flight_at_send: int = 0             # requests in flight there when it was sent (not itself)
    pending: Any = None
    prefill_done: float | None = None
    decode_wait: float = 0.0               # split: the decode engine's queued prefill work then, seconds
    #: split: D's requests in flight when it was sent (not itself: a handoff that sends the decode
    #: request beside the prefill leases D after this), the load its handoff is priced and learned at
    decode_in_flight: int = 0
    #: streamed split: its predicted TTFT less the fixed cost when sent
    streamed_arrival: float | None = None
    #: requests decoding on the engine that streams the answer, at its first token (this one included)
    decoding_at_first: int | None = None
    tokens: dict[str, int] = field(default_factory=dict)
    #: split: its handoff in transit on the link, (prefill URL, decode URL, handle), until its first token
    transit: tuple[str, str, Transit] | None = None
    stream: bool = True                    # the reply is streamed (a first token will be seen)
    #: KV booked for it (:class:`~disagg.proxy.kvledger.KvLedger`): on the engine that decodes it, and
    #: a split's on its prefill engine until the decode engine has the KV
    kv_decode: KvHold | None = None
    kv_prefill: KvHold | None = None
    #: a single-choice stream's count of token events (:meth:`Router.watch`; None: not streamed)
    progress: StreamProgress | None = None
    #: while it decodes where the router follows it (SLO routing): that engine's URL, its first
    #: token (perf_counter) and the token gaps it is expected to have in all
    decoding_on: str | None = None
    first: float = 0.0
    total_gaps: float = 0.0


class Router:
    """Decides routes (:mod:`disagg.proxy.policy`) and feeds :class:`Measurements`."""

    def __init__(self, config: RoutingConfig, prefill: BackendPool | None, decode: BackendPool,
                 metrics: ProxyMetrics, *, local: bool, explorer: Explorer | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``explorer``: the exploration state (a default :class:`Explorer` when None); ``clock``:
        the seconds it reads (tests inject one)."""
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        self.local = local
        self.auto = config.policy == "auto" and prefill is not None
        self.kv_bytes_per_token = config.kv_bytes_per_token or 0.0
        prefill_rate = config.prefill_tokens_per_s or 1.0
        self.measurements = Measurements(
            prefill_tokens_per_s=prefill_rate, decode_tokens_per_s=config.decode_tokens_per_s or prefill_rate,
            overhead_s=config.overhead_s,
            handoff_fixed_s=(config.handoff_fixed_s if config.handoff_fixed_s is not None
                             else DEFAULT_HANDOFF_FIXED_S),
            link_bytes_per_s=config.link_bytes_per_s or 1.0, streaming_layers=config.streaming_layers,
            measured_rates=frozenset(config.measured_rates))
        #: the handoff streams the KV while the prefill computes: splits are no samples of the link
        self.streamed = config.streaming_layers is not None
        self.lengths = PromptLength(config.tokenizer, config.chars_per_token) if self.auto else None
        self._counters: dict[tuple[str, str], Any] = {}     # disagg_route_total children, by labels
        self._predicted = {o: metrics.route_predicted.labels(o.value) for o in Option}
        self._predicted_tpot = {o: metrics.route_predicted_tpot.labels(o.value) for o in Option}
        #: ``auto`` with an SLO: routes for the requests expected to meet it, judged with the
        #: relative errors its TTFT and TPOT predictions have shown so far
        self.slo = config.slo
        self.ttft_error = RunningError()
        self.tpot_error = RunningError()
        self.explorer = explorer if explorer is not None else Explorer(config.explore_after_s,
                                                                       config.explore_decisions)
        #: what each engine's KV cache holds for the routes in flight (the wait for room there)
        self.kv = KvLedger()
        #: with a TPOT objective: per engine URL, the streamed routes decoding there (by id), whose
        #: progress the SLO routing weighs (``EngineCost.decodes``)
        self._decoding: dict[str, dict[int, _Flight]] = {}
        self.clock = clock
        for pool in (prefill, decode):
            if pool is not None:
                pool.on_return(self._forget)

    def _forget(self, backend: Backend) -> None:
        """``backend`` came back into service (a new process): what was measured about it goes."""
        self.measurements.forget(backend.url)
        self.explorer.forget(backend.url)
        self.kv.forget(backend.url)
        for flight in self._decoding.pop(backend.url, {}).values():
            flight.decoding_on = None

    # --- deciding --------------------------------------------------------------------

    def _candidates(self, pool: BackendPool | None) -> list[Candidate[Backend]]:
        if pool is None:
            return []
        now = time.perf_counter()
        out = []
        for b in pool.healthy():
            followed = self._decoding.get(b.url)
            cost = self.measurements.engine_cost(pool.role, b.url, b.outstanding, now,
                                                 kv_room=self.kv.room(b.url, b.kv_capacity_tokens, now),
                                                 decodes=_Followed(followed.values(), now) if followed else ())
            out.append(Candidate(b, cost))
        return out

    def route(self, plan: RequestPlan, started: float = 0.0) -> None:
        """Set path, reason and engines of every route of ``plan`` that may split; count them all,
        log each decision at debug level (an ``auto`` comparison with its options, any other in one
        line), and become each route's learner; ``started``: perf_counter when the client's
        request arrived (its routes' TTFT counts from there)."""
        for route in plan.routes:
            route.learner, route.started = self, started
            compared = False
            if route.path is RoutePath.SPLIT and not route.reason and self.prefill is not None:
                compared = self._decide(route)
            key = (route.path.value, route.reason or "policy")
            if not compared and log.isEnabledFor(logging.DEBUG):
                log.debug("route %s prompt %d -> %s (%s)", route.request.request_id, route.index, *key)
            counter = self._counters.get(key)
            if counter is None:
                counter = self._counters[key] = self.metrics.route.labels(*key)
            counter.inc()

    def _decide(self, route: PromptRoute) -> bool:
        """Decide a route that may split; True when it was an ``auto`` comparison (logged here with
        its options), False for a static policy's route."""
        policy = self.config.policy
        if policy == "split" or not self.local:
            route.reason = "policy"
            return False
        if policy == "local":
            route.path, route.reason = RoutePath.LOCAL, "policy"
            return False
        assert self.lengths is not None
        chat = route.request.endpoint == CHAT
        tokens = self.lengths.tokens(route.request.body, chat)
        route.tokens = tokens
        now = self.clock()
        explorer = self.explorer

        def stale(path: Option, p: Backend | None, dd: Backend) -> bool:
            return explorer.stale(path, p.url if p is not None else None, dd.url, now)

        prefills, decodes = self._candidates(self.prefill), self._candidates(self.decode)
        learned = self.measurements.output_tokens()
        out_tokens = expected_output_tokens(route.request.body, learned, chat)
        route.expected_out = out_tokens if learned is not None else output_cap(route.request.body, chat) or 0.0
        d = decide(policy, tokens, tokens * self.kv_bytes_per_token, prefills,
                   decodes, lambda p, dd: self.measurements.link_cost(p.url, dd.url, dd.outstanding),
                   whole=self.config.whole, local=self.local, stall_weight=self.config.stall_weight,
                   stale=stale if self.config.explore_within > 0 else None, explore_within=self.config.explore_within,
                   out_tokens=out_tokens, slo=self.slo, ttft_error=self.ttft_error.value,
                   tpot_error=self.tpot_error.value,
                   slo_out_tokens=learned if learned is not None else float(COMPLETIONS_DEFAULT_MAX_TOKENS))
        route.path, route.reason = _PATHS[d.path], d.reason
        route.prefill, route.decode, route.predicted_s = d.prefill, d.decode, d.predicted_s
        route.predicted_tpot_s = d.predicted_tpot_s
        if d.predicted_tpot_s is not None:
            self._predicted_tpot[d.path].observe(d.predicted_tpot_s)
        if d.options:    # an auto comparison (not a fallback for want of engines): that path is fresh now
            explorer.taken(d.path, d.prefill.url if d.prefill is not None else None,
                           d.decode.url if d.decode is not None else None, now)
        if d.predicted_s is not None:
            self._predicted[d.path].observe(d.predicted_s)
        if log.isEnabledFor(logging.DEBUG):
            alts = ", ".join(f"{o.path} {o.ttft_s * 1e3:.1f} ms (score {o.score_s * 1e3:.1f})" for o in d.options)
            tpot = ", ".join(f"{c.engine.role} {c.engine.url} {c.engine.outstanding} in flight "
                             + (f"{c.cost.tpot_s * 1e3:.1f} ms" if c.cost.tpot_s is not None else "-")
                             + f" (prefill duty {c.cost.prefill_duty:.0%},"
                               f" line {c.cost.overhead_s * 1e3:.1f} ms + n / {c.cost.tokens_per_s:.0f}/s,"
                               f" queued {c.cost.queued_tokens:.0f}, busy {c.cost.busy_s * 1e3:.1f} ms)"
                             for c in (*prefills, *decodes))
            m = self.measurements
            links = ", ".join(f"{p.engine.url} -> {dd.engine.url} "
                              f"{m.link_cost(p.engine.url, dd.engine.url).in_transit} in transit"
                              for p in prefills for dd in decodes)
            log.debug("route %s: %d tokens, %.0f out -> %s (%s) P=%s D=%s; predicted %s; tpot and engines %s;"
                      " handoffs %s", route.request.request_id, tokens, out_tokens, d.path, d.reason,
                      d.prefill.url if d.prefill else "-", d.decode.url if d.decode else "-", alts or "-", tpot,
                      links or "-")
        return True

    # --- learning --------------------------------------------------------------------

    def sent(self, route: PromptRoute, stream: bool, now: float | None = None) -> None:
        """``route`` goes out now (``now``: perf_counter): its prefill counts in the chosen engine's queue,
        a streamed split's handoff on its link. ``stream``: :meth:`first_token` will be called for it (a
        streamed single-prompt reply); otherwise both count until their predicted end."""
        if not self.auto or not route.tokens:
            return
        flight = route.notes = _Flight(sent=time.perf_counter() if now is None else now, stream=stream)
        if route.path is RoutePath.LOCAL:
            role, engine = "decode", route.decode
        else:                                   # split and whole prefill on a prefill engine
            role, engine = "prefill", route.prefill
        if engine is None:
            return
        flight.engine = engine
        flight.in_flight_at_send = engine.outstanding
        flight.queued_ahead = self.measurements.queued_tokens(role, engine.url, flight.sent)
        # a non-streamed reply shows no first token: it stops counting when predicted done
        until = float("inf") if (stream or route.path is RoutePath.SPLIT) else \
            flight.sent + (route.predicted_s or 0.0)
        if route.path is RoutePath.SPLIT and route.decode is not None:
            flight.decode_in_flight = route.decode.outstanding
            if self.streamed:
                m = self.measurements
                flight.streamed_arrival = m.streamed_arrival_s(engine.url, route.decode.url, route.tokens,
                                                               route.tokens * self.kv_bytes_per_token,
                                                               flight.queued_ahead, flight.in_flight_at_send)
                # its KV leaves as the prefill computes; not streamed: until its predicted first token
                self._depart(flight, engine.url, route.decode.url,
                             float("inf") if stream else flight.sent + (route.predicted_s or 0.0))
        flight.pending = self.measurements.dispatch(role, engine.url, route.tokens, until, now=flight.sent)
        self._book_kv(route, flight)

    def _book_kv(self, route: PromptRoute, flight: _Flight) -> None:
        """Book the KV the route will hold (:mod:`disagg.proxy.kvledger`): the prompt and its expected
        output on the engine that decodes it, until its predicted first token and its decode at that
        engine's time per output token; a split's prompt on its prefill engine until its first token."""
        serving = route.prefill if route.path is RoutePath.WHOLE else route.decode
        first = flight.sent + (route.predicted_s or 0.0)
        if serving is not None:
            flight.kv_decode = self.kv.hold(serving.url, route.tokens + route.expected_out,
                                            first + self._decode_s(route, serving))
        if route.path is RoutePath.SPLIT and route.prefill is not None:
            flight.kv_prefill = self.kv.hold(route.prefill.url, route.tokens, first)

    def _decode_s(self, route: PromptRoute, backend: Backend) -> float:
        """How long the route is expected to decode on ``backend`` (0 while its decode line is unknown)."""
        m = self.measurements
        tpot = m.tpot_s(backend.url, m.decoding(backend.url, backend.outstanding) + 1)
        return route.expected_out * tpot if tpot is not None else 0.0

    def _unbook_kv(self, flight: _Flight, *, prefill_only: bool = False) -> None:
        """The flight's KV leaves its prefill engine (``prefill_only``: the decode engine has it) or
        every engine (the route is over)."""
        if flight.kv_prefill is not None:
            self.kv.release(flight.kv_prefill)
            flight.kv_prefill = None
        if not prefill_only and flight.kv_decode is not None:
            self.kv.release(flight.kv_decode)
            flight.kv_decode = None

    def _depart(self, flight: _Flight, prefill_url: str, decode_url: str, until: float) -> None:
        """The flight's handoff begins moving KV over the pair's link (counted in transit there until
        its first token, its end, or ``until``: perf_counter, for a reply whose first token is not seen)."""
        self._land(flight)
        flight.transit = (prefill_url, decode_url,
                          self.measurements.handoff_started(prefill_url, decode_url, until))

    def _land(self, flight: _Flight) -> None:
        """The flight's handoff, if one is in transit, is over (first token, failure or cancel)."""
        if flight.transit is not None:
            self.measurements.handoff_ended(*flight.transit)
            flight.transit = None

    def _settle(self, flight: _Flight, *, done: bool = True, now: float | None = None) -> None:
        """The flight's prefill leaves its engine's queue: ``done`` at its first token or reply
        (at ``now``, perf_counter; None: now), else failed or cancelled."""
        if flight.engine is not None and flight.pending is not None:
            self.measurements.settle(flight.engine.role, flight.engine.url, flight.pending, now, done=done)
            flight.pending = None

    def prefill_done(self, route: PromptRoute, backend: Backend, seconds: float, prompt_tokens: int | None) -> None:
        """A split route's prefill engine answered after ``seconds`` (``prompt_tokens``: its count)."""
        flight = _notes(route)
        if prompt_tokens and self.lengths is not None and route.tokens:
            self.lengths.calibrate(route.tokens, prompt_tokens, route.request.endpoint == CHAT)
            if self.lengths.error is not None:
                self.metrics.prompt_length_error.set(self.lengths.error)
        if flight is None:
            return
        self._settle(flight)
        flight.prefill_done = time.perf_counter()
        tokens = prompt_tokens or route.tokens
        if route.decode is not None:
            if not self.streamed:         # the KV moves now, after the prefill
                until = float("inf")
                if not flight.stream:     # no first token will be seen: until the handoff's predicted end
                    link = self.measurements.link_cost(backend.url, route.decode.url,
                                                       flight.decode_in_flight)
                    until = flight.prefill_done + link.seconds(tokens * self.kv_bytes_per_token)
                self._depart(flight, backend.url, route.decode.url, until)
            flight.decode_wait = self.measurements.wait_s("decode", route.decode.url, flight.prefill_done)
        flight.tokens["prompt"] = tokens
        if flight.engine is backend:
            outcome = self.measurements.observe_prefill("prefill", backend.url, tokens, seconds, flight.queued_ahead,
                                                        flight.in_flight_at_send)
            self._sampled(_engine_fit(flight), outcome)
            log.debug("route %s: prefill of %d tokens answered after %.1f ms (%.0f queued ahead, %d in flight): %s",
                      route.request.request_id, tokens, seconds * 1e3, flight.queued_ahead,
                      flight.in_flight_at_send, outcome)

    def watch(self, route: PromptRoute, progress: StreamProgress) -> None:
        """``route``'s reply streams one choice, its token events counted by ``progress``: with a TPOT
        objective the router follows it while it decodes (from :meth:`first_token` until :meth:`finished`)."""
        flight = _notes(route)
        if flight is not None and self.slo is not None and self.slo.tpot_s is not None:
            flight.progress = progress

    def first_token(self, route: PromptRoute, when: float) -> None:
        """A streamed single-prompt reply sent its first event at ``when`` (TTFT from ``route.started``)."""
        path = route.taken
        observed = when - route.started
        self.metrics.route_observed.labels(path).observe(observed)
        if route.predicted_s is not None and observed > 0 and route.served is not Served.FALLBACK:
            error = abs(route.predicted_s - observed) / observed
            self.metrics.route_error.labels(path).observe(error)
            self.ttft_error.observe(error)
            log.debug("route %s: %s, %d tokens: first token after %.1f ms, predicted %.1f ms",
                      route.request.request_id, path, route.tokens, observed * 1e3, route.predicted_s * 1e3)
        flight = _notes(route)
        if flight is None or route.served is Served.FALLBACK:
            return
        self._settle(flight, now=when)     # its prefill ended with the first token, not after it
        self._land(flight)
        self._unbook_kv(flight, prefill_only=True)
        answering = route.prefill if route.path is RoutePath.WHOLE else route.decode
        if answering is not None:
            flight.decoding_at_first = self.measurements.decoding(answering.url, answering.outstanding)
            if flight.progress is not None:
                flight.decoding_on, flight.first = answering.url, when
                flight.total_gaps = (route.expected_out or float(COMPLETIONS_DEFAULT_MAX_TOKENS)) - 1.0
                self._decoding.setdefault(answering.url, {})[id(flight)] = flight
            if flight.kv_decode is not None:
                self.kv.retime(flight.kv_decode, when + self._decode_s(route, answering))
        if route.path is RoutePath.SPLIT:
            if self.streamed:   # a sample of the fixed cost, not of the link's rate (module doc)
                self._streamed_split_sample(route, flight, when - flight.sent)
                return
            if flight.prefill_done is None or route.prefill is None or route.decode is None:
                return
            nbytes = flight.tokens.get("prompt", route.tokens) * self.kv_bytes_per_token
            handoff = when - flight.prefill_done
            if DECODE_BUSY_SHARE * handoff < flight.decode_wait <= handoff:
                # the first token came after the decode engine's queue was predicted done, which was
                # most of the handoff: it waited for that queue, not for the link (a first token before
                # that end means the queue estimate was off, and the handoff is a sample after all)
                self._sampled("link", "decode_busy")
            else:
                self._sampled("link", self.measurements.observe_handoff(
                    route.prefill.url, route.decode.url, nbytes, handoff, flight.decode_in_flight))
        elif flight.engine is not None \
                and flight.engine is (route.decode if route.path is RoutePath.LOCAL else route.prefill):
            self._sampled(_engine_fit(flight), self.measurements.observe_prefill(
                flight.engine.role, flight.engine.url, route.tokens, when - flight.sent, flight.queued_ahead,
                flight.in_flight_at_send))

    def _streamed_split_sample(self, route: PromptRoute, flight: _Flight, observed: float) -> None:
        """A streamed split's first token came ``observed`` seconds after it was sent."""
        if flight.streamed_arrival is None or route.prefill is None or route.decode is None:
            return
        if flight.queued_ahead > QUEUED_SHARE * route.tokens:
            self._sampled("handoff_fixed", "queued")      # the queue estimate, not the handoff
        else:
            self._sampled("handoff_fixed", self.measurements.observe_streamed_split(
                route.prefill.url, route.decode.url, observed - flight.streamed_arrival,
                flight.decode_in_flight))

    def decoded(self, route: PromptRoute, backend: Backend, token_events: int, first: float, last: float) -> None:
        """A streamed single-prompt, single-choice reply from ``backend`` ended well: ``token_events``
        token events, the first sent at ``first`` and the last at ``last`` (perf_counter). Its mean gap
        is a sample of the engine's decode line at the mean of its requests decoding at the first
        token and now (both count this one), counted with ``fit="decode"``."""
        flight = _notes(route)
        if flight is None or flight.decoding_at_first is None or route.served is Served.FALLBACK:
            return
        self.measurements.observe_output(token_events)
        if token_events < MIN_DECODE_EVENTS:
            return
        observed = (last - first) / (token_events - 1)
        if route.predicted_tpot_s is not None and observed > 0:
            error = abs(route.predicted_tpot_s - observed) / observed
            self.metrics.route_tpot_error.labels(route.taken).observe(error)
            self.tpot_error.observe(error)
        m = self.measurements
        decoding = (flight.decoding_at_first + m.decoding(backend.url, backend.outstanding)) / 2
        self._sampled("decode", m.observe_decode(backend.url, decoding, observed, first, last))

    def _sampled(self, fit: str, outcome: str) -> None:
        self.metrics.route_samples.labels(fit, outcome).inc()

    def finished(self, route: PromptRoute) -> None:
        """The route is over (served, failed or cancelled)."""
        flight, route.notes = _notes(route), None
        if flight is not None:
            if flight.decoding_on is not None:
                self._decoding.get(flight.decoding_on, {}).pop(id(flight), None)
                flight.decoding_on = None
            self._settle(flight, done=False)   # still queued here: it never answered
            self._land(flight)
            self._unbook_kv(flight)


class RunningError:
    """The typical relative error of one kind of prediction: a running mean of ``|predicted -
    observed| / observed`` that weights recent samples more (each new one by :attr:`WEIGHT`), with
    each sample capped at :attr:`CAP` so one outlier does not swamp it; starts at
    :data:`~disagg.routecost.DEFAULT_PREDICTION_ERROR`."""

    WEIGHT = 0.05
    CAP = 3.0

    def __init__(self, start: float = DEFAULT_PREDICTION_ERROR) -> None:
        self.value = start

    def observe(self, error: float) -> None:
        self.value += self.WEIGHT * (min(error, self.CAP) - self.value)


def expected_output_tokens(body: Mapping[str, Any], learned: float | None, chat: bool = False) -> float:
    """The output tokens a request is expected to decode, to price its decode work
    (:func:`disagg.routecost.decode_s`): the replies' mean so far (``learned``), capped by the
    request's own cap; 0 before any reply (no decode term: the options are priced by their first
    token alone, as a cap such as 4,096 says little of the answer's length). The cap: for chat
    ``max_completion_tokens``, else ``max_tokens``; for completions ``max_tokens``, 16 when absent
    (vLLM's and OpenAI's default there). Only a positive number is read as a cap (the engine
    judges anything else), and none above :data:`MAX_OUTPUT_CAP` matters."""
    if learned is None:
        return 0.0
    cap = output_cap(body, chat)
    return learned if cap is None else min(cap, learned)


def output_cap(body: Mapping[str, Any], chat: bool = False) -> float | None:
    """The most output tokens a request asks for (None: a chat request without a cap): for chat
    ``max_completion_tokens``, else ``max_tokens``; for completions ``max_tokens``, 16 when absent.
    Only a positive number is read as a cap, and none above :data:`MAX_OUTPUT_CAP`. What
    :func:`expected_output_tokens` caps its mean with, and what the router books as a request's
    output in the KV cache before any reply has been measured."""
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for key in keys:
        value = body.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return float(min(value, MAX_OUTPUT_CAP))      # min first: a huge JSON integer overflows float()
    return None if chat else float(COMPLETIONS_DEFAULT_MAX_TOKENS)


def _notes(route: PromptRoute) -> _Flight | None:
    """What the router noted of ``route`` when it was sent (None: not sent, or not noted)."""
    notes = route.notes
    return notes if isinstance(notes, _Flight) else None


class _Followed(Sequence[Progress]):
    """``EngineCost.decodes`` of one engine: where each streamed route decoding there stands at
    ``now`` (perf_counter), taken when first read. The SLO's count reads it only where some option
    gives the prompt an even chance (:func:`~disagg.proxy.policy.decide`), so the decisions where
    none does (most of them under a tight objective past saturation) never take it. Read within
    the decision that built it: its flights go on changing after."""

    __slots__ = ("_decodes", "_flights", "_now")

    def __init__(self, flights: Collection[_Flight], now: float) -> None:
        self._flights, self._now = flights, now
        self._decodes: tuple[Progress, ...] | None = None

    @overload
    def __getitem__(self, index: int) -> Progress: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Progress, ...]: ...

    def __getitem__(self, index: int | slice) -> Progress | tuple[Progress, ...]:
        decodes = self._decodes
        if decodes is None:
            decodes = self._decodes = _progress(self._flights, self._now)
        return decodes[index]

    def __len__(self) -> int:
        return len(self._flights) if self._decodes is None else len(self._decodes)


def _progress(flights: Iterable[_Flight], now: float) -> tuple[Progress, ...]:
    """Where each followed route decoding on one engine stands at ``now`` (perf_counter)."""
    return tuple([(now - f.first, (f.progress.token_events - 1 if f.progress.token_events > 1 else 0)
                   if f.progress is not None else 0, f.total_gaps) for f in flights])


def _engine_fit(flight: _Flight) -> str:
    """The ``fit`` label of a prefill's sample: ``engine`` (its line, sent to an idle engine) or
    ``engine_busy`` (the line of what load adds)."""
    return "engine" if flight.in_flight_at_send == 0 else "engine_busy"

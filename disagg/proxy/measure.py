"""What the proxy measures about each engine and each prefill -> decode pair, live.

:class:`Measurements` is built once per app from the seed figures
(:class:`~disagg.proxy.config.RoutingConfig`) and fed by the proxy as it serves:

- per engine, a fit of ``seconds = overhead + work_tokens / rate`` where
  ``work_tokens`` is the prompt plus the prefill tokens still queued there
  when it was sent: from prefill replies of split routes (prefill engines), and
  from the first streamed token of ``local`` / ``whole`` routes; only prompts
  sent with at most :data:`QUEUED_SHARE` of their size queued ahead are
  samples (:meth:`Measurements.observe_prefill` says why), and only prompts
  sent while the engine had nothing in flight: its line is the prefill's own
  time, which is also the stall it imposes on decodes there. A prompt sent
  while the engine had requests in flight is a sample of a second line per
  engine, what that load adds to the first token beyond the first line (the
  step in progress, the decodes batched with the prefill), against the
  requests in flight (seeded flat at 0; ``EngineCost.busy_s``). One line fed
  by both mixed them: on a one-core decode engine at 2-4 req/s it predicted
  a 64-token local prefill at 153 ms with nothing in flight, where such
  prompts took 25-40 ms, and priced its stall on 4 running decodes at 275 ms
  instead of about 75, so short prompts went to a split (p50 294 ms) instead
  of local (p50 83 ms);
- per prefill -> decode pair, a fit of ``seconds = fixed + kv_bytes / rate``
  from split routes (prefill reply -> first decode token, streamed), less the
  decode engine's busy line (above) at its requests in flight when the split
  was sent, which :meth:`Measurements.link_cost` adds back at the load of the
  moment. When the
  handoff streams the KV while the prefill computes (``streaming_layers``) the
  two overlap, so that time is no sample of the link: the rate stays at its
  seed, predictions take only the part of the transfer the prefill does not
  hide (:func:`disagg.routecost.exposed_transfer_s`), and the fixed cost is
  learned instead, as a line in the decode engine's requests in flight when
  the split was sent: what each streamed split took to its first token beyond
  that prediction less its fixed cost (:meth:`Measurements.streamed_arrival_s`,
  :meth:`Measurements.observe_streamed_split`; the router picks the samples).
  Left at its seed (40 ms, measured on one machine), it had the first streamed
  splits of a few tokens after start predicted at 43 ms where they took
  120-420 ms on another, and the policy went on splitting at idle prompts that
  a colocated engine answered in 25 ms. A line, not one figure: a split's
  first token also waits for the decode engine's step in progress and the one
  that takes it in, which grow with the decodes running there (on one core,
  41 ms beyond the prediction with 0-2 requests in flight, 81 ms with 3-5, 151
  ms with 6-8). One mean over every split priced them all at the average load
  (past saturation 27% too high at lighter moments, and the policy prefilled
  on the decode engine prompts that doubled its decodes' TPOT); one over the
  idle splits alone under-priced every split under load (by 49% at 2 req/s).
  The line holds what a split waits beyond the decode engine's busy line at
  that load (below), which a local prompt waits as well: a split is priced
  with both, so a busy decode engine makes a split dearer even while the line
  is still its idle seed;
- per prefill -> decode pair, the handoffs moving KV over its link now (a
  split's prefill reply, or a streamed split's sending, to its first token or
  its end; a reply whose first token the proxy does not see, to its predicted
  end): what a split's transfer holds up there
  (:func:`disagg.routecost.link_held_up_s`);
- per engine, the prefill tokens it has still to work through (sent, no
  first token yet, less what the time since then has covered at its fitted
  rate: :meth:`Measurements._progress`) and so the decodes it is running;
- per engine, the prefill compute it did lately (:class:`PrefillWork`: each
  prefill's time on its line, when it produced its first token or reply) and
  so its *prefill duty*, the share of the last :data:`DUTY_WINDOW_S` seconds it
  spent prefilling;
- per engine, its decode step as a line in the requests decoding there (in
  flight, less the prefills sent there with no first token yet:
  :meth:`Measurements.decoding`), from each streamed single-prompt reply the
  proxy relays (:meth:`Measurements.observe_decode`: its mean gap between
  token events, less the prefills the engine computed while it decoded spread
  over its gaps, against the requests decoding there at its first token and at
  its end), and its time per output token that step over ``1 - duty``: a
  request decoding there waits out the prefills computed beside it, a share
  ``duty`` of the engine's time. One line of mean gaps with those stalls in
  them, on a one-core decode engine at 4 req/s, predicted 4.9-5.7 ms per token
  with nothing in flight, where requests took 2.3-3.5, and the routing judged
  a third of its prompts unable to meet a 4.6 ms objective: how often prefills
  come is the router's doing, not the load's. No seed: flat (one figure
  whatever the load) until the samples' loads differ, and an engine without
  :data:`SEED_SAMPLES` samples of its own is priced with the mean of the
  others' step lines (a prefill engine serves no decodes until the policy
  sends it ``whole`` requests) over its own duty; :meth:`Measurements.tpot_s`, and ``EngineCost.tpot_s``
  for the ``decode_load`` rule of :mod:`disagg.proxy.policy`, and with the line's
  slope (``EngineCost.tpot_added_s``) for the decode work an option places on an
  engine (:func:`disagg.routecost.decode_s`);
- the output tokens of a reply, an exponentially weighted mean over the streamed
  replies that ended well (:meth:`Measurements.output_tokens`): how many tokens
  a request is expected to decode, which the router caps with its ``max_tokens``.

Each fit is an exponentially weighted least-squares line (:class:`EwFit`):
every new sample weighs :data:`DECAY` of the whole, so the figures follow an
engine that gets busy or a link that slows within a few requests. The seed
enters as two pseudo-samples that fade the same way and leave once
:data:`SEED_SAMPLES` real ones are in.

Robust to one-off costs (the rule, and why). An engine's first requests after
it starts or comes back, and a pair's first handoff, pay costs that never
recur (warm-up and compilation, the first NIXL or socket handshake, the
allocator growing): taken at face value, one slow first handoff made the link
look several times slower than it is, and the policy stopped splitting for as
long as it took other paths to change the choice. Two rules, both inside
:class:`EwFit`:

1. *Warm-up discard*: the first :data:`WARMUP_SAMPLES` observation(s) of each
   fit are dropped. A fit is made per engine and per prefill -> decode pair,
   and :meth:`Measurements.forget` drops both when an engine comes back, so
   "first" means first after start or return: exactly where the one-off costs
   are.
2. *Upward clipping* (a winsorised update): once a fit stands on its own
   samples (the seed gone), an observation above :data:`CLIP` x the fit's
   current prediction for that size enters as ``CLIP x`` the prediction. One-off
   costs only ever add time, so only samples above the prediction are clipped;
   a faster one is taken as it is. A single outlier then moves the prediction
   at its size by about ``DECAY x (CLIP - 1)`` (+45% for a size amid the
   samples', up to x2.2 for one far outside their range, where it has more
   leverage on the line) instead of without bound (a 10x outlier unclipped:
   x3 amid the samples, x6 outside), while a genuine, repeated slow-down is
   clipped less and less as the prediction rises (a 10x slow-down: x1.8 after
   4 samples, x4.2 after 6), which flips a decision with any margin within a
   few requests. While the seed is still in a fit, samples are not clipped: a
   seed may be far off (a spec-sheet rate was 40x the measured one), and the
   first samples must be free to say so.

A fit learns only from the paths the policy takes: an engine judged slow gets
no local prompts to show it has become fast again until its queue or the
other paths' costs change the choice, or the policy's exploration
(:class:`disagg.proxy.policy.Explorer`) re-measures a path not taken for a
while; its restart resets it to the seed.

Who calls what: :mod:`disagg.proxy.app` builds it and registers
:meth:`Measurements.forget` with both pools' ``on_return`` (a restarted engine
is a new process: what was measured about it no longer holds); the policy
(:mod:`disagg.proxy.policy`) reads :meth:`engine_cost` and :meth:`link_cost`;
the serving code calls :meth:`dispatch` and the ``observe_*`` methods.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from disagg.routecost import EngineCost, LinkCost, Progress, split_ttft

#: the weight one new sample takes (an EWMA over about the last 1/DECAY samples)
DECAY = 0.2
#: prompt lengths (tokens) of the two pseudo-samples that carry an engine's seed line
SEED_TOKENS = (128.0, 2048.0)
#: KV sizes (bytes) of the two pseudo-samples that carry a link's seed line
SEED_BYTES = (1 << 20, 64 << 20)
#: engine loads (requests in flight) of the two pseudo-samples of the lines in load: a streamed fixed
#: cost's seed, and an engine's busy line (flat at 0)
LOAD_SEED_IN_FLIGHT = (0.0, 8.0)
#: real samples after which the seed leaves a fit altogether
SEED_SAMPLES = 4
#: relative spread of the samples' x below which a fit keeps its intercept and fits only the slope
MIN_SPREAD = 0.05
#: the same for an engine's prefill line (x: prompt tokens). Its intercept, extrapolated from prompts
#: of alike sizes, is noise: on a 2-vCPU AVX2 EPYC a decode engine's line fitted on local prompts of
#: 256-509 tokens (1.4-2.2 s each) took an intercept of 0.76-1.8 s where 8-token prompts took 35-90
#: ms, so short prompts were priced at 0.76 s and more there and split (the line never saw one
#: again to say otherwise), and a 2,048-token prompt was predicted at 2.3 s where it took about 8.
#: Kept while the sizes' standard deviation is below 0.3 x their mean (256-509 tokens: 0.24),
#: the line goes through the mean at its earlier intercept, which is right at the sizes sent
PREFILL_MIN_SPREAD = 0.3
#: slowest rate a fit may report, per unit (a bad sample never makes a rate zero or negative)
MIN_RATE = 1e-3
#: observations a new fit drops (an engine's or a pair's first after start or return: one-off costs)
WARMUP_SAMPLES = 1
#: an observation above CLIP x the fit's prediction enters as CLIP x the prediction (once the seed is gone)
CLIP = 3.0
#: a prefill sent with more than this share of its tokens queued ahead is no sample of the engine's line
QUEUED_SHARE = 0.25
#: seconds of an engine's latest prefill work its prefill duty is the share of
DUTY_WINDOW_S = 10.0
#: the highest prefill duty a time per output token is priced with (a saturated engine still decodes)
MAX_DUTY = 0.8
#: seconds an engine's prefill work is kept, to take it off the decode samples of requests that long
WORK_KEPT_S = 120.0
#: a decode sample less the prefills computed beside it is kept at this share of it at least (their
#: compute is each prefill's line, which may overstate it)
MIN_STEP_SHARE = 0.25


class PrefillWork:
    """The prefill compute one engine did lately: (when it ended, seconds on the engine's line).

    :meth:`Measurements._finish` adds each prefill done there (its first token or reply, or a
    non-streamed one's predicted end);
    :meth:`Measurements.tpot_s` reads :meth:`duty`, and :meth:`Measurements.observe_decode`
    :meth:`between` (the prefills computed while a request decoded there)."""

    __slots__ = ("_kept", "_window", "_window_s")

    def __init__(self) -> None:
        self._kept: deque[tuple[float, float]] = deque()      # the last WORK_KEPT_S seconds
        self._window: deque[tuple[float, float]] = deque()    # the last DUTY_WINDOW_S seconds
        self._window_s = 0.0                                   # their seconds, summed

    def add(self, when: float, seconds: float) -> None:
        if not (math.isfinite(when) and math.isfinite(seconds)) or seconds <= 0:
            return
        self._kept.append((when, seconds))
        self._window.append((when, seconds))
        self._window_s += seconds

    def duty(self, now: float) -> float:
        """The share of the last :data:`DUTY_WINDOW_S` seconds before ``now`` spent prefilling, at most
        :data:`MAX_DUTY`."""
        while self._window and self._window[0][0] <= now - DUTY_WINDOW_S:
            self._window_s -= self._window.popleft()[1]
        if not self._window:
            self._window_s = 0.0          # no float residue once empty
        return min(max(self._window_s, 0.0) / DUTY_WINDOW_S, MAX_DUTY)

    def between(self, start: float, end: float) -> float:
        """Seconds of the prefills that ended after ``start`` and by ``end``."""
        while self._kept and self._kept[0][0] <= end - WORK_KEPT_S:
            self._kept.popleft()
        return sum(s for t, s in self._kept if start < t <= end)


class _Gate:
    """The two rules against one-off costs (module doc), apart from :class:`EwFit`'s arithmetic:
    the first ``warmup`` observations are dropped, and once :data:`SEED_SAMPLES` real
    ones are in, an observation above ``clip`` x the prediction enters as ``clip`` x it."""

    __slots__ = ("_clip", "_warmup", "clipped", "discarded", "samples")

    def __init__(self, warmup: int, clip: float) -> None:
        self._warmup = warmup
        self._clip = clip
        self.samples = 0               # observations in the fit
        self.discarded = 0             # warm-up observations dropped
        self.clipped = 0               # observations clipped to ``clip`` x the prediction

    def _admit(self, y: float, predicted: Callable[[], float]) -> tuple[float, str] | None:
        """``(y as it enters, "used" or "clipped")``, or None for a warm-up observation
        (counted ``discarded``). ``predicted`` is asked only once the seed has left."""
        if self.discarded < self._warmup:
            self.discarded += 1
            return None
        if self.samples >= SEED_SAMPLES:    # the fit stands on its own samples: clip what is far above it
            ceiling = self._clip * predicted()
            if 0 < ceiling < y:
                self.clipped += 1
                return ceiling, "clipped"
        return y, "used"


class EwFit(_Gate):
    """``y = a + x / rate``, fitted by exponentially weighted least squares.

    Both coefficients stay physical: ``a >= 0`` and ``rate > 0``. When the
    samples' ``x`` hardly differ (their standard deviation below ``min_spread`` x
    their mean), the intercept stays where it was and only the
    rate is refitted through the weighted mean (all at ``x = 0``: the mean is the
    intercept). The first ``warmup``
    observations are dropped and, once the seed has left, an observation above
    ``clip`` x the prediction enters as ``clip`` x the prediction (module doc).
    The seed is the line ``intercept + x / rate`` at each of ``seed_x``; with no
    ``seed_x`` there is none (ask nothing before the first sample), and an
    ``intercept`` of ``inf`` keeps the line flat at the samples' mean until their
    ``x`` differ. ``seeded_intercept``: while the seed is in the fit, the line is
    the seed's intercept and the rate of the real samples alone through it (an
    engine's prefill line: :meth:`Measurements._engine` says why).
    """

    __slots__ = ("_a", "_coef", "_decay", "_min_spread", "_s", "_seed", "_seed_left", "_seeded_intercept", "_sx",
                 "_sxx", "_sxy", "_sy")

    def __init__(self, intercept: float, rate: float, seed_x: tuple[float, ...], decay: float = DECAY, *,
                 warmup: int = WARMUP_SAMPLES, clip: float = CLIP, min_spread: float = MIN_SPREAD,
                 seeded_intercept: bool = False) -> None:
        super().__init__(warmup, clip)
        self._decay = decay
        self._min_spread = min_spread
        self._seeded_intercept = seeded_intercept
        self._s = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._a = max(intercept, 0.0)
        self._coef: tuple[float, float] | None = None     # coefficients() until the next sample
        for x in seed_x:
            self._add(x, intercept + x / rate, 1.0)
        self._seed = (self._s, self._sx, self._sy, self._sxx, self._sxy)
        self._seed_left = 1.0          # the seed's share still in the sums (dropped after SEED_SAMPLES)

    def _add(self, x: float, y: float, w: float) -> None:
        self._s += w
        self._sx += w * x
        self._sy += w * y
        self._sxx += w * x * x
        self._sxy += w * x * y

    def predict(self, x: float) -> float:
        """The fit's ``y`` for ``x`` units."""
        a, rate = self.coefficients()
        return a + x / rate

    def add(self, x: float, y: float) -> str:
        """One observation: ``y`` seconds for ``x`` units (tokens, bytes, requests in flight). Returns
        what became of it:
        ``used``, ``clipped``, ``discarded`` (warm-up) or ``invalid`` (not finite, negative)."""
        if not (math.isfinite(x) and math.isfinite(y)) or x < 0 or y < 0:
            return "invalid"
        admitted = self._admit(y, lambda: self.predict(x))
        if admitted is None:
            return "discarded"
        y, outcome = admitted
        self._coef = None
        keep = 1.0 - self._decay
        self._s *= keep
        self._sx *= keep
        self._sy *= keep
        self._sxx *= keep
        self._sxy *= keep
        self._add(x, y, len(SEED_TOKENS) * self._decay)  # the total weight stays that of the seed
        self.samples += 1
        self._seed_left *= keep
        if self.samples == SEED_SAMPLES:   # enough of its own: the seed's far points would only skew the line
            left = self._seed_left
            s, sx, sy, sxx, sxy = self._seed
            self._s -= left * s
            self._sx -= left * sx
            self._sy -= left * sy
            self._sxx -= left * sxx
            self._sxy -= left * sxy
            self._seed_left = 0.0
        return outcome

    def coefficients(self) -> tuple[float, float]:
        """``(intercept seconds, rate units per second)``, computed once per sample (the policy
        asks every engine's lines for every prompt)."""
        if self._coef is None:
            self._coef = self._fit()
        return self._coef

    def _fit(self) -> tuple[float, float]:
        mx, my = self._sx / self._s, self._sy / self._s
        var = self._sxx / self._s - mx * mx
        rising = False
        if self._seeded_intercept and 0 < self.samples < SEED_SAMPLES:
            left = self._seed_left           # the real samples' means: the sums less the seed's share
            s0, sx0, sy0 = self._seed[:3]
            s = self._s - left * s0
            mx, my, var = (self._sx - left * sx0) / s, (self._sy - left * sy0) / s, 0.0
        if var > (self._min_spread * mx) ** 2:
            slope = (self._sxy / self._s - mx * my) / var
            a = my - slope * mx
            if slope > 0 and a >= 0:
                self._a = a
                return a, max(1.0 / slope, MIN_RATE)
            rising = slope > 0            # steeper than a line with an intercept >= 0
        if mx <= 0:       # every sample at x = 0: their mean is the intercept
            self._a = max(my, 0.0)
            return self._a, math.inf
        # no intercept known yet (a line seeded flat): a rising line goes through 0 and the mean
        a = min(0.0 if rising and math.isinf(self._a) else self._a, my)
        slope = (my - a) / mx
        return a, (max(1.0 / slope, MIN_RATE) if slope > 0 else math.inf)


def _residual(beyond_s: float) -> float:
    """What a time exceeded its prediction by, as a line's ``y``: never below 0 (earlier than
    predicted counts as 0); not finite stays so, for :meth:`EwFit.add` to call invalid."""
    return max(beyond_s, 0.0) if math.isfinite(beyond_s) else beyond_s


def _busy_s(eng: _Engine, in_flight: float) -> float:
    """What ``in_flight`` requests on the engine add to a prefill's first token beyond its line:
    its busy line there, and nothing when it has none in flight (its line is then the whole time:
    the busy line is fitted on loaded samples only, and its intercept, extrapolated to an idle
    engine, added 18-43 ms to 64-token prompts that took 61-90 ms on one core)."""
    return eng.busy.predict(in_flight) if in_flight > 0 else 0.0


@dataclass(eq=False, slots=True)   # identity: two prefills of one size are two entries (settle removes the right one)
class _Pending:
    """A prefill sent to an engine that has not produced its first token yet."""

    tokens: float
    #: perf_counter after which it no longer counts (non-streamed replies: predicted end of prefill)
    until: float = math.inf
    #: its tokens the engine has still to prefill, as estimated from the time it has had (see ``_progress``)
    left: float = 0.0

    def __post_init__(self) -> None:
        self.left = self.tokens


@dataclass(eq=False)   # identity: two handoffs with one deadline are two entries
class Transit:
    """A handoff in transit on a pair's link: the handle :meth:`Measurements.handoff_started`
    returns, which the router (:class:`disagg.proxy.router.Router`) keeps with the request's
    flight and hands back to :meth:`Measurements.handoff_ended`."""

    #: perf_counter after which it no longer counts (a reply not streamed: the handoff's predicted end)
    until: float = math.inf


@dataclass(slots=True)
class _Engine:
    fit: EwFit                         # prefill seconds against work tokens, engine alone
    busy: EwFit                        # what its load adds, against requests in flight
    seed_rate: float
    #: the seed rate was measured on the engine's host (``disagg bench``), not estimated
    seed_measured: bool = False
    pending: list[_Pending] = field(default_factory=list)
    #: perf_counter up to which the engine's work on ``pending`` has been counted
    progressed_at: float = 0.0
    #: the prefills it computed lately (its duty; taken off its decode samples)
    work: PrefillWork = field(default_factory=PrefillWork)


class Measurements:
    """Live prefill fits per engine, handoff fits per pair, and what each engine has queued."""

    def __init__(self, *, prefill_tokens_per_s: float, decode_tokens_per_s: float, overhead_s: float,
                 handoff_fixed_s: float, link_bytes_per_s: float, decay: float = DECAY,
                 streaming_layers: int | None = None, measured_rates: frozenset[str] = frozenset()) -> None:
        """``streaming_layers``: the handoff streams the KV over that many layers while the prefill
        computes (:class:`~disagg.routecost.LinkCost`); None: it moves after the prefill.
        ``measured_rates``: the roles whose seed rate was measured on their hosts (:meth:`_line`)."""
        self._seed = {"prefill": prefill_tokens_per_s, "decode": decode_tokens_per_s}
        self._measured_rates = measured_rates
        self.streaming_layers = streaming_layers
        self._overhead = overhead_s
        self._fixed = handoff_fixed_s
        self._link = link_bytes_per_s
        self._decay = decay
        self._engines: dict[str, _Engine] = {}
        self._links: dict[tuple[str, str], EwFit] = {}
        #: per engine URL, time per output token against requests in flight (see the module doc)
        self._decode: dict[str, EwFit] = {}
        #: per pair, a streamed handoff's fixed cost against the decode engine's requests in flight
        #: (streaming_layers set; see the module doc)
        self._streamed_fixed: dict[tuple[str, str], EwFit] = {}
        #: output tokens per reply, an exponentially weighted mean (:meth:`observe_output`)
        self._output: float | None = None
        #: per pair, the handoffs moving KV over its link now (:meth:`handoff_started`)
        self._in_transit: dict[tuple[str, str], list[Transit]] = {}

    # --- state per engine --------------------------------------------------------

    def _engine(self, role: str, url: str) -> _Engine:
        eng = self._engines.get(url)
        if eng is None:
            rate = self._seed.get(role, self._seed["prefill"])
            # an engine's prefill line keeps its seed's overhead while the seed is in it (fewer than
            # :data:`SEED_SAMPLES` samples), its rate that of the real samples alone through it: a
            # least-squares line through the seed's two points and a real sample far off their line has an
            # intercept that neither says (a decode engine seeded at 1,000 tokens/s whose first sample was a
            # 256-token prompt in 1.66 s came out at 482 ms + n / 1,281/s, so prompts of 8-64 tokens, which it
            # prefilled in 35-90 ms, were priced at half a second there and split, and it never saw one again
            # to say otherwise), and a rate through the seed's points as well stays near the seed's (the
            # 2,048-token point outweighs short samples)
            eng = self._engines[url] = _Engine(EwFit(self._overhead, rate, SEED_TOKENS, self._decay,
                                                     min_spread=PREFILL_MIN_SPREAD, seeded_intercept=True),
                                               EwFit(0.0, math.inf, LOAD_SEED_IN_FLIGHT, self._decay), rate,
                                               seed_measured=role in self._measured_rates)
        return eng

    def queued_tokens(self, role: str, url: str, now: float | None = None) -> float:
        """Prefill tokens the engine has still to work through: of the prefills sent to it that have
        no first token yet, what the time since they were sent has not covered (:meth:`_progress`)."""
        eng = self._engine(role, url)
        return self._queued(eng, now, self._line(eng)[1]) if eng.pending else 0.0

    def _queued(self, eng: _Engine, now: float | None, rate: float) -> float:
        """:meth:`queued_tokens` of ``eng`` at its prefill ``rate``."""
        if not eng.pending:
            return 0.0
        self._progress(eng, time.perf_counter() if now is None else now, rate)
        return sum(p.left for p in eng.pending)

    def _progress(self, eng: _Engine, now: float, rate: float) -> None:
        """Count the engine's work on its pending prefills up to ``now``.

        The engine is taken to work through them in the order they were sent (vLLM schedules
        running prefills first, then the waiting queue in arrival order), each at its fitted rate;
        a prefill whose tokens are all counted stays pending (with nothing left) until its first
        token or its ``until``. So a prompt that comes while a long prefill runs waits for what is
        left of it, not for all of it: counting every pending token in full over-predicted the
        wait of a prompt that came late in a long prefill by up to that prefill's whole time.
        """
        for expired in sorted((p for p in eng.pending if p.until <= now), key=lambda p: p.until):
            self._finish(eng, expired, expired.until)   # a non-streamed prefill, predicted done by then
        elapsed = now - eng.progressed_at
        if elapsed <= 0:
            return
        eng.progressed_at = now
        budget = elapsed * rate
        for p in eng.pending:
            if budget <= 0:
                break
            done = min(p.left, budget)
            p.left -= done
            budget -= done

    def _finish(self, eng: _Engine, done: _Pending, when: float) -> None:
        """``done`` produced its first token at ``when``: the engine worked on it (and, in the
        order sent, on the prefills before it, which count as done) up to then; the ones behind
        it get no credit for that time. Its compute, on the engine's line, joins the engine's
        prefill work then."""
        for p in eng.pending:
            if p is done:
                break
            p.left = 0.0
        eng.pending = [p for p in eng.pending if p is not done]
        eng.progressed_at = max(eng.progressed_at, when)
        overhead, rate = self._line(eng)
        eng.work.add(when, overhead + done.tokens / rate)

    def wait_s(self, role: str, url: str, now: float | None = None) -> float:
        """Seconds the engine needs for the prefill work queued on it (:meth:`queued_tokens`)."""
        eng = self._engine(role, url)
        rate = self._line(eng)[1]
        queued = self._queued(eng, now, rate)
        return queued / rate if queued else 0.0

    def _measured(self) -> list[_Engine]:
        """The engines whose prefill line stands on :data:`SEED_SAMPLES` samples of their own."""
        return [e for e in self._engines.values() if e.fit.samples >= SEED_SAMPLES]

    def _line(self, eng: _Engine) -> tuple[float, float]:
        """The engine's (overhead seconds, prefill tokens per second) for predictions.

        An engine with fewer than :data:`SEED_SAMPLES` samples of its own is judged by the
        engines that have them: their mean per-request overhead (HTTP, scheduling, a first step:
        alike across the engines of one deployment), and, when its seed rate is an estimate, that
        seed scaled by how far the measured rates of engines seeded with estimates fell from
        their seeds (the seeds' ratios between hosts are kept, their scale is what was measured:
        a spec-sheet estimate may be far off for every host alike). So one engine's measurement
        is never compared with another's optimistic seed. A seed measured on the engine's host
        (``measured_rates``) is taken as it is, and no measurement scales an estimate by a
        measured seed's ratio: scaling a measured 1,127 tokens/s by a decode engine's measured /
        estimated 1,053 / 17,340 priced a prefill engine at 68 tokens/s on a 2-core CPU box.
        """
        overhead, rate = eng.fit.coefficients()
        if eng.fit.samples < SEED_SAMPLES:
            known = [(e.fit.coefficients(), e.seed_rate, e.seed_measured) for e in self._measured()]
            if known:
                overhead = sum(c[0] for c, _, _ in known) / len(known)
                ratios = [c[1] / seed for c, seed, measured in known if not measured]
                rate = eng.seed_rate if eng.seed_measured or not ratios else eng.seed_rate * sum(ratios) / len(ratios)
        return overhead, rate

    def engine_cost(self, role: str, url: str, outstanding: int, now: float | None = None, *,
                    kv_room: tuple[float, tuple[tuple[float, float], ...]] = (math.inf, ()),
                    decodes: Sequence[Progress] = ()) -> EngineCost:
        """The engine's prefill line (:meth:`_line`) and load, for the predictor (``outstanding``:
        its requests in flight; ``now``: perf_counter, for the queue), with what the router knows
        beside these measurements: ``kv_room`` (free KV tokens and expected frees, from its KV
        ledger) and the ``decodes`` it follows there (the router's are taken only when read)."""
        eng = self._engine(role, url)
        overhead, rate = self._line(eng)
        queued = self._queued(eng, now, rate)
        waiting = len(eng.pending)
        when = time.perf_counter() if now is None else now
        running = self.decoding(url, outstanding, when)
        duty = eng.work.duty(when)      # once: tpot_s below is :meth:`tpot_s` at this duty
        step, before = self._step_s(url, running + 1), self._step_s(url, running)
        tpot = step / (1.0 - duty) if step is not None else None
        added = max(tpot - before / (1.0 - duty), 0.0) if tpot is not None and before is not None else 0.0
        return EngineCost(tokens_per_s=rate, overhead_s=overhead, queued_tokens=queued,
                          running=running, waiting=waiting,
                          tpot_s=tpot, busy_s=_busy_s(eng, outstanding),
                          tpot_added_s=added, prefill_duty=duty,
                          kv_free_tokens=kv_room[0], kv_frees=kv_room[1], decodes=decodes)

    def decoding(self, url: str, outstanding: int, now: float | None = None) -> int:
        """Of the engine's ``outstanding`` requests, those decoding at ``now`` (perf_counter): less
        the prefills sent to it that have no first token yet (a non-streamed one until its
        predicted end, as in :meth:`queued_tokens`)."""
        eng = self._engines.get(url)
        if eng is None:
            return outstanding
        when = time.perf_counter() if now is None else now
        return max(outstanding - sum(1 for p in eng.pending if p.until > when), 0)

    def tpot_s(self, url: str, decoding: float, now: float | None = None) -> float | None:
        """Predicted time per output token on the engine at ``url`` with ``decoding`` requests
        decoding there (module doc): its decode step, over ``1 -`` its prefill duty at ``now``
        (perf_counter). The step: its own line once it has :data:`SEED_SAMPLES` samples, else the
        mean of the lines of the engines that have them, else None."""
        step = self._step_s(url, decoding)
        if step is None:
            return None
        eng = self._engines.get(url)
        duty = eng.work.duty(time.perf_counter() if now is None else now) if eng is not None else 0.0
        return step / (1.0 - duty)

    def _step_s(self, url: str, decoding: float) -> float | None:
        """The decode step of :meth:`tpot_s` with ``decoding`` requests decoding, before the prefill duty."""
        own = self._decode.get(url)
        if own is not None and own.samples >= SEED_SAMPLES:
            return own.predict(decoding)
        known = [f.predict(decoding) for f in self._decode.values() if f.samples >= SEED_SAMPLES]
        return sum(known) / len(known) if known else None

    def observe_decode(self, url: str, decoding: float, tpot_s: float, first: float | None = None,
                       last: float | None = None) -> str:
        """A streamed reply from the engine at ``url`` averaged ``tpot_s`` seconds between token
        events, from its first at ``first`` to its last at ``last`` (perf_counter), with about
        ``decoding`` requests decoding there (its own included): a sample of the engine's decode
        step once the prefills it computed in that time are taken off, spread over the reply's gaps
        (kept at :data:`MIN_STEP_SHARE` of ``tpot_s`` at least; none taken off without ``first``
        and ``last``); returns what the line made of it (:meth:`EwFit.add`)."""
        fit = self._decode.get(url)
        if fit is None:     # no seed: flat at the samples' mean until their loads differ
            fit = self._decode[url] = EwFit(math.inf, 1.0, (), self._decay)
        step = tpot_s
        eng = self._engines.get(url)
        if eng is not None and first is not None and last is not None and last > first and tpot_s > 0:
            gaps = (last - first) / tpot_s
            step = max(tpot_s - eng.work.between(first, last) / gaps, MIN_STEP_SHARE * tpot_s)
        return fit.add(decoding, step)

    def observe_output(self, tokens: float) -> None:
        """A streamed reply ended well with ``tokens`` output tokens (its token events): a sample of
        :meth:`output_tokens`, an exponentially weighted mean over every engine."""
        if tokens > 0:
            held = self._output
            self._output = tokens if held is None else held + self._decay * (tokens - held)

    def output_tokens(self) -> float | None:
        """The output tokens of a reply, as the replies relayed so far went (None: none yet); the
        router caps it with each request's ``max_tokens`` to price its decode work."""
        return self._output

    def link_cost(self, prefill_url: str, decode_url: str, decode_in_flight: int = 0,
                  now: float | None = None) -> LinkCost:
        """The pair's handoff line (fixed seconds, bytes per second) and its handoffs in transit at
        ``now`` (perf_counter). Its fixed cost includes what the decode engine's ``decode_in_flight``
        requests add to any first token there, that engine's busy line: a handoff's first token
        waits for its steps as a local prompt's does (:meth:`observe_handoff`,
        :meth:`observe_streamed_split`). Streamed, the rest of the fixed cost is its learned line at
        that load and the rate the seed's; sent after the prefill, both are the pair's line."""
        fixed, rate = self._link_fit(prefill_url, decode_url).coefficients()
        if self.streaming_layers is not None:
            fixed = self._streamed_fixed_fit(prefill_url, decode_url).predict(decode_in_flight)
        fixed += self._decode_busy_s(decode_url, decode_in_flight)
        return LinkCost(fixed_s=fixed, bytes_per_s=rate, streaming_layers=self.streaming_layers,
                        in_transit=self._transiting((prefill_url, decode_url), now))

    def handoff_started(self, prefill_url: str, decode_url: str, until: float = math.inf) -> Transit:
        """A handoff began moving KV from the engine at ``prefill_url`` to ``decode_url`` (the
        router calls it at a split's prefill reply, or as a streamed split is sent); it counts in
        :attr:`LinkCost.in_transit <disagg.routecost.LinkCost.in_transit>` until the handle
        returned is passed to :meth:`handoff_ended`, or until ``until`` (perf_counter) passes: a
        reply that is not streamed shows no first token, so the router passes the handoff's
        predicted end (a non-streamed reply would otherwise count for its whole decode)."""
        handle = Transit(until)
        self._in_transit.setdefault((prefill_url, decode_url), []).append(handle)
        return handle

    def handoff_ended(self, prefill_url: str, decode_url: str, handle: Transit) -> None:
        """The handoff of ``handle`` (:meth:`handoff_started`) is over: the decode engine's first
        token came, or the route failed or was cancelled. Nothing when the pair was forgotten
        meanwhile (an engine came back: its handoffs in transit went with the old process)."""
        key = (prefill_url, decode_url)
        moving = self._in_transit.get(key)
        if moving is None or not any(h is handle for h in moving):
            return
        moving[:] = [h for h in moving if h is not handle]
        if not moving:
            del self._in_transit[key]

    def _transiting(self, key: tuple[str, str], now: float | None) -> int:
        """The pair's handoffs in transit at ``now`` (perf_counter; those past their ``until`` leave)."""
        moving = self._in_transit.get(key)
        if not moving:
            return 0
        when = time.perf_counter() if now is None else now
        moving[:] = [h for h in moving if h.until > when]
        if not moving:
            del self._in_transit[key]
        return len(moving)

    def _streamed_fixed_fit(self, prefill_url: str, decode_url: str) -> EwFit:
        """The pair's streamed fixed cost against D's requests in flight, seeded flat at the seed."""
        key = (prefill_url, decode_url)
        fit = self._streamed_fixed.get(key)
        if fit is None:
            fit = self._streamed_fixed[key] = EwFit(self._fixed, math.inf, LOAD_SEED_IN_FLIGHT, self._decay)
        return fit

    def streamed_arrival_s(self, prefill_url: str, decode_url: str, tokens: float, kv_bytes: float,
                           queued_ahead: float, prefill_in_flight: int = 0) -> float:
        """A streamed split's predicted TTFT less the handoff's fixed cost: the prefill engine's
        ``queued_ahead + tokens`` at its line (:meth:`_line`) and its busy line at
        ``prefill_in_flight``, plus the part of the transfer of ``kv_bytes`` that prefill does not
        hide. The router takes it when the split is sent, and gives what the first token took
        beyond it to :meth:`observe_streamed_split`."""
        eng = self._engine("prefill", prefill_url)
        overhead, rate = self._line(eng)
        prefill = EngineCost(tokens_per_s=rate, overhead_s=overhead, queued_tokens=queued_ahead,
                             busy_s=_busy_s(eng, prefill_in_flight))
        link = replace(self.link_cost(prefill_url, decode_url), fixed_s=0.0)
        return split_ttft(tokens, kv_bytes, prefill, link)

    def observe_streamed_split(self, prefill_url: str, decode_url: str, beyond_s: float,
                               decode_in_flight: int = 0) -> str:
        """A streamed split sent while the decode engine had ``decode_in_flight`` requests came to
        its first token ``beyond_s`` seconds after its :meth:`streamed_arrival_s`: a sample of the
        pair's fixed handoff cost at that load (what the handoff adds beyond the modelled prefill
        and exposed transfer: the decode engine's steps, the requests' round trips, and whatever
        the prefill line missed). Earlier than predicted counts as 0 (the line's ``y`` is never
        negative). What the decode engine's load adds to any first token there (its busy line at
        ``decode_in_flight``, learned from the prompts it prefills itself) is taken off first: a
        split's first token waits for that engine's step in progress and the one that takes it in,
        as a local prompt's does, so :meth:`link_cost` prices a split into a busy decode engine with
        that engine's busy line even while this line is still its idle seed (flat, it had a 2-token
        split into a one-core decode engine decoding 5 answers predicted at 44 ms against a local
        prefill's 40 ms there; it took 117 ms). Returns what the line made of it (:meth:`EwFit.add`)."""
        beyond_s -= self._decode_busy_s(decode_url, decode_in_flight)
        return self._streamed_fixed_fit(prefill_url, decode_url).add(decode_in_flight, _residual(beyond_s))

    def _decode_busy_s(self, decode_url: str, in_flight: float) -> float:
        """What ``in_flight`` requests on the decode engine at ``decode_url`` add to a first token
        there (:func:`_busy_s`; nothing while the proxy has measured nothing of that engine)."""
        eng = self._engines.get(decode_url)
        return _busy_s(eng, in_flight) if eng is not None else 0.0

    def _link_fit(self, prefill_url: str, decode_url: str) -> EwFit:
        key = (prefill_url, decode_url)
        fit = self._links.get(key)
        if fit is None:
            fit = self._links[key] = EwFit(self._fixed, self._link, SEED_BYTES, self._decay)
        return fit

    # --- what serving tells us -------------------------------------------------------

    def dispatch(self, role: str, url: str, tokens: float, until: float = math.inf,
                 now: float | None = None) -> _Pending:
        """A prefill of ``tokens`` sent to the engine at ``now`` (perf_counter); pass the result to
        :meth:`settle` at its first token."""
        eng = self._engine(role, url)
        when = time.perf_counter() if now is None else now
        if eng.pending:
            self._progress(eng, when, self._line(eng)[1])
        else:                  # an idle engine starts on this one now: its idle time is no progress
            eng.progressed_at = when
        pending = _Pending(tokens, until)
        eng.pending.append(pending)
        return pending

    def settle(self, role: str, url: str, pending: _Pending, now: float | None = None, *, done: bool = True) -> None:
        """The prefill no longer counts as queued. ``done`` (its first token or reply came at
        ``now``, perf_counter): the time since the last count was spent on it (:meth:`_finish`);
        not done (it failed, or the client left): it only leaves the queue."""
        eng = self._engines.get(url)
        if eng is None or not any(p is pending for p in eng.pending):
            return
        if done:
            self._finish(eng, pending, time.perf_counter() if now is None else now)
        else:
            eng.pending = [p for p in eng.pending if p is not pending]

    def observe_prefill(self, role: str, url: str, tokens: float, seconds: float, queued_ahead: float = 0.0,
                        in_flight: int = 0) -> str:
        """A prefill of ``tokens`` took ``seconds`` (sent -> first token or prefill reply) with
        ``queued_ahead`` tokens of work queued before it (:meth:`queued_tokens` when it was sent)
        and ``in_flight`` requests on the engine then (not counting itself); returns what the fit
        made of it (:meth:`EwFit.add`), or ``queued`` when more than :data:`QUEUED_SHARE` of
        ``tokens`` was queued ahead: such a time measures how far the queue estimate was off (vLLM
        batches, the engine ran decodes in between) more than the engine's rate, and fitting it as
        ``queued_ahead + tokens`` bent the line (the intercept grew, so short prompts on an idle
        engine were predicted several times their time). With ``in_flight`` > 0 it is a sample
        of the engine's busy line instead (module doc): what the time exceeded its line by, at
        that load (never below 0); ``unfitted`` while that line is still the seed (no engine's
        line stands on :data:`SEED_SAMPLES` samples yet)."""
        if queued_ahead > QUEUED_SHARE * tokens:
            return "queued"
        eng = self._engine(role, url)
        if in_flight <= 0:
            return eng.fit.add(queued_ahead + tokens, seconds)
        if not self._measured():
            return "unfitted"     # every line is still the seed: what load adds cannot be told from its error
        overhead, rate = self._line(eng)
        return eng.busy.add(in_flight, _residual(seconds - overhead - (queued_ahead + tokens) / rate))

    def observe_handoff(self, prefill_url: str, decode_url: str, kv_bytes: float, seconds: float,
                        decode_in_flight: int = 0) -> str:
        """A handoff of ``kv_bytes`` took ``seconds`` (prefill reply -> first decode token), its split
        sent while the decode engine had ``decode_in_flight`` requests: a sample of the pair's line
        once the decode engine's busy line at that load is taken off (:meth:`link_cost` adds it back
        at the load of the moment: one line over busy and idle handoffs priced every split at the
        mean load); returns what the fit made of it (:meth:`EwFit.add`)."""
        beyond_s = seconds - self._decode_busy_s(decode_url, decode_in_flight)
        return self._link_fit(prefill_url, decode_url).add(kv_bytes, _residual(beyond_s))

    def forget(self, url: str) -> None:
        """Drop everything measured about the engine at ``url`` (it came back: a new process).

        Registered with ``BackendPool.on_return``; its pending prefills are gone with it.
        """
        self._engines.pop(url, None)
        self._decode.pop(url, None)
        for pairs in (self._links, self._streamed_fixed, self._in_transit):
            for key in [k for k in pairs if url in k]:
                del pairs[key]

    def samples(self, url: str) -> int:
        """Real observations behind the engine's current fit (0: the seed alone; warm-up discards not counted)."""
        eng = self._engines.get(url)
        return eng.fit.samples if eng is not None else 0

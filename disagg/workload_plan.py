"""The workload plan: ``disagg plan TOPOLOGY --classes ... --rate R [--slo ...]`` (or ``--trace FILE``).

For a mix of prompt classes arriving at ``rate`` requests per second it predicts, per class, the
TTFT p50 and TPOT p50, and the workload's goodput (requests per second meeting the SLO), for
every way the topology's hosts can serve it:

- **colocated on each host**: that host's engines serve whole requests (prefill and decode), the
  other hosts idle;
- **replicas**: every engine of every host serves whole requests;
- **static split** ``P -> D``: every prompt prefilled on the P hosts, its KV handed over the link,
  decoded on the D hosts; for two hosts both ways round, for more every split of the hosts into
  prefill and decode sides (the P:D ratio);
- **auto**: the same sides with the proxy's per-prompt choice between split, local (the decode
  engine prefills it itself) and whole (a prefill engine serves it alone), made by the router's
  own arithmetic (:func:`disagg.routecost.option_costs`, :func:`disagg.routecost.cheapest`) at the
  load that choice produces;

and one recommendation with the figures that decide it (:func:`recommend`).

The model (stated in the output):

- **arrivals**: Poisson at ``rate``, each class its weight's share. Where a group of engines
  shares a path (replicas, several prefill engines), requests spread over them as the proxy's
  pool sends them, to the engine with the fewest in flight, the first of the tied ones after the
  engine picked last (:func:`_spread`): each engine's count in flight taken as Poisson of its rate
  x the time it holds a request (queue, prefill, decode at its load), the shares where those
  counts give them back (:func:`least_outstanding_shares`, :func:`least_outstanding_picks`), so an
  engine that holds requests longer gets fewer even at light load, though less so than an even
  coin on ties would give (with two, a tie goes to the engine not picked last); in proportion
  to what each could serve of the mix alone (:func:`_capacity`) where those shares would still
  overload one;
- **prefill**: each engine's prefills form an M/G/1 queue served at the engine's prefill time
  per class (a stored ``disagg bench`` rate, ``a x n + b x n^2`` where it was probed at two
  prompt lengths, else the spec-sheet estimate; an emulated host only
  measured: :func:`disagg.planning.host_prefill`), with priority over its decodes (vLLM schedules
  waiting prefills into every step). Mean wait (Pollaczek-Khinchine)
  ``lambda E[S^2] / (2 (1 - rho))``, ``rho = lambda E[S]``; its distribution taken as
  ``P(wait > t) = rho exp(-t rho / E[wait])`` (a wait with probability rho, exponential beyond):
  TTFT p50 and the share of a class meeting the TTFT SLO come from it. A prefill (and a handed-over
  request's first step) on an engine that is decoding joins its running batch: it waits out the
  step in progress and its own step reads the batch's KV (:func:`batch_join`). A split's TTFT adds the
  handoff (:meth:`disagg.planning.LinkEstimate.added_s`: fixed cost, the transfer's exposed part,
  decode's first step) and the link's own M/G/1 wait (the transfers queue on it). On a decode
  engine that is decoding, a handed-over request also waits for a step boundary at the load's
  start and end (half a step more than a prefill's join), and on a CPU engine the handoff takes
  longer, its receipt sharing the engine's cores with the steps (:meth:`EngineLoad.handed_step`,
  :func:`receipt_factor`: twice as long on one core);
- **decode**: time per output token on an engine from :func:`disagg.routecost.tpot_with_prefills_s`:
  a decode step takes the engine's :class:`disagg.routecost.DecodeLine`, ``fixed + per byte x``
  the KV of every running request: the one ``disagg bench`` measured on the host's engines
  (:func:`disagg.measurements.lookup_decode`), else the active weights and the KV read at the
  engine's memory rate (a GPU's spec sheet, an estimate; a CPU engine's
  :data:`disagg.routecost.FIRST_STEP_CPU_BYTES_PER_S` per pinned core, an estimate fitted to
  decode's first step), and waits out the prefills computed on the same engine. A class's TPOT
  reads its own KV besides the others' (:meth:`EngineLoad.class_tpot_s`); one request's TPOT
  spreads with the count decoding beside it over its decode (:func:`others_at_most`), which the
  share meeting a TPOT limit counts (the TPOT p50 is the mean's);
- **KV memory**: an engine's KV capacity (an emulated host's ``emulate.kv_memory``, the host's
  ``kv_memory_gb``, vLLM's CPU KV space, or a GPU estimate: :func:`disagg.planning.engine_memory`)
  holds at most ``capacity / KV of one conversation (prompt + output)`` requests at once
  ("KV binds: at most N requests at once"); the requests decoding there (Little's law: decode
  tokens per second x TPOT) and those prefilling or handing off must fit on average. A prompt
  waits for room where its KV and the running requests' (a Poisson count per class) exceed it,
  until one ends (:func:`kv_room_waits`), and holds the engine's prefill queue meanwhile;
- **saturation**: a configuration saturates where an engine's prefills take all its time
  (rho >= 1), its decodes' reads leave no time, the KV its requests hold reaches its capacity or
  its prompts' waits for room and its prefills hold its queue all the time, or the link's
  transfers take all its time: it is reported "saturated" (why), with goodput 0;
- **goodput**: ``rate x`` the share of requests whose TTFT, TPOT (and E2EL) meet the SLO; without
  an SLO, the rate when not saturated. ``saturates at``: the highest rate the configuration
  sustains (bisection on the rate).

- **engine kinds**: a prefill rate and a decode step are kept per host and KV connector
  (:mod:`disagg.measurements`): colocated and replica configurations run engines without a
  connector (a colocated topology's), split and auto ones the topology's connector (what runs
  beside an engine's compute changes both: :mod:`disagg.measurements`);

Not modelled: preemption and recompute (requests past the KV capacity queue instead), the
prompts' prefix cache, a decode engine's queue ahead of a split's first step, the proxy's
exploration and its ``decode_backlog`` rule for ``whole`` (its ``decode_load`` rule is: whole is
offered where the decode engine's TPOT exceeds the prefill engine's), the router's live errors.

Called by ``disagg plan`` (:mod:`disagg.commands.plan`); pure arithmetic but for
:func:`plan_workload`, which reads the topology's stored measurements through
:mod:`disagg.planning`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import accumulate, combinations, product
from typing import Any, Protocol

import numpy as np

from disagg.errors import PlanError
from disagg.kvmath import ModelArch, resolve_model
from disagg.measurements import NO_CONNECTOR, engine_words, lookup_decode
from disagg.planning import (
    MEASURE_HINT,
    LinkEstimate,
    Plan,
    PrefillEstimate,
    engine_connector,
    engine_memory,
    first_pair,
    host_device,
    host_prefill,
    model_weight_bytes,
    plan_topology,
)
from disagg.routecost import (
    FIRST_STEP_CPU_BYTES_PER_S,
    FIRST_STEP_CPU_SOURCE,
    DecodeLine,
    EngineCost,
    Option,
    cheapest,
    option_costs,
    tpot_with_prefills_s,
)
from disagg.serving import WHOLE_TPOT_FACTOR
from disagg.topology import InstanceSpec, Topology
from disagg.units import fmt_bytes, fmt_count, fmt_seconds

#: the proxy's default ``routing.stall_weight`` (seconds of TTFT one second of stalled decode is worth)
STALL_WEIGHT = 1.0
#: rounds of the auto routing's fixed point (:func:`solve_auto`)
AUTO_ROUNDS = 60
#: goodputs closer than this share of the rate count as a tie in the recommendation
TIE_SHARE = 0.01
#: the highest rate the saturation search tries (requests per second)
MAX_RATE = 1e6
#: where a saturated figure stands in for infinity in the router's costs (seconds)
CAP_S = 1e4

COLOCATED, REPLICAS, SPLIT, AUTO = "colocated", "replicas", "split", "auto"
#: simpler first: on a tie of goodput and saturation rate, the earlier kind is recommended
KINDS = (COLOCATED, REPLICAS, SPLIT, AUTO)


class WorkClass(Protocol):
    """A prompt class as ``disagg bench`` parses it (:class:`disagg.bench.workload.PromptClass`)."""

    @property
    def name(self) -> str: ...
    @property
    def input_len(self) -> int: ...
    @property
    def output_len(self) -> int: ...
    @property
    def weight(self) -> float: ...


class Objective(Protocol):
    """An SLO as ``disagg bench`` parses it (:class:`disagg.bench.slo.SLO`): limits in seconds."""

    @property
    def ttft(self) -> float | None: ...
    @property
    def tpot(self) -> float | None: ...
    @property
    def e2el(self) -> float | None: ...


# --- the engines ---------------------------------------------------------------------

@dataclass(frozen=True)
class EngineModel:
    """One engine (a topology instance) as the model sees it."""

    name: str                           # the instance, e.g. prefill[0]
    host: str
    prefill: PrefillEstimate
    decode: DecodeLine                  # its decode step: measured, or the weights and KV at a memory rate
    kv_capacity_bytes: float | None     # None: unknown (not checked)
    kv_source: str
    connector: str = NO_CONNECTOR       # the KV connector it runs (its measurements are of that kind)
    #: how many times longer a handoff into this engine takes while it decodes (:func:`receipt_factor`)
    busy_receipt_factor: float = 1.0

    @property
    def idle_step_s(self) -> float:
        """A decode step with one request of no context."""
        return self.decode.fixed_s

    @property
    def memory_bytes_per_s(self) -> float:
        """The rate its decode steps read the batch's KV at (inf: no KV part)."""
        return self.decode.kv_bytes_per_s

    @property
    def decode_source(self) -> str:
        """Where its decode step comes from."""
        return self.decode.source


@dataclass(frozen=True)
class Mix:
    """The workload's classes as the model needs them (lengths, share, KV sizes)."""

    name: str
    prompt_tokens: int
    output_tokens: int
    share: float                        # of the requests
    kv_full_bytes: float                # one conversation's KV (prompt + output), in the cache
    kv_mean_bytes: float                # what it holds on average while decoding (prompt + half the output)
    kv_prompt_bytes: float              # what its prefill holds (the prompt), in the cache
    wire_bytes: float                   # the prompt's KV on the link

    @property
    def label(self) -> str:
        """``short (128:32, 70%)``."""
        return f"{self.name} ({fmt_count(self.prompt_tokens)}:{fmt_count(self.output_tokens)}, {self.share:.0%})"


# --- paths and loads ----------------------------------------------------------------

@dataclass(frozen=True)
class ServePath:
    """How a request is served: whole on one of ``engines`` (``prefill`` None), or prefilled on one
    of ``prefill``, handed over ``link`` and decoded on one of ``engines``."""

    option: Option
    engines: tuple[EngineModel, ...]
    prefill: tuple[EngineModel, ...] | None = None
    link: LinkEstimate | None = None
    streaming_layers: int | None = None


@dataclass
class _Streams:
    prefill_rps: float = 0.0
    prefill_s: float = 0.0              # sum of rate x service time
    prefill_s2: float = 0.0             # sum of rate x service time squared
    held_bytes: float = 0.0             # KV held by prefills and handoffs (rate x time x bytes)
    decode_tps: float = 0.0             # decode tokens per second
    decode_kv: float = 0.0              # decode tokens per second x mean KV per request
    decode_full: float = 0.0            # decode tokens per second x full KV per request
    #: per class: its decode tokens per second here, its mean KV while decoding, its output tokens
    decodes: dict[str, tuple[float, float, int]] = field(default_factory=dict)
    #: per (class, whether they queue for its prefills): requests per second that need room for
    #: their prompt's KV here (a prefill; a handed-over prompt, which does not queue) and their
    #: prefill seconds
    rooms: dict[tuple[str, bool], tuple[float, float]] = field(default_factory=dict)


def _add_prefill(s: _Streams, e: EngineModel, lam: float, m: Mix, hold_s: float) -> None:
    """``lam`` prompts a second of ``m`` prefill on ``e``, holding their KV ``hold_s`` past the prefill."""
    t = e.prefill.seconds(m.prompt_tokens)
    s.prefill_rps += lam
    s.prefill_s += lam * t
    s.prefill_s2 += lam * t * t
    s.held_bytes += lam * (t + hold_s) * m.kv_prompt_bytes
    s.rooms[(m.name, True)] = (s.rooms.get((m.name, True), (0.0, t))[0] + lam, t)


def _add_decode(s: _Streams, lam: float, m: Mix) -> None:
    """``lam`` requests a second of ``m`` decode on the engine of ``s``."""
    s.decode_tps += lam * m.output_tokens
    s.decode_kv += lam * m.output_tokens * m.kv_mean_bytes
    s.decode_full += lam * m.output_tokens * m.kv_full_bytes
    tps = s.decodes.get(m.name, (0.0, 0.0, 0))[0]
    s.decodes[m.name] = (tps + lam * m.output_tokens, m.kv_mean_bytes, m.output_tokens)


def _add_handed(s: _Streams, lam: float, m: Mix) -> None:
    """``lam`` prompts a second of ``m`` handed over to the engine of ``s`` (they need room, not its prefill)."""
    s.rooms[(m.name, False)] = (s.rooms.get((m.name, False), (0.0, 0.0))[0] + lam, 0.0)


@dataclass(frozen=True)
class Wait:
    """A queue wait: ``P(wait > t) = p exp(-t p / mean)`` (p: the chance to wait at all)."""

    p: float
    mean_s: float

    def exceeds(self, t: float) -> float:
        """P(wait > t)."""
        if t < 0:
            return 1.0
        if self.mean_s <= 0 or self.p <= 0:
            return 0.0
        return self.p * math.exp(-t * self.p / self.mean_s)

    def plus(self, other: Wait) -> Wait:
        """Two waits in a row, as one of the same form (means add, either may wait)."""
        return Wait(1 - (1 - self.p) * (1 - other.p), self.mean_s + other.mean_s)


#: no wait at all
NO_WAIT = Wait(0.0, 0.0)


def mg1_wait(rate: float, busy_s: float, busy_s2: float) -> Wait:
    """The M/G/1 wait of a server with arrivals at ``rate``, ``busy_s`` = rate x E[S] (its
    utilisation rho) and ``busy_s2`` = rate x E[S^2]: mean ``rate E[S^2] / (2 (1 - rho))``
    (Pollaczek-Khinchine), waiting with probability rho. rho >= 1: an unbounded mean."""
    if rate <= 0:
        return Wait(0.0, 0.0)
    if busy_s >= 1:
        return Wait(1.0, math.inf)
    return Wait(busy_s, busy_s2 / (2 * (1 - busy_s)))


@dataclass(frozen=True)
class EngineLoad:
    """What a rate puts on one engine."""

    engine: str
    host: str
    prefill_rps: float
    prefill_share: float                # of its time (rho)
    wait: Wait
    decode_tps: float                   # decode tokens per second
    tpot_s: float                       # mean time per output token there, over its tokens (inf: saturated)
    running: float                      # requests decoding at once (Little's law)
    kv_needed_bytes: float
    kv_capacity_bytes: float | None
    kv_max_requests: int | None         # conversations of its mix that fit at once
    tpot_added_s: float                 # what one more decoding request adds to a step
    #: a step's time per byte of a request's own KV, stretched by the prefills (b / (1 - share)) ...
    own_kv_s_per_byte: float = 0.0
    #: ... and the mean KV of its decoding requests (token-weighted): :meth:`class_tpot_s`
    mean_kv_bytes: float = 0.0
    #: the chance a new request finds the engine decoding (:func:`batch_join`) ...
    decoding_p: float = 0.0
    #: ... and what its first token then waits besides its prefill: the step in progress and its
    #: own step's read of the running batch's KV
    join_s: float = 0.0
    #: rate x (prefill + the wait for room in the KV cache) of the prompts queueing here: the share
    #: of its time its prefill queue is held (>= 1: the queue grows without bound)
    queue_share: float = 0.0
    #: per class, the wait for room in its KV cache (:func:`kv_room_waits`)
    kv_waits: dict[str, Wait] = field(default_factory=dict)

    def kv_wait(self, klass: str) -> Wait:
        """The wait of a ``klass`` prompt for room in this engine's KV cache (none: no wait)."""
        return self.kv_waits.get(klass, NO_WAIT)

    def first_step(self) -> list[tuple[float, float]]:
        """(chance, added seconds) of a new request's first token here: none while the engine is
        idle, :attr:`join_s` while it decodes."""
        if self.decoding_p <= 0:
            return [(1.0, 0.0)]
        return [(1 - self.decoding_p, 0.0), (self.decoding_p, self.join_s)]

    def handed_step(self, handoff_s: float, factor: float) -> list[tuple[float, float]]:
        """(chance, added seconds) of a handed-over request's first token here, after a handoff of
        ``handoff_s``: as :meth:`first_step` while the engine is idle; while it decodes, besides the
        join, the handoff once more times ``factor - 1`` (the engine's
        :attr:`EngineModel.busy_receipt_factor`: the receipt shares its cores with its steps) and
        half a step (:attr:`tpot_s`):
        vLLM starts the load at the step after the request arrives and sees it done only at the end
        of a step, so the request waits for a step boundary at both ends where a prefill waits at one."""
        if self.decoding_p <= 0:
            return [(1.0, 0.0)]
        step = self.tpot_s if math.isfinite(self.tpot_s) else 0.0
        busy = self.join_s + handoff_s * (factor - 1) + step / 2
        return [(1 - self.decoding_p, 0.0), (self.decoding_p, busy)]

    def class_tpot_s(self, kv_bytes: float) -> float:
        """Time per output token of a request holding ``kv_bytes`` of KV on average while it decodes:
        the engine's mean TPOT, less the mean request's own KV read, plus this one's (every step
        reads each running request's own KV besides the others')."""
        if math.isinf(self.tpot_s):
            return math.inf
        return self.tpot_s + (kv_bytes - self.mean_kv_bytes) * self.own_kv_s_per_byte

    @property
    def saturated(self) -> str | None:
        """Why this engine cannot keep up, or None."""
        if self.prefill_share >= 1:
            return f"{self.engine} on {self.host}: prefills take {self.prefill_share:.0%} of its time"
        if self.queue_share >= 1:
            return (f"{self.engine} on {self.host}: KV binds: its prompts wait for room in its KV cache; with its "
                    f"prefills they hold its queue {self.queue_share:.0%} of the time")
        if math.isinf(self.tpot_s):
            return f"{self.engine} on {self.host}: its prefills and decode reads leave its decodes no time"
        if self.kv_capacity_bytes is not None and self.kv_needed_bytes >= self.kv_capacity_bytes:
            return (f"{self.engine} on {self.host}: KV binds: its requests need "
                    f"{fmt_bytes(self.kv_needed_bytes)} of KV at once, it has {fmt_bytes(self.kv_capacity_bytes)}"
                    + ("" if self.kv_max_requests is None else
                       f" (at most {fmt_count(self.kv_max_requests)} requests at once)"))
        return None

    def to_json(self) -> dict[str, Any]:
        """JSON-ready (inf as None)."""
        return {"engine": self.engine, "host": self.host, "prefill_rps": self.prefill_rps,
                "prefill_share": self.prefill_share, "wait_mean_s": _finite(self.wait.mean_s),
                "decode_tokens_per_s": self.decode_tps, "tpot_s": _finite(self.tpot_s),
                "running": _finite(self.running), "kv_needed_bytes": _finite(self.kv_needed_bytes),
                "kv_capacity_bytes": self.kv_capacity_bytes, "kv_max_requests": self.kv_max_requests,
                "queue_share": _finite(self.queue_share),
                "kv_wait_mean_s": {k: _finite(w.mean_s) for k, w in self.kv_waits.items()},
                "decoding_p": self.decoding_p, "join_s": self.join_s, "saturated": self.saturated}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _capacity(engine: EngineModel, mix: Sequence[Mix], prefills: bool, decodes: bool) -> float:
    """Requests per second of the mix ``engine`` could serve alone, to first order: one over the
    prefill time and decode reads one request costs it."""
    cost = 0.0
    for m in mix:
        if prefills:
            cost += m.share * engine.prefill.seconds(m.prompt_tokens)
        if decodes:
            cost += m.share * m.output_tokens * m.kv_mean_bytes * engine.decode.per_kv_byte_s
    return 1.0 / cost if cost > 0 else 1.0


def _holding_s(engine: EngineModel, mix: Sequence[Mix], prefills: bool, decodes: bool, rps: float) -> float:
    """How long a request of ``mix`` stays in flight on ``engine`` (the proxy counts it from its
    send to its reply's end) when ``rps`` requests a second come to it (:func:`_engine_load`): its
    prefill queue's mean wait, its wait for room in the KV cache and its prefill (``prefills``),
    and its output at its TPOT there (``decodes``); inf where the engine cannot keep up. (A
    prefill engine's part of a handoff after the prefill is not counted.)"""
    s = _Streams()
    for m in mix:
        if prefills:
            _add_prefill(s, engine, rps * m.share, m, 0.0)
        if decodes:
            _add_decode(s, rps * m.share, m)
    load = _engine_load(engine, s, {m.name: m.kv_prompt_bytes for m in mix})
    if load.saturated or math.isinf(load.wait.mean_s):
        return math.inf
    held = load.wait.mean_s if prefills else 0.0
    for m in mix:
        if prefills:
            held += m.share * (engine.prefill.seconds(m.prompt_tokens) + load.kv_wait(m.name).mean_s)
        if decodes:
            held += m.share * m.output_tokens * load.class_tpot_s(m.kv_mean_bytes)
    return held


#: the most requests in flight an engine's count is followed to (:func:`least_outstanding_shares`)
IN_FLIGHT_CAP = 200.0
#: rounds of the pool's fixed point (:func:`least_outstanding_shares`)
POOL_ROUNDS = 60
#: the most steps of the round-robin pointer's chain (:func:`least_outstanding_picks`)
POOL_CHAIN_STEPS = 2000


def _poisson(mean: float, top: int) -> list[float]:
    """P(N = k) for k = 0..top of a Poisson count of ``mean``."""
    out = [math.exp(-mean)]
    for k in range(1, top + 1):
        out.append(out[-1] * mean / k)
    return out


def _poisson_top(largest_mean: float) -> int:
    """How far a Poisson count of at most ``largest_mean`` is followed: ten standard deviations past it."""
    return int(largest_mean + 10 * math.sqrt(largest_mean) + 10)


def least_outstanding_picks(in_flight: Sequence[float]) -> list[float]:
    """The share of arrivals each engine of a pool gets when each goes to the engine with the fewest
    requests in flight, the first of the tied ones in the pool's round-robin order
    (:meth:`disagg.proxy.backends.BackendPool.pick`: the scan starts after the engine picked last),
    each engine's count Poisson of its mean ``in_flight`` (a request stays its own time, the others'
    decode beside it: an infinite-server count), the engines and the arrivals taken as independent.

    Who is picked depends on who was picked last: a Markov chain on the pool's pointer, whose
    stationary distribution is the share. With two engines a tie goes to the one not picked last, so
    ties make up for the picks the busier engine lost: against an idle engine, one with a request in
    flight a fraction p of the time gets ``(1 - p) / (2 - p)`` of the requests (a third at p = 1/2),
    not the ``(1 - p) / 2`` an even coin on ties would give it."""
    n = len(in_flight)
    means = [min(max(x, 0.0), IN_FLIGHT_CAP) for x in in_flight]
    top = _poisson_top(max(means))
    pmf = [_poisson(x, top) for x in means]
    above = []                                  # P(N > k)
    for p in pmf:
        acc, tail = 1.0, []
        for q in p:
            acc -= q
            tail.append(max(acc, 0.0))
        above.append(tail)
    at_least = [[a + q for a, q in zip(above[i], pmf[i], strict=True)] for i in range(n)]

    def picked_from(start: int) -> list[float]:
        """P(each engine is picked) when the scan starts at engine ``start``: fewer in flight than
        every engine scanned before it, no more than every engine after it."""
        order = [(start + i) % n for i in range(n)]
        row = [0.0] * n
        for pos, j in enumerate(order):
            total = 0.0
            for k in range(top + 1):
                if pmf[j][k] < 1e-15:
                    continue
                term = pmf[j][k]
                for i in order[:pos]:
                    term *= above[i][k]
                for i in order[pos + 1:]:
                    term *= at_least[i][k]
                total += term
            row[j] = total
        s = sum(row)
        return [r / s for r in row] if s > 0 else [1.0 / n] * n

    # the chain from "engine L picked last" (the scan starts at L + 1); lazy, so it cannot cycle
    moves = [picked_from((last + 1) % n) for last in range(n)]
    share = [1.0 / n] * n
    for _ in range(POOL_CHAIN_STEPS):
        nxt = [0.5 * s for s in share]
        for last, row in enumerate(moves):
            for j, chance in enumerate(row):
                nxt[j] += 0.5 * share[last] * chance
        done = max(abs(a - b) for a, b in zip(nxt, share, strict=True)) < 1e-12
        share = nxt
        if done:
            break
    return share


def least_outstanding_shares(holding: Sequence[Callable[[float], float]], rps: float) -> list[float]:
    """The shares of ``rps`` requests a second a least-outstanding pool settles at: each engine's
    mean count in flight is its rate x its holding time at that rate (Little's law; ``holding[i]``
    maps the engine's rate to it, :func:`_holding_s`), and the shares are where
    :func:`least_outstanding_picks` of those counts gives them back. An engine that holds its
    requests longer (a slower prefill, a longer decode) has more in flight when a request comes,
    so it gets less than an equal share even at light load. Two engines: the first's share by
    bisection (its picks fall as its share grows); more: the average of the picks round after
    round (each round's picks at the shares so far, moving them by 1/(round + 2))."""
    n = len(holding)

    def picks(shares: Sequence[float]) -> list[float]:
        counts = [rps * s * h(rps * s) for s, h in zip(shares, holding, strict=True)]
        return least_outstanding_picks([c if math.isfinite(c) else IN_FLIGHT_CAP for c in counts])

    equal = [1.0 / n] * n
    at_equal = [rps * s * h(rps * s) for s, h in zip(equal, holding, strict=True)]
    if all(c == at_equal[0] for c in at_equal):
        return equal                            # alike engines
    if n == 2:
        lo, hi = 0.0, 1.0
        for _ in range(POOL_ROUNDS):
            mid = (lo + hi) / 2
            if picks([mid, 1 - mid])[0] > mid:
                lo = mid
            else:
                hi = mid
            if hi - lo < 1e-6:
                break
        mid = (lo + hi) / 2
        return [mid, 1 - mid]
    shares = equal
    for k in range(POOL_ROUNDS):
        step = 1.0 / (k + 2)
        shares = [(1 - step) * s + step * p for s, p in zip(shares, picks(shares), strict=True)]
    return shares


def _spread(engines: Sequence[EngineModel], mix: Sequence[Mix], prefills: bool, decodes: bool,
            rps: float) -> list[tuple[EngineModel, float]]:
    """How the proxy's pool shares ``rps`` requests a second among ``engines``: each request to the
    engine with the fewest requests in flight, a tie to the first after the engine picked last
    (:class:`disagg.proxy.backends.BackendPool`): :func:`least_outstanding_shares`, which gives a
    slow engine less than an equal share at any load, since its requests stay longer. Where those
    shares would still overload an engine (past what it could serve of the mix alone,
    :func:`_capacity`), the faster engines free first and take the rest: shares in proportion to
    each engine's capacity."""
    if len(engines) == 1:
        return [(engines[0], 1.0)]
    caps = [_capacity(e, mix, prefills, decodes) for e in engines]
    shares = least_outstanding_shares(
        [partial(_holding_s, e, mix, prefills, decodes) for e in engines], rps)
    if all(rps * s < cap for s, cap in zip(shares, caps, strict=True)):
        return list(zip(engines, shares, strict=True))
    total = sum(caps)
    return [(e, c / total) for e, c in zip(engines, caps, strict=True)]


@dataclass(frozen=True)
class Branch:
    """One way a class's requests go (an engine, or a prefill and a decode engine): its share of
    the class, its TTFT without queueing, its queue wait and its mean TPOT; ``others``, the mean
    count decoding beside it on its decode engine, each adding ``per_other_s`` to its TPOT
    (:meth:`tpot_within`)."""

    share: float
    base_s: float
    wait: Wait
    tpot_s: float
    option: Option
    others: float = 0.0
    per_other_s: float = 0.0

    def tpot_within(self, limit: float) -> float:
        """The chance its TPOT is at most ``limit``: ``tpot_s + (N - others) x per_other_s`` with N
        the time-averaged count decoding beside it (:func:`others_at_most`)."""
        if self.per_other_s <= 0 or self.others <= 0:
            return 1.0 if self.tpot_s <= limit else 0.0
        return others_at_most(self.others, self.others + (limit - self.tpot_s) / self.per_other_s)


@dataclass(frozen=True)
class Outcome:
    """One rate through one set of routes: every engine's load, the link's, each class's branches."""

    loads: dict[str, EngineLoad]
    link_share: float                   # of the link's time its transfers take (0: no split)
    link_wait: Wait
    branches: dict[str, list[Branch]]
    saturated: tuple[str, ...]


Routes = dict[str, list[tuple[float, ServePath]]]


def evaluate(mix: Sequence[Mix], rate: float, routes: Routes) -> Outcome:
    """Loads, waits and TPOT of every engine when ``rate`` requests per second of ``mix`` take
    ``routes`` (per class: (share, path) pairs)."""
    streams: dict[str, _Streams] = {}
    engines: dict[str, EngineModel] = {}
    link_rps = link_busy = link_busy2 = 0.0
    spreads: dict[tuple[str, int], list[tuple[EngineModel, float]]] = {}

    path_rps: dict[int, float] = {}
    for m in mix:
        for share, path in routes[m.name]:
            path_rps[id(path)] = path_rps.get(id(path), 0.0) + rate * m.share * share

    def spread(path: ServePath, side: str) -> list[tuple[EngineModel, float]]:
        key = (side, id(path))
        if key not in spreads:
            group = path.engines if side != "prefill" else (path.prefill or ())
            spreads[key] = _spread(group, mix, prefills=side != "decode", decodes=side != "prefill",
                                   rps=path_rps[id(path)])
        return spreads[key]

    def stream(e: EngineModel) -> _Streams:
        engines[e.name] = e
        return streams.setdefault(e.name, _Streams())

    handoffs: dict[tuple[str, str], float] = {}
    for m in mix:
        for share, path in routes[m.name]:
            lam = rate * m.share * share
            if lam <= 0:
                continue
            if path.prefill is None:
                for e, f in spread(path, "both"):
                    _add_prefill(stream(e), e, lam * f, m, 0.0)
                    _add_decode(stream(e), lam * f, m)
                continue
            assert path.link is not None
            x = m.wire_bytes / path.link.bytes_per_s
            link_rps += lam
            link_busy += lam * x
            link_busy2 += lam * x * x
            for p, f in spread(path, "prefill"):
                hand = path.link.added_s(m.wire_bytes, p.prefill.seconds(m.prompt_tokens), path.streaming_layers)
                handoffs[(m.name, p.name)] = hand
                _add_prefill(stream(p), p, lam * f, m, hand)
            for d, f in spread(path, "decode"):
                _add_decode(stream(d), lam * f, m)
                _add_handed(stream(d), lam * f, m)

    prompt_bytes = {m.name: m.kv_prompt_bytes for m in mix}
    loads = {name: _engine_load(engines[name], st, prompt_bytes) for name, st in streams.items()}
    link_wait = mg1_wait(link_rps, link_busy, link_busy2)
    saturated = [why for load in loads.values() if (why := load.saturated) is not None]
    if link_busy >= 1:
        saturated.append(f"the link: its transfers take {link_busy:.0%} of its time")

    branches: dict[str, list[Branch]] = {}
    for m in mix:
        out: list[Branch] = []
        for share, path in routes[m.name]:
            if share <= 0:
                continue
            if path.prefill is None:
                for e, f in spread(path, "both"):
                    load = loads[e.name]
                    for chance, join in load.first_step():
                        out.append(Branch(share * f * chance, e.prefill.seconds(m.prompt_tokens) + join,
                                          load.wait.plus(load.kv_wait(m.name)),
                                          load.class_tpot_s(m.kv_mean_bytes), path.option,
                                          _finite(load.running) or 0.0, load.tpot_added_s))
                continue
            for p, fp in spread(path, "prefill"):
                for d, fd in spread(path, "decode"):
                    hand = handoffs[(m.name, p.name)]
                    base = p.prefill.seconds(m.prompt_tokens) + hand
                    # its prefill joins P's running batch (if any), its first step D's
                    handed = loads[d.name].handed_step(hand, d.busy_receipt_factor)
                    for (cp, jp), (cd, jd) in product(loads[p.name].first_step(), handed):
                        waits = (loads[p.name].wait.plus(loads[p.name].kv_wait(m.name)).plus(link_wait)
                                 .plus(loads[d.name].kv_wait(m.name)))
                        out.append(Branch(share * fp * fd * cp * cd, base + jp + jd, waits,
                                          loads[d.name].class_tpot_s(m.kv_mean_bytes), path.option,
                                          _finite(loads[d.name].running) or 0.0, loads[d.name].tpot_added_s))
        branches[m.name] = out
    return Outcome(loads, link_busy, link_wait, branches, tuple(saturated))


def batch_join(decode: DecodeLine, running: float, mean_kv_bytes: float) -> dict[str, float]:
    """What a new request's first token waits for on an engine with ``running`` requests decoding
    on average (Little's law), each holding ``mean_kv_bytes``: as :class:`EngineLoad`'s
    ``decoding_p`` and ``join_s``. vLLM runs one step at a time and puts a new prefill (or a
    handed-over request's first step) into the next step together with the running decodes, so
    while the engine decodes the request waits out the step in progress (half a step on average)
    and its own step also reads the batch's KV. The count decoding is taken as Poisson
    (requests decode side by side): the engine decodes with chance ``p = 1 - exp(-running)``, then
    ``n = running / p`` requests on average, each step ``fixed + n x KV x per byte``, so

        join = fixed / 2 + 1.5 x n x KV x per byte

    (idle: nothing added; the prefill's own time already holds an idle step)."""
    if running <= 0 or not math.isfinite(running):
        return {"decoding_p": 0.0, "join_s": 0.0}
    p = 1 - math.exp(-running)
    batch_read = running / p * mean_kv_bytes * decode.per_kv_byte_s
    return {"decoding_p": p, "join_s": decode.fixed_s / 2 + 1.5 * batch_read}


#: a KV cache's held requests counted one by one up to this many on average, as a normal beyond
KV_ENUMERATE_MAX = 12.0


#: the grid a KV cache's held bytes are counted on (:func:`_kv_exceeds`): this many steps up to the room
KV_GRID = 1024


def _kv_exceeds(rooms: Sequence[float], parts: Sequence[tuple[float, float]]) -> list[float]:
    """P(the KV held > room) for each of ``rooms``, where each part (mean count, bytes each) is a
    Poisson count of requests holding that much: the sum's distribution on a grid of
    :data:`KV_GRID` steps up to the largest room (each size rounded to a step, at least one) while
    the requests are few on average, else its normal approximation (mean sum n x kv, variance sum
    n x kv^2)."""
    parts = [(min(mean, IN_FLIGHT_CAP), size) for mean, size in parts if mean > 0 and size > 0]
    if not parts:
        return [1.0 if r < 0 else 0.0 for r in rooms]
    if sum(mean for mean, _ in parts) > KV_ENUMERATE_MAX:
        mu = sum(mean * size for mean, size in parts)
        sd = math.sqrt(sum(mean * size * size for mean, size in parts))
        return [0.5 * math.erfc((r - mu) / (sd * math.sqrt(2))) for r in rooms]
    limit = max(rooms)
    if limit < 0:
        return [1.0 for _ in rooms]
    grain = max(limit, 1e-9) / KV_GRID
    dist = np.zeros(KV_GRID + 1)
    dist[0] = 1.0
    for mean, size in parts:
        step = max(1, round(size / grain))
        counts = min(KV_GRID // step, int(mean + 10 * math.sqrt(mean) + 10))
        held = np.zeros(KV_GRID + 1)
        for n, q in enumerate(_poisson(mean, counts)):
            if q > 1e-13:
                held[n * step:] += q * dist[:KV_GRID + 1 - n * step]
        dist = held
    below = np.cumsum(dist)
    return [1.0 if r < 0 else min(1.0, max(0.0, 1.0 - float(below[min(KV_GRID, math.floor(r / grain))])))
            for r in rooms]


def kv_room_waits(room_bytes: float, decoding: Sequence[tuple[float, float, float]],
                  needs: dict[str, float]) -> dict[str, Wait]:
    """Per class, a prompt's wait for room in an engine's KV cache: vLLM schedules a waiting prompt
    once its KV (``needs``, bytes) fits beside the running requests' (first come, first served:
    it holds the prompts behind it). ``room_bytes``: the capacity less what prefills and handoffs
    hold on average; ``decoding``: per class (mean count decoding, the KV each holds on average,
    its decode seconds), each count Poisson. A prompt waits with the chance those requests' KV and
    its own exceed the room, for a running request to end and free its KV: the class that frees it
    taken in proportion to the KV each holds, and the first of its ``n`` running requests to end,
    each with a remaining decode uniform over its decode D (their starts are Poisson), after
    ``D / (n + 1)`` on average (n at its mean)."""
    held = sum(n * kv for n, kv, _ in decoding)
    if held <= 0 or not needs:
        return {k: NO_WAIT for k in needs}
    frees_s = sum(n * kv * d / (n + 1) for n, kv, d in decoding) / held
    chances = _kv_exceeds([room_bytes - need for need in needs.values()], [(n, kv) for n, kv, _ in decoding])
    return {k: Wait(p, p * frees_s) if p > 0 else NO_WAIT for k, p in zip(needs, chances, strict=True)}


def _engine_load(e: EngineModel, s: _Streams, prompt_bytes: dict[str, float]) -> EngineLoad:
    """What the streams ``s`` put on ``e``: its TPOT (:func:`disagg.routecost.tpot_with_prefills_s`),
    requests decoding (Little's law), KV needed, each class's wait for room in its KV cache
    (:func:`kv_room_waits`), and the M/G/1 wait of its prefill queue, which a prompt waiting for
    room holds (``prompt_bytes``: each class's prompt KV)."""
    mean_kv = s.decode_kv / s.decode_tps if s.decode_tps > 0 else 0.0
    added = mean_kv * e.decode.per_kv_byte_s
    # a step of the mean request: the fixed part and its own KV; each other request adds its KV
    cost = EngineCost(tokens_per_s=1.0, tpot_s=e.idle_step_s + added, tpot_added_s=added)
    tpot = tpot_with_prefills_s(cost, s.prefill_s, s.decode_tps) if s.prefill_s < 1 else math.inf
    running = s.decode_tps * tpot if s.decode_tps > 0 else 0.0
    full = s.decode_full / s.decode_tps if s.decode_tps > 0 else 0.0
    # a prompt waiting in the queue holds no KV yet; one prefilling or handing off does
    needed = running * full + s.held_bytes if math.isfinite(running) else math.inf
    per_request = _kv_per_request(s)
    kv_max = (None if e.kv_capacity_bytes is None or per_request <= 0
              else int(e.kv_capacity_bytes // per_request))
    stretch = e.decode.per_kv_byte_s / max(1 - s.prefill_s, 1e-3)
    kv_waits: dict[str, Wait] = {}
    queue_s, queue_s2 = s.prefill_s, s.prefill_s2
    if e.kv_capacity_bytes is not None and math.isfinite(tpot) and s.decodes:
        decoding = []                           # (mean count, KV each, decode seconds) per class
        for tps, kv, tokens in s.decodes.values():
            class_tpot = tpot + (kv - mean_kv) * stretch
            decoding.append((tps * class_tpot, kv, tokens * class_tpot))
        kv_waits = kv_room_waits(e.kv_capacity_bytes - s.held_bytes, decoding,
                                 {klass: prompt_bytes[klass] for klass, _ in s.rooms})
        for (klass, queues), (lam, t) in s.rooms.items():
            kw = kv_waits[klass]
            if queues:                          # the waiting prompt holds the engine's queue (FCFS)
                cond = kw.mean_s / kw.p if kw.p > 0 else 0.0
                queue_s += lam * kw.mean_s
                queue_s2 += lam * (2 * t * kw.mean_s + 2 * kw.p * cond * cond)
    return EngineLoad(engine=e.name, host=e.host, prefill_rps=s.prefill_rps, prefill_share=s.prefill_s,
                      wait=mg1_wait(s.prefill_rps, queue_s, queue_s2), decode_tps=s.decode_tps, tpot_s=tpot,
                      running=running, kv_needed_bytes=needed, kv_capacity_bytes=e.kv_capacity_bytes,
                      kv_max_requests=kv_max, tpot_added_s=added / max(1 - s.prefill_s, 1e-3),
                      own_kv_s_per_byte=stretch, mean_kv_bytes=mean_kv, **batch_join(e.decode, running, mean_kv),
                      queue_share=queue_s, kv_waits=kv_waits)


def _kv_per_request(s: _Streams) -> float:
    """One conversation's KV on an engine, averaged over what it decodes (prefill-only: what it holds)."""
    if s.decode_tps > 0:
        return s.decode_full / s.decode_tps
    return 0.0


# --- per class -----------------------------------------------------------------------

@dataclass(frozen=True)
class ClassPrediction:
    """One class under one configuration (None: saturated)."""

    name: str
    ttft_p50_s: float | None
    tpot_p50_s: float | None
    meets: float                        # share of its requests meeting the SLO
    routes: dict[str, float]            # share by path (split, local, whole)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"class": self.name, "ttft_p50_s": self.ttft_p50_s, "tpot_p50_s": self.tpot_p50_s,
                "meets_slo": self.meets, "routes": self.routes}


def _quantile(branches: Sequence[Branch], q: float) -> float:
    """The ``q`` quantile of a class's TTFT over its branches (each base + its wait), by bisection."""
    def below(t: float) -> float:
        return sum(b.share * (1 - b.wait.exceeds(t - b.base_s)) for b in branches if t >= b.base_s)

    lo = min(b.base_s for b in branches)
    hi = max(b.base_s + (b.wait.mean_s / b.wait.p if b.wait.p > 0 else 0.0) * 50 for b in branches) + 1e-9
    for _ in range(100):
        mid = (lo + hi) / 2
        if below(mid) >= q:
            hi = mid
        else:
            lo = mid
    return hi


def _weighted_median(pairs: Sequence[tuple[float, float]]) -> float:
    total = sum(w for w, _ in pairs)
    acc = 0.0
    for w, v in sorted(pairs, key=lambda p: p[1]):
        acc += w
        if acc >= total / 2:
            return v
    return pairs[-1][1]


#: the most requests overlapping a decode counted by the Irwin-Hall sum (:func:`others_at_most`)
IRWIN_HALL_MAX = 12


def _irwin_hall_cdf(k: int, x: float) -> float:
    """P(the sum of ``k`` uniforms on [0, 1] <= x)."""
    if x <= 0:
        return 1.0 if k == 0 else 0.0
    if x >= k:
        return 1.0
    if k > IRWIN_HALL_MAX:                      # a normal, mean k/2, variance k/12
        return 0.5 * math.erfc(-(x - k / 2) / math.sqrt(k / 6))
    total = sum((1 if j % 2 == 0 else -1) * math.comb(k, j) * (x - j) ** k for j in range(math.floor(x) + 1))
    return min(max(total / math.factorial(k), 0.0), 1.0)


def others_at_most(running: float, x: float) -> float:
    """The chance that a decoding request shares its steps with at most ``x`` others on average over
    its decode, where ``running`` requests decode on the engine on average (Poisson arrivals). Taking
    every decode as long as its own (D): the others overlapping it are those arriving within D
    before or after its start, a Poisson count of mean 2 x running, each beside it for a share of
    its decode uniform on [0, 1]; so the time-averaged count is a sum of that many uniforms (mean
    ``running``, variance 2/3 x ``running``), not the count at its start (variance ``running``)."""
    if x < 0:
        return 0.0
    if running <= 0:
        return 1.0
    mean = 2 * running
    top = int(mean + 10 * math.sqrt(mean) + 10)
    pmf = _poisson(min(mean, 2 * IN_FLIGHT_CAP), top)
    return min(1.0, sum(q * _irwin_hall_cdf(k, x) for k, q in enumerate(pmf) if q > 1e-12))


def predict_class(m: Mix, branches: Sequence[Branch], slo: Objective | None) -> ClassPrediction:
    """TTFT p50, TPOT p50 and the share meeting ``slo`` of one (not saturated) class."""
    total = sum(b.share for b in branches) or 1.0
    routes: dict[str, float] = {}
    for b in branches:
        routes[str(b.option)] = routes.get(str(b.option), 0.0) + b.share / total
    norm = [replace(b, share=b.share / total) for b in branches]
    meets = 0.0
    for b in norm:
        bound = math.inf
        within = 1.0
        if slo is not None:
            if slo.tpot is not None:
                within = b.tpot_within(slo.tpot)
            if slo.ttft is not None:
                bound = slo.ttft
            if slo.e2el is not None:
                bound = min(bound, slo.e2el - max(m.output_tokens - 1, 0) * b.tpot_s)
        meets += b.share * within * (1.0 if math.isinf(bound) else
                                     0.0 if bound < b.base_s else 1 - b.wait.exceeds(bound - b.base_s))
    return ClassPrediction(m.name, _quantile(norm, 0.5), _weighted_median([(b.share, b.tpot_s) for b in norm]),
                           meets, routes)


# --- configurations ------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """A configuration of the topology's engines: whole on ``both`` (colocated, replicas), or a split
    ``prefill`` -> ``decode`` over ``link`` (static split, auto)."""

    kind: str
    label: str
    both: tuple[EngineModel, ...] = ()
    prefill: tuple[EngineModel, ...] = ()
    decode: tuple[EngineModel, ...] = ()
    link: LinkEstimate | None = None
    streaming_layers: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def hosts(self) -> tuple[str, ...]:
        """The hosts this layout uses, in order."""
        return tuple(dict.fromkeys(e.host for e in (*self.both, *self.prefill, *self.decode)))

    @property
    def ratio(self) -> str:
        """P:D in engines (split kinds), else ''."""
        return f"{len(self.prefill)}:{len(self.decode)}" if self.prefill else ""


def fixed_routes(layout: Layout, mix: Sequence[Mix]) -> Routes:
    """The routes of a configuration without a per-prompt choice: every request whole on the
    layout's engines, or every request split."""
    if layout.both:
        path = ServePath(Option.WHOLE if layout.kind == REPLICAS else Option.LOCAL, layout.both)
    else:
        path = ServePath(Option.SPLIT, layout.decode, layout.prefill, layout.link, layout.streaming_layers)
    return {m.name: [(1.0, path)] for m in mix}


def _router_cost(load: EngineLoad | None, engine: EngineModel, tokens: int) -> EngineCost:
    """The :class:`EngineCost` the proxy's router would hold for ``engine`` at ``load`` (capped where
    saturated, so that the choice still sees which path is less so)."""
    rate = tokens / engine.prefill.seconds(tokens)
    if load is None:
        return EngineCost(tokens_per_s=rate, tpot_s=engine.idle_step_s)
    wait = min(load.wait.mean_s, CAP_S)
    return EngineCost(tokens_per_s=rate, queued_tokens=wait * rate, running=round(min(load.running, CAP_S)),
                      waiting=round(load.prefill_rps * wait), tpot_s=min(load.tpot_s, CAP_S),
                      tpot_added_s=min(load.tpot_added_s, CAP_S))


def in_flight_mean(load: EngineLoad | None) -> float:
    """The mean count of requests an engine holds (the proxy's ``outstanding``): those decoding and
    those queued or prefilling (rate x their time there); 0 with no load."""
    if load is None:
        return 0.0
    return min((_finite(load.running) or 0.0) + (_finite(load.queue_share) or 0.0), IN_FLIGHT_CAP)


def whole_offered_chance(prefill: EngineModel, p_load: EngineLoad | None, decode: EngineModel,
                         d_load: EngineLoad | None, factor: float = WHOLE_TPOT_FACTOR) -> float:
    """The chance a prompt finds the router offering ``whole`` (its ``decode_load`` rule:
    :func:`disagg.proxy.policy.decodes_slower`): one more decode on the decode engine would be
    slower than ``factor`` x one more on the prefill engine, each engine's time per output token
    its line at the count it holds then (``fixed + n x`` what one more request adds), the counts
    Poisson of their means (:func:`in_flight_mean`), the engines independent. The router compares
    the counts a prompt finds, not their means: on the emulated house it served prompts whole
    almost only when the workstation held more requests than the gamer."""
    def line(e: EngineModel, load: EngineLoad | None) -> Callable[[int], float]:
        added = 0.0 if load is None else min(_finite(load.tpot_added_s) or 0.0, CAP_S)
        return lambda n: e.decode.fixed_s + n * added

    p_line, d_line = line(prefill, p_load), line(decode, d_load)
    p_mean, d_mean = in_flight_mean(p_load), in_flight_mean(d_load)
    top = _poisson_top(max(p_mean, d_mean))
    p_pmf, d_pmf = _poisson(p_mean, top), _poisson(d_mean, top)
    d_tail = list(accumulate(reversed(d_pmf)))[::-1]           # P(N_d >= n)
    total, n_d = 0.0, 0
    for n_p, pp in enumerate(p_pmf):        # the decode line grows with its count: the least n_d past it
        bar = factor * p_line(n_p + 1)
        while n_d <= top and d_line(n_d + 1) <= bar:
            n_d += 1
        if n_d > top:
            break
        total += pp * d_tail[n_d]
    return total


def solve_auto(layout: Layout, mix: Sequence[Mix], rate: float) -> Routes:
    """The auto routing's shares per class at ``rate``: each round every class takes, at the load
    the shares so far produce, the paths the router's arithmetic picks
    (:func:`disagg.routecost.option_costs` with the proxy's default stall weight): with ``whole``
    offered for the share of prompts that find its ``decode_load`` rule met
    (:func:`whole_offered_chance`), without it for the rest; and its shares move towards them by
    1/(round + 2): the average of the choices, which settles where no class would rather move (or
    splits a class between paths that cost it the same). Each side is seen through its first
    engine."""
    assert layout.link is not None
    paths = {Option.SPLIT: ServePath(Option.SPLIT, layout.decode, layout.prefill, layout.link, layout.streaming_layers),
             Option.LOCAL: ServePath(Option.LOCAL, layout.decode),
             Option.WHOLE: ServePath(Option.WHOLE, layout.prefill)}
    shares: dict[str, dict[Option, float]] = {m.name: {} for m in mix}
    p_engine, d_engine = layout.prefill[0], layout.decode[0]
    link_cost = layout.link.cost()
    outcome: Outcome | None = None
    for k in range(AUTO_ROUNDS):
        # the load this round's choices see, alike for every class
        p_load = outcome.loads.get(p_engine.name) if outcome else None
        d_load = outcome.loads.get(d_engine.name) if outcome else None
        in_transit = 0          # handoffs on the link at once: rho / (1 - rho), as in an M/M/1 queue
        if outcome is not None:
            busy = min(outcome.link_share, 0.999)
            in_transit = round(min(busy / (1 - busy), CAP_S))
        link = replace(link_cost, streaming_layers=layout.streaming_layers, in_transit=in_transit)
        offered = whole_offered_chance(p_engine, p_load, d_engine, d_load)
        for m in mix:
            p_cost = _router_cost(p_load, p_engine, m.prompt_tokens)
            d_cost = _router_cost(d_load, d_engine, m.prompt_tokens)
            target: dict[Option, float] = {}
            for whole, chance in ((True, offered), (False, 1 - offered)):
                if chance <= 0:
                    continue
                best = cheapest(option_costs(m.prompt_tokens, m.wire_bytes, p_cost, d_cost, link, whole=whole,
                                             stall_weight=STALL_WEIGHT, out_tokens=m.output_tokens)).path
                target[best] = target.get(best, 0.0) + chance
            step = 1.0 / (k + 2) if k else 1.0
            mine = shares[m.name]
            for o in list(mine):
                mine[o] *= 1 - step
            for o, w in target.items():
                mine[o] = mine.get(o, 0.0) + step * w
        routes = {m.name: [(s, paths[o]) for o, s in shares[m.name].items() if s > 1e-9] for m in mix}
        outcome = evaluate(mix, rate, routes)
    return {m.name: [(s, paths[o]) for o, s in shares[m.name].items() if s > 1e-9] for m in mix}


@dataclass(frozen=True)
class ConfigPrediction:
    """One configuration at the workload's rate."""

    layout: Layout
    classes: tuple[ClassPrediction, ...]
    goodput_rps: float
    saturated: tuple[str, ...]
    saturates_at_rps: float | None      # None: not within MAX_RATE
    loads: tuple[EngineLoad, ...]
    link_share: float

    def to_json(self) -> dict[str, Any]:
        """JSON-ready."""
        lay = self.layout
        return {"kind": lay.kind, "label": lay.label, "hosts": list(lay.hosts),
                "prefill_engines": [e.name for e in lay.prefill], "decode_engines": [e.name for e in lay.decode],
                "engines": [e.name for e in lay.both], "ratio": lay.ratio or None,
                "goodput_rps": self.goodput_rps, "saturated": list(self.saturated) or None,
                "saturates_at_rps": self.saturates_at_rps, "link_share": self.link_share,
                "classes": [c.to_json() for c in self.classes], "loads": [ld.to_json() for ld in self.loads]}


def routes_for(layout: Layout, mix: Sequence[Mix], rate: float) -> Routes:
    """The routes ``layout`` takes at ``rate`` (auto: :func:`solve_auto`)."""
    return solve_auto(layout, mix, rate) if layout.kind == AUTO else fixed_routes(layout, mix)


def predict_classes(mix: Sequence[Mix], outcome: Outcome, slo: Objective | None) -> tuple[ClassPrediction, ...]:
    """Every class's figures in ``outcome`` (none, and no share meeting ``slo``, where it saturates)."""
    if outcome.saturated:
        return tuple(ClassPrediction(m.name, None, None, 0.0, _route_shares(outcome, m)) for m in mix)
    return tuple(predict_class(m, outcome.branches[m.name], slo) for m in mix)


def goodput_rps(mix: Sequence[Mix], classes: Sequence[ClassPrediction], rate: float) -> float:
    """Requests per second meeting the objective: ``rate`` times each class's share and share meeting it."""
    return rate * sum(m.share * c.meets for m, c in zip(mix, classes, strict=True))


def predict(layout: Layout, mix: Sequence[Mix], rate: float, slo: Objective | None) -> ConfigPrediction:
    """Every class's figures and the goodput of ``layout`` at ``rate``, and the rate it saturates at."""
    outcome = evaluate(mix, rate, routes_for(layout, mix, rate))
    classes = predict_classes(mix, outcome, slo)
    return ConfigPrediction(layout, classes, goodput_rps(mix, classes, rate), outcome.saturated,
                            saturation_rate(layout, mix), tuple(outcome.loads.values()), outcome.link_share)


def _route_shares(outcome: Outcome, m: Mix) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in outcome.branches[m.name]:
        out[str(b.option)] = out.get(str(b.option), 0.0) + b.share
    return out


def saturation_rate(layout: Layout, mix: Sequence[Mix]) -> float | None:
    """The highest rate ``layout`` sustains (requests per second, to 0.1%), or None beyond MAX_RATE."""
    def saturated(rate: float) -> bool:
        return bool(evaluate(mix, rate, routes_for(layout, mix, rate)).saturated)

    lo, hi = 0.0, 1.0
    while not saturated(hi):
        lo, hi = hi, hi * 2
        if hi > MAX_RATE:
            return None
    while hi - lo > max(lo, 1e-6) * 1e-3:
        mid = (lo + hi) / 2
        if saturated(mid):
            hi = mid
        else:
            lo = mid
    return lo


# --- the recommendation --------------------------------------------------------------

@dataclass(frozen=True)
class Recommendation:
    """The one answer: which configuration, which host prefills, and the figures that decide it."""

    config: ConfigPrediction
    text: str
    prefill_hosts: tuple[str, ...]      # of the best split configuration (empty: no split sustains)
    decode_hosts: tuple[str, ...]
    prefill_warning: str | None         # the topology's prefill host prefills slower

    def to_json(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"kind": self.config.layout.kind, "label": self.config.layout.label, "text": self.text,
                "goodput_rps": self.config.goodput_rps, "saturates_at_rps": self.config.saturates_at_rps,
                "prefill_hosts": list(self.prefill_hosts), "decode_hosts": list(self.decode_hosts),
                "ratio": self.config.layout.ratio or None, "prefill_warning": self.prefill_warning}


def _rank(c: ConfigPrediction, rate: float) -> tuple[float, float, int]:
    good = round(c.goodput_rps / (rate * TIE_SHARE)) if rate > 0 else 0
    return (good, c.saturates_at_rps if c.saturates_at_rps is not None else MAX_RATE, -KINDS.index(c.layout.kind))


def _fmt_rps(x: float | None) -> str:
    return "beyond 1e6 req/s" if x is None else f"{x:.3g} req/s"


def recommend(configs: Sequence[ConfigPrediction], rate: float, topo_prefill_hosts: Sequence[str],
              prefill_rates: dict[str, float]) -> Recommendation:
    """The configuration with the most goodput at ``rate`` (goodputs within TIE_SHARE of the rate are
    a tie, broken by the higher saturation rate, then by the simpler kind: one box, replicas, split,
    auto), with the figures that decide it: its goodput and saturation rate beside the best of
    every other kind. Which host should prefill: the prefill side of the best split configuration;
    where the topology's prefill host prefills slower than another host (``prefill_rates``, tokens
    per second at 2,048 tokens), a warning says so."""
    best = max(configs, key=lambda c: _rank(c, rate))
    lay = best.layout
    if lay.kind == COLOCATED:
        what = f"one box: {lay.label} ({len(lay.both)} engine{'' if len(lay.both) == 1 else 's'})"
    elif lay.kind == REPLICAS:
        what = f"replicas: every host serves whole requests ({', '.join(lay.hosts)})"
    else:
        pre = ", ".join(dict.fromkeys(e.host for e in lay.prefill))
        dec = ", ".join(dict.fromkeys(e.host for e in lay.decode))
        what = (f"split: {pre} prefill{'s' if len(lay.prefill) == 1 else ''}, {dec} decode"
                f"{'s' if len(lay.decode) == 1 else ''} (P:D {lay.ratio}), routing "
                f"{'auto' if lay.kind == AUTO else 'split (static)'}")
    others = []
    for kind in KINDS:
        rivals = [c for c in configs if c.layout.kind == kind and c is not best]
        if rivals:
            r = max(rivals, key=lambda c: _rank(c, rate))
            others.append(f"{r.layout.label} {r.goodput_rps:.3g} req/s (saturates at {_fmt_rps(r.saturates_at_rps)})")
    pct = best.goodput_rps / rate if rate > 0 else 0.0
    beside = f"; beside {'; '.join(others)}" if others else ""
    if best.goodput_rps > 0:
        text = (f"Recommendation: {what}. Goodput {best.goodput_rps:.3g} req/s of {rate:g} ({pct:.0%}), saturates "
                f"at {_fmt_rps(best.saturates_at_rps)}{beside}.")
    else:
        text = (f"Recommendation: no configuration meets the SLO at {rate:g} req/s (each saturates or misses it); "
                f"the one that sustains the most: {what}, saturates at {_fmt_rps(best.saturates_at_rps)}{beside}.")
    splits = [c for c in configs if c.layout.kind in (SPLIT, AUTO)]
    p_hosts: tuple[str, ...] = ()
    d_hosts: tuple[str, ...] = ()
    if splits:
        top = max(splits, key=lambda c: _rank(c, rate))
        p_hosts = tuple(dict.fromkeys(e.host for e in top.layout.prefill))
        d_hosts = tuple(dict.fromkeys(e.host for e in top.layout.decode))
    warning = None
    slow = [h for h in topo_prefill_hosts
            if any(prefill_rates[o] > prefill_rates[h] for o in prefill_rates if o not in topo_prefill_hosts)]
    if slow:
        fast = max((o for o in prefill_rates if o not in topo_prefill_hosts), key=lambda o: prefill_rates[o])
        warning = (f"The topology has {', '.join(slow)} prefilling, the slower host at prefill: "
                   + ", ".join(f"{h} {fmt_count(round(prefill_rates[h]))}" for h in slow)
                   + f" against {fast} {fmt_count(round(prefill_rates[fast]))} tokens/s at 2,048 tokens.")
    return Recommendation(best, text, p_hosts, d_hosts, warning)


# --- from a topology -----------------------------------------------------------------

@dataclass(frozen=True)
class WorkloadPlan:
    """Everything ``disagg plan --classes/--trace`` prints."""

    topology: str
    model: ModelArch
    kv_dtype: str
    rate: float
    mix: tuple[Mix, ...]
    slo: dict[str, float]
    engines: tuple[EngineModel, ...]    # as the topology runs them (its KV connector): split and auto
    plain_engines: tuple[EngineModel, ...]  # without a KV connector: colocated and replicas
    configs: tuple[ConfigPrediction, ...]
    recommendation: Recommendation
    handoff: LinkEstimate
    handoff_source: str
    notes: tuple[str, ...] = ()
    workload_source: str = ""
    kv_binds: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        """JSON-ready: the workload, every engine, every configuration per class, the recommendation."""
        return {
            "topology": self.topology, "model": self.model.name, "kv_dtype": self.kv_dtype,
            "workload": {"rate_rps": self.rate, "source": self.workload_source,
                         "classes": [{"name": m.name, "prompt_tokens": m.prompt_tokens,
                                      "output_tokens": m.output_tokens, "share": m.share,
                                      "kv_bytes": m.kv_full_bytes, "wire_bytes": m.wire_bytes} for m in self.mix]},
            "slo": self.slo,
            "engines": [_engine_json(e) for e in self.engines],
            "plain_engines": [_engine_json(e) for e in self.plain_engines],
            "handoff": {"fixed_s": self.handoff.fixed_s, "bytes_per_s": self.handoff.bytes_per_s,
                        "source": self.handoff_source, "link": self.handoff.label},
            "configurations": [c.to_json() for c in self.configs],
            "recommendation": self.recommendation.to_json(),
            "kv_binds": list(self.kv_binds),
            "notes": list(self.notes),
        }


def _engine_json(e: EngineModel) -> dict[str, Any]:
    return {"engine": e.name, "host": e.host, "connector": e.connector, "prefill_estimated": e.prefill.estimated,
            "prefill_source": e.prefill.label, "prefill_tokens_per_s_at_2048": e.prefill.rate(),
            "decode_idle_step_s": e.idle_step_s, "decode_s_per_kv_byte": e.decode.per_kv_byte_s,
            "decode_bytes_per_s": _finite(e.memory_bytes_per_s), "decode_measured": e.decode.measured,
            "decode_source": e.decode_source, "kv_capacity_bytes": e.kv_capacity_bytes, "kv_source": e.kv_source}


def engine_decode(topo: Topology, arch: ModelArch, inst: InstanceSpec, notes: list[str], run_dir: str | None = None,
                  connector: str = NO_CONNECTOR) -> DecodeLine:
    """The decode step of ``inst``'s engine running ``connector`` (:func:`disagg.planning.engine_connector`):
    the one ``disagg bench prefill`` or ``bench compare`` measured on its host for the topology's
    served model and ``model.dtype`` (:func:`disagg.measurements.lookup_decode`; one of another kind
    of engine of that host, labelled so, where none of this kind is stored), else an estimate from
    a memory rate (:meth:`disagg.routecost.DecodeLine.from_memory_rate`): a GPU's spec-sheet
    bandwidth x its GPUs, a CPU engine's :data:`FIRST_STEP_CPU_BYTES_PER_S` per core it is pinned
    to (an unpinned one: one core, noted), at most its share of an emulated host's ``cpu_share``."""
    from disagg.engines.vllm import served_model_name

    host = topo.host_of(inst)
    found = lookup_decode(run_dir or topo.run_dir, served_model_name(topo), host.name, topo.model.dtype, connector)
    if found is not None:
        other = ("" if found.connector in (connector, "") else
                 f"; measured on {engine_words(found.connector)}, none stored for {engine_words(connector)}")
        return DecodeLine(found.fixed_s, found.per_kv_byte_s,
                          f"measured on {host.name} {found.date}: {fmt_seconds(found.fixed_s)} + "
                          f"{fmt_seconds(found.per_kv_byte_s * 1e9)} per GB of context KV ({found.source}{other})",
                          measured=True)
    weights = model_weight_bytes(topo, arch, arch.active_params)
    if host.device == "cpu":
        cores = float(len(inst.cpus)) if inst.cpus else 1.0
        why = f"{len(inst.cpus)} pinned core(s)" if inst.cpus else "not pinned: taken as one core"
        if not inst.cpus:
            notes.append(f"{inst.name} on {host.name} is not pinned to cores (cpus:): its decode is priced "
                         "as one core's")
        if host.emulate is not None and host.emulate.cpu_share is not None:
            on_host = sum(1 for i in topo.instances if i.host == host.name)
            if host.emulate.cpu_share / on_host < cores:
                cores = host.emulate.cpu_share / on_host
                why = f"emulate.cpu_share {host.emulate.cpu_share:g} over {on_host} engine(s)"
        return DecodeLine.from_memory_rate(
            weights, FIRST_STEP_CPU_BYTES_PER_S * cores,
            f"ESTIMATE: {FIRST_STEP_CPU_SOURCE}; x {cores:g} ({why}); {MEASURE_DECODE}")
    spec = host_device(host)
    if spec is None or spec.memory_gbps is None:
        raise PlanError(f"{topo.file}: hosts.{host.name}: its memory bandwidth is unknown, so its decode cannot "
                        "be priced; give gpu: a known device or {tflops, memory_gb, memory_bw_gbs}, or measure "
                        f"its decode step: {MEASURE_HINT.format(file=topo.file)}")
    gpus = max(1, len(inst.gpus))
    return DecodeLine.from_memory_rate(
        weights, spec.memory_gbps * 1e9 * gpus,
        f"ESTIMATE: {'' if gpus == 1 else f'{gpus} x '}{spec.label}'s spec-sheet {spec.memory_gbps:g} GB/s; "
        f"{MEASURE_DECODE}")


#: what an estimated decode step's source ends with
MEASURE_DECODE = "`disagg bench prefill` measures it"


def receipt_factor(device: str, pinned_cores: int) -> float:
    """How many times longer a handoff into an engine takes while the engine decodes: on a CPU engine
    pinned to ``n`` cores its step loop keeps them busy and the connector's receiving thread (the
    socket connector's reader, UCX's progress thread) takes its turn beside them, so the handoff
    gets ``n / (n + 1)`` of the cores it had idle: ``(n + 1) / n`` (2 on one core). It stretches the
    whole handoff as measured (fixed cost, exposed transfer, first step), not only its part on the
    engine: on the emulated house's one-core workstation a 256-token split took 99-118 ms with
    nothing decoding there and about 150-195 ms with one or more decoding, about the idle handoff
    twice plus the join and half a step (:meth:`EngineLoad.handed_step`). A GPU engine's receipt
    is the NIC's and the GPU's copy (1), an unpinned CPU engine's is not known (1)."""
    if device != "cpu" or pinned_cores <= 0:
        return 1.0
    return (pinned_cores + 1) / pinned_cores


def _engines(topo: Topology, arch: ModelArch, run_dir: str | None, notes: list[str],
             plain: bool) -> list[EngineModel]:
    """Every instance of ``topo`` as an engine of the model, with the measurements of its kind:
    ``plain``, as a colocated topology runs it (no KV connector: the colocated and replica
    configurations), else with its own connector (the split and auto ones)."""
    out: list[EngineModel] = []
    prefills: dict[tuple[str, str], PrefillEstimate] = {}
    for inst in topo.instances:
        host = topo.host_of(inst)
        kind = NO_CONNECTOR if plain else engine_connector(topo, inst)
        if (host.name, kind) not in prefills:
            prefills[(host.name, kind)] = host_prefill(topo, arch, host, run_dir, connector=kind)
        decode = engine_decode(topo, arch, inst, notes, run_dir, kind)
        mem = engine_memory(topo, arch, inst)
        out.append(EngineModel(inst.name, host.name, prefills[(host.name, kind)], decode, mem.kv_bytes, mem.label,
                               kind, receipt_factor(host.device, len(inst.cpus))))
    return out


def make_mix(classes: Sequence[WorkClass], arch: ModelArch, kv_dtype: str, wire_ratio: float,
             max_model_len: int | None) -> tuple[Mix, ...]:
    """The model's view of ``classes``: shares from their weights, KV sizes in ``kv_dtype``. A class
    longer than ``max_model_len`` (prompt + output) is a PlanError, as vLLM refuses it."""
    total = sum(c.weight for c in classes)
    out = []
    for c in classes:
        if max_model_len is not None and c.input_len + c.output_len > max_model_len:
            raise PlanError(f"class {c.name}: {fmt_count(c.input_len)} + {fmt_count(c.output_len)} tokens is longer "
                            f"than the topology's max_model_len ({fmt_count(max_model_len)}); vLLM refuses it")
        out.append(Mix(c.name, c.input_len, c.output_len, c.weight / total,
                       float(arch.kv_bytes(c.input_len + c.output_len, kv_dtype)),
                       float(arch.kv_bytes(c.input_len + c.output_len // 2, kv_dtype)),
                       float(arch.kv_bytes(c.input_len, kv_dtype)),
                       arch.kv_bytes(c.input_len, kv_dtype) * wire_ratio))
    return tuple(out)


def assignments(topo: Topology, engines: Sequence[EngineModel]) -> list[tuple[tuple[EngineModel, ...],
                                                                               tuple[EngineModel, ...]]]:
    """Every (prefill side, decode side) split of the hosts' engines, the topology's own first: with
    one host, its prefill and decode engines as the topology gives them; with more, every way to put
    whole hosts on either side (2^hosts - 2)."""
    by_name = {e.name: e for e in engines}
    own = (tuple(by_name[i.name] for i in topo.role("prefill")), tuple(by_name[i.name] for i in topo.role("decode")))
    hosts = list(dict.fromkeys(e.host for e in engines))
    out = [own]
    if len(hosts) > 1:
        for k in range(1, len(hosts)):
            for side in combinations(hosts, k):
                pre = tuple(e for e in engines if e.host in side)
                dec = tuple(e for e in engines if e.host not in side)
                if (pre, dec) != own:
                    out.append((pre, dec))
    return out


def plan_workload(topo: Topology, classes: Sequence[WorkClass], rate: float, slo: Objective | None = None, *,
                  model: str | None = None, link_class: str | None = None, kv_dtype: str | None = None,
                  use_probe: bool = True, run_dir: str | None = None, wire_format: str | None = None,
                  streaming: bool | None = None, workload_source: str = "",
                  split_plan: Callable[..., Plan] = plan_topology) -> WorkloadPlan:
    """The workload plan of a split topology (see the module doc). The link, the handoff and the
    KV dtype of each split come from :func:`disagg.planning.plan_topology` for that direction (with
    the same what-if overrides); every engine's prefill rate from :func:`disagg.planning.host_prefill`
    (an emulated host without a measurement: a PlanError saying how to measure it)."""
    if rate <= 0 or not math.isfinite(rate):
        raise PlanError(f"--rate must be a positive number of requests per second, got {rate}")
    if not classes:
        raise PlanError("the workload needs at least one class")
    first_pair(topo)                    # a split topology
    arch = resolve_model(model or topo.model.source, local_path=None if model else topo.model.path)
    notes: list[str] = []
    engines = _engines(topo, arch, run_dir, notes, plain=False)
    plain = _engines(topo, arch, run_dir, notes, plain=True)
    layouts: list[Layout] = []
    hosts = list(dict.fromkeys(e.host for e in engines))
    for h in hosts:
        mine = tuple(e for e in plain if e.host == h)
        layouts.append(Layout(COLOCATED, f"colocated on {h}", both=mine))
    if len(hosts) > 1:
        layouts.append(Layout(REPLICAS, "replicas (" + ", ".join(hosts) + ")", both=tuple(plain)))
    base: Plan | None = None
    for pre, dec in assignments(topo, engines):
        by_inst = {i.name: i for i in topo.instances}
        plan = split_plan(topo, [], 0, model=model, link_class=link_class, kv_dtype=kv_dtype, use_probe=use_probe,
                          run_dir=run_dir, wire_format=wire_format, streaming=streaming,
                          pair=(by_inst[pre[0].name], by_inst[dec[0].name]))
        base = base or plan
        name = " + ".join(dict.fromkeys(e.host for e in pre)) + " -> " + " + ".join(dict.fromkeys(e.host for e in dec))
        for kind in (SPLIT, AUTO):
            layouts.append(Layout(kind, f"{kind} {name}", prefill=pre, decode=dec, link=plan.link,
                                  streaming_layers=plan.streaming_layers))
    assert base is not None
    dtype = base.kv_dtype
    wire = base.wire_bytes_per_token / arch.kv_bytes_per_token(dtype)
    mix = make_mix(classes, arch, dtype, wire, topo.model.max_model_len)
    configs = tuple(predict(lay, mix, rate, slo) for lay in layouts)
    own_prefill = tuple(dict.fromkeys(topo.host_of(i).name for i in topo.role("prefill")))
    rates = {e.host: e.prefill.rate() for e in plain}
    rec = recommend(configs, rate, own_prefill if len(hosts) > 1 else (), rates)
    binds = []
    for e in engines:
        if e.kv_capacity_bytes is None:
            continue
        worst = max(mix, key=lambda m: m.kv_full_bytes)
        per = sum(m.share * m.kv_full_bytes for m in mix)
        binds.append(f"KV binds: {e.name} on {e.host}: at most {fmt_count(int(e.kv_capacity_bytes // per))} "
                     f"requests of the mix at once ({fmt_count(int(e.kv_capacity_bytes // worst.kv_full_bytes))} "
                     f"of {worst.name}; {e.kv_source})")
    slo_dict = {} if slo is None else {k: v for k in ("ttft", "tpot", "e2el") if (v := getattr(slo, k)) is not None}
    return WorkloadPlan(topology=topo.file, model=arch, kv_dtype=dtype, rate=rate, mix=mix, slo=slo_dict,
                        engines=tuple(engines), plain_engines=tuple(plain), configs=configs, recommendation=rec,
                        handoff=base.link,
                        handoff_source=base.fixed_source or "the proxy's second request, assumed",
                        notes=tuple(dict.fromkeys([*notes, *base.notes])),
                        workload_source=workload_source, kv_binds=tuple(binds))


def describe_model() -> str:
    """The model's statement, printed under every workload plan."""
    return ("Model: Poisson arrivals; per engine an M/G/1 prefill queue (prefill first), its wait taken as "
            "P(wait > t) = rho exp(-t rho / mean wait); on an engine that is decoding a new request joins the "
            "running batch (half a step in progress, its own step reading the batch's KV; a handed-over one half "
            "a step more, and on a CPU engine its receipt shares the engine's cores); a prompt waits for "
            "room in a KV cache the running requests fill (Poisson counts) until one ends, holding the queue; "
            "a pool sends each request to the engine with the fewest in flight; a split adds the handoff "
            "(fixed + transfer + decode's first step) and the link's own M/G/1 wait; TPOT = idle step / "
            "(1 - prefill share - decode tokens/s x KV read per request per step) "
            "(routecost.tpot_with_prefills_s), each request's spread with the requests decoding beside it; a "
            "configuration saturates where an engine's prefills or decode reads take all its time, its "
            "requests' KV reaches its capacity, its prompts' waits for room hold its queue all the time, or "
            "the link's transfers take all its time (goodput 0). auto: the router's own costs "
            f"(routecost.option_costs, stall weight {STALL_WEIGHT:g}) at the load its choices make, whole offered "
            "to the prompts that find the decode engine holding enough more to decode slower (Poisson counts). "
            "Not modelled: "
            "preemption, prefix cache, the proxy's exploration; figures near saturation are the roughest.")


def fmt_tpot(x: float | None) -> str:
    """A TPOT or TTFT cell (``-`` when saturated)."""
    return "-" if x is None else fmt_seconds(x)

"""The per-prompt routing decision: split, local or whole.

:func:`decide` is a pure function of one prompt's length and KV size, the
candidate engines with their predicted costs (:class:`~disagg.routecost.EngineCost`,
from :class:`~disagg.proxy.measure.Measurements`) and the handoff cost per
prefill -> decode pair; it returns a :class:`Decision` naming the path, the
engines and the predicted TTFT. :func:`disagg.proxy.app._route` calls it for
every route that :func:`~disagg.proxy.routes.plan_request` left free to split
(correctness reasons to stay local always win) and writes the decision into the
route before anything is sent.

Policies (``routing.policy`` in the topology, ``--routing-policy``):

- ``split``: every free route splits (the engines are left to the handoff's own pick);
- ``local``: every route goes to a decode engine, which prefills it;
- ``auto``: the option with the lowest score (:func:`disagg.routecost.option_costs`:
  predicted TTFT, plus the stall a prefill imposes on the decodes running on the
  engine that computes it and what it holds up the prompts that will queue behind it
  there (:func:`disagg.routecost.held_up_s`), plus the decode work the request places on the engine
  that decodes it: :func:`disagg.routecost.decode_s`, its expected output tokens at
  that engine's time per output token, and what it adds to the decodes running
  there). ``whole`` is an option only where the connector allows
  it (``RoutingConfig.whole``), and without an SLO only while the decode side is the
  bottleneck, by either of two rules (with an SLO, wherever the connector allows it: below):

  - ``decode_backlog``: the prefill engine has nothing in flight (nothing running,
    no prefill waiting) and every decode engine has prefills waiting;
  - ``decode_load``: one more decode would run slower on every decode engine than
    on the prefill engine, by more than :data:`~disagg.serving.WHOLE_TPOT_FACTOR`
    (``EngineCost.tpot_s``: each engine's time per output token as a line in its
    requests in flight, measured from the streams the proxy relays), whatever the
    prefill engine has queued: ``whole`` then competes on its score, which counts
    that queue as a split through the same engine does. Past saturation the decode
    engines' decodes are what limits goodput, and only ``whole`` moves decode work
    to the prefill side: static split's decodes ran at TPOT 92 ms on a one-core
    decode engine where two replicas ran at 50 ms (a 2-core CPU machine). As the prefill
    engine takes decodes its own line rises and the rule stops offering it, so the
    decodes balance between the sides. This rule once also required the prefill
    engine to have no prefill waiting; past saturation it always had one (the
    splits' prefills), so ``whole`` was next to never offered: at 3 requests/s
    on a 2-core machine the decode engine ran 17-38 requests at a predicted 170-500
    ms per output token while the prefill engine ran 3-6 at 90-120 ms, and one
    repeat's goodput collapsed to 5 good requests of 120.

Exploration (``auto`` only). A path the policy judges slow gets no prompts,
so its estimate never updates: one bad sample could keep a split off for good.
:func:`decide` takes a ``stale`` predicate (the router's :class:`Explorer`):
when the cheapest option is chosen, every other ``split`` / ``local`` option,
over every pair of healthy engines (not only each path's best pair: a pair
whose link or engine is judged slow needs its samples too), whose score
without its decode work is within :data:`EXPLORE_WITHIN` x the cheapest's
(the decode work is alike for split and local on one decode engine, and would
loosen the factor's bound on the first token), whose decode work is within
the same factor of the cheapest's (another decode engine may be far busier),
and whose (path, engines) is
stale is considered, cheapest first, and the first one goes instead, with
reason ``explore``. :class:`Explorer` calls a (path, engines)
stale when it has not been taken for :data:`EXPLORE_AFTER_S` seconds *and*
:data:`EXPLORE_AFTER_DECISIONS` auto decisions (both, so the rate is bounded
under light and heavy load alike); taking it, by choice or to explore, makes it
fresh again. ``whole`` is never explored (its estimate is the prefill engine's, which
splits measure, and without an SLO it is a relief for a backed-up decode side), nor is
anything the options do not offer: exploration only ever picks among the
healthy engines' options, and never under the ``split`` / ``local`` policies or
the ``no_prefill`` / ``no_decode`` fallbacks.

Its cost: every path returns the same answer, so an explored prompt only
waits longer, by at most its best predicted TTFT once more (the 2x bound, as
predicted: the point is that the prediction may be wrong, most often too
pessimistic). Its rate: one prompt per stale (path, engines) per 60 s and per
50 decisions; with one prefill -> decode pair only one other path exists at a
time, so at most one prompt in 50 (2%) and one a minute, and mean TTFT rises
by at most about 2% (much less at any load above one prompt a second). With
P prefill and D decode engines there are up to P x D + D - 1 other options,
each explored at that rate at most (only those within the factor). The
bounds are options (``routing.explore``; defaults in :mod:`disagg.serving`).

With an SLO (``routing.slo`` in the topology, ``--route-slo-ttft`` / ``--route-slo-tpot``),
``auto`` chooses, among the same options over every pair of healthy engines, the one that
maximises the number of requests expected to meet both objectives
(:func:`disagg.routecost.slo_value`): this prompt's chance to meet its TTFT objective (its
predicted TTFT) and its TPOT objective (the decode line of the engine that will decode it),
less the running decodes expected to miss their TPOT objective because of it (its prefill's
stall on the engine that computes it, one more request in the batch of the engine that
decodes it; :func:`disagg.routecost.running_harm`: a decode whose stream the router follows,
``EngineCost.decodes``, is judged by the time per token it may still spend, so one that has
missed already or has time to spare is not harmed). Chances come from a distribution, not a
safety margin: the observed value is the prediction times a log-normal error of the typical
size the proxy has measured of its own predictions so far (``disagg_route_ttft_error_ratio``,
``disagg_route_tpot_error_ratio``; :data:`~disagg.routecost.DEFAULT_PREDICTION_ERROR` before
any). When no option gives this prompt an even chance, the count no longer tells the options
apart: the running decodes an option would push past the objective may be past it already (a
saturated engine whose queued prompts raise its decode line above the objective harms nobody
by that count, so every hopeless prompt looked free there: on the emulated house at 1-1.5
requests/s, 51-69% of the prompts went to prefill on the slow host, behind a queue of 24-37 s).
The score above decides then, as without an SLO: its own predicted TTFT plus the delay it
imposes on the others (the decodes it stalls, the prompts it holds up, its decode work); the
running decodes are not judged at all then (:func:`decide` takes each option's own chance first).
Otherwise, options within :data:`SLO_TIE` of the best count go by the score above. An engine
without a decode line yet (nothing streamed through it) is judged by TTFT alone and harms
nobody. ``whole`` is offered on every prefill engine wherever the connector allows it, not only
by the two rules: the count weighs what serving it whole does (its own TPOT on the prefill
engine's line, the decodes there it joins), and the rules kept it from the prefill engine until
the decode side was far behind, so on engines alike the 1P1D could not serve as the pool of two
that meets the most objectives (docs/results.md). Exploration is unchanged.

Reasons (the ``reason`` label of ``disagg_route_total``): ``policy`` for the
static policies, ``predicted`` for an ``auto`` choice, ``explore`` for an
``auto`` exploration, ``decode_backlog`` / ``decode_load`` for ``whole``, and ``no_prefill`` /
``no_decode`` when a pool has no healthy engine; with an SLO, ``slo`` for a choice that gives
the prompt at least an even chance of meeting it, ``slo_missed`` for one that does not (the
option that harms the others least by the count, or, where none gives it an even chance, by
the score).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from disagg.routecost import (
    DEFAULT_PREDICTION_ERROR,
    LOCAL,
    SPLIT,
    WHOLE,
    EngineCost,
    LinkCost,
    Option,
    OptionCost,
    ServiceObjective,
    SloValue,
    chance_within,
    cheapest,
    newcomer_chance,
    option_costs,
    running_slack,
    score_order,
    slo_value,
)
from disagg.serving import EXPLORE_AFTER_DECISIONS, EXPLORE_AFTER_S, EXPLORE_WITHIN, WHOLE_TPOT_FACTOR

E = TypeVar("E")

#: with an SLO, options whose expected requests meeting it are this close count as equal
SLO_TIE = 0.01


@dataclass(slots=True)
class Candidate(Generic[E]):
    """One healthy engine (``engine``: the proxy's Backend, or anything in tests) and its costs.
    (Not frozen, like :class:`~disagg.routecost.EngineCost`: built per engine for every decision.)"""

    engine: E
    cost: EngineCost


@dataclass(slots=True)
class Decision(Generic[E]):
    """Where one prompt goes: the path, why, the engines, and the prediction behind it. (Not
    frozen: one per decision, read once by the router.)"""

    path: Option
    reason: str
    prefill: E | None
    decode: E | None
    predicted_s: float | None
    options: tuple[OptionCost, ...] = ()
    #: with an SLO: the request's predicted time per output token where it will decode (None:
    #: no SLO, or that engine has no decode line yet)
    predicted_tpot_s: float | None = None


def decide(policy: str, tokens: float, kv_bytes: float, prefills: Sequence[Candidate[E]],
           decodes: Sequence[Candidate[E]], link: Callable[[E, E], LinkCost], *, whole: bool = False,
           local: bool = True, stall_weight: float = 1.0,
           stale: Callable[[Option, E | None, E], bool] | None = None,
           explore_within: float = EXPLORE_WITHIN, whole_tpot_factor: float = WHOLE_TPOT_FACTOR,
           out_tokens: float = 0.0, slo: ServiceObjective | None = None,
           ttft_error: float = DEFAULT_PREDICTION_ERROR, tpot_error: float = DEFAULT_PREDICTION_ERROR,
           slo_out_tokens: float | None = None) -> Decision[E]:
    """The route of one prompt (see the module doc). ``local`` false: decode engines cannot serve
    alone (SGLang), so only ``split`` remains. ``stale(path, prefill engine or None, decode engine)``:
    whether that option is due to be explored (None: never explore). ``out_tokens``: the output
    tokens the request is expected to decode (0: its decode work is not priced). ``slo``: choose
    by the requests expected to meet it (module doc, "With an SLO"), judged with the measured
    relative prediction errors ``ttft_error`` and ``tpot_error``, the running decodes expected
    to decode ``slo_out_tokens`` (default ``out_tokens``) each."""
    if policy == "split" or not local:
        return Decision(SPLIT, "policy", None, None, None)
    if not decodes:
        if whole and prefills:
            best = min(prefills, key=lambda c: c.cost.ttft_s(tokens))
            return Decision(WHOLE, "no_decode", best.engine, None, best.cost.ttft_s(tokens))
        return Decision(SPLIT, "no_decode", None, None, None)
    if policy == "local" or not prefills:
        best_d = min(decodes, key=lambda c: c.cost.ttft_s(tokens))
        return Decision(LOCAL, "policy" if policy == "local" else "no_prefill", None, best_d.engine,
                        best_d.cost.ttft_s(tokens))
    per_path: dict[Option, tuple[OptionCost, Candidate[E], Candidate[E]]] = {}
    every: list[tuple[OptionCost, Candidate[E], Candidate[E]]] = []
    whole_reason: dict[int, str] = {}        # per prefill candidate offered ``whole``: by which rule
    # the decode work is priced for every option of the decision or for none: an engine without
    # a decode line would otherwise look free beside one that has it
    unmeasured = False
    decode_costs = []
    for c in decodes:
        decode_costs.append(c.cost)
        unmeasured = unmeasured or c.cost.tpot_s is None
    if whole:
        backlog = all([d.waiting > 0 for d in decode_costs])
        for p in prefills:
            if backlog and p.cost.running == 0 and p.cost.waiting == 0:
                whole_reason[id(p)] = "decode_backlog"
            elif decodes_slower(p.cost, decode_costs, whole_tpot_factor):
                whole_reason[id(p)] = "decode_load"
            elif slo is not None:     # the count judges whole like the other options (module doc)
                whole_reason[id(p)] = "slo"
            else:
                continue
            unmeasured = unmeasured or p.cost.tpot_s is None
    if unmeasured:
        out_tokens = 0.0
    for p in prefills:
        for d in decodes:
            for opt in option_costs(tokens, kv_bytes, p.cost, d.cost, link(p.engine, d.engine),
                                    whole=id(p) in whole_reason, stall_weight=stall_weight,
                                    out_tokens=out_tokens):
                every.append((opt, p, d))
                held = per_path.get(opt.path)
                if held is None or opt.score_s < held[0].score_s:
                    per_path[opt.path] = (opt, p, d)
    options = tuple([v[0] for v in per_path.values()])
    opt = cheapest(options)
    _, p, d = per_path[opt.path]
    reason = "predicted"
    tpot: float | None = None
    if slo is not None:
        ttft_chance = chance_within(slo.ttft_s, ttft_error)
        # this prompt's own chance first: where no option gives it an even chance, the count no
        # longer tells them apart (the decodes an option would harm may be lost already), so the
        # score decides (module doc), and the running decodes need not be judged at all
        newcomer = {id(c): newcomer_chance(c.cost, slo, tpot_error) for c in (*prefills, *decodes)}
        owns = [ttft_chance(o.ttft_s) * newcomer[id(_decodes_on(o.path, op, od))] for o, op, od in every]
        best_own = -math.inf
        for own in owns:
            if own > best_own:
                best_own = own
        if best_own < 0.5:
            opt, p, d = min(every, key=_cost_order)
            reason = "slo_missed"
            tpot = _decodes_on(opt.path, p, d).cost.tpot_s
        else:
            expected = out_tokens if slo_out_tokens is None else slo_out_tokens
            # each engine's running decodes judged once for every option that loads it (the
            # largest stall an option asks about there: the prompt's prefill on it)
            slack = {id(c): running_slack(c.cost, expected, slo, tpot_error, most_stall_s=c.cost.prefill_s(tokens))
                     for c in (*prefills, *decodes)}
            judged: list[tuple[SloValue, OptionCost, Candidate[E], Candidate[E]]] = []
            top = -math.inf
            for (o, op, od), own in zip(every, owns, strict=True):
                # its own chance as the pass above took it (the slack's newcomer is newcomer_chance's)
                value = slo_value(o, tokens, op.cost, od.cost, expected, slo,
                                  slacks=(slack[id(op)], slack[id(od)]), own=own)
                judged.append((value, o, op, od))
                top = max(top, value.good)
            # the most requests expected to meet the SLO; among options within a hundredth of a
            # request of that, the lowest score (what the policy chooses without an SLO)
            value, opt, p, d = min((t for t in judged if t[0].good >= top - SLO_TIE), key=_judged_order)
            reason = "slo" if value.own >= 0.5 else "slo_missed"
            tpot = value.tpot_s
    if stale is not None:
        chosen = (opt.path, *_engines(opt.path, p, d))
        limit = explore_within * (opt.score_s - opt.decode_s)
        decode_limit = explore_within * opt.decode_s
        asked: set[tuple[Option, E | None, E]] = set()
        for alt, ap, ad in sorted(every, key=_option_score):
            if alt.path is WHOLE or alt.score_s - alt.decode_s > limit or alt.decode_s > decode_limit:
                continue
            key = (alt.path, *_engines(alt.path, ap, ad))
            if key == chosen or key in asked:
                continue
            asked.add(key)
            if stale(*key):
                opt, p, d, reason = alt, ap, ad, "explore"
                break
    if opt.path is LOCAL:
        return Decision(LOCAL, reason, None, d.engine, opt.ttft_s, options, tpot)
    if opt.path is WHOLE:
        return Decision(WHOLE, whole_reason[id(p)] if slo is None else reason, p.engine, None,
                        opt.ttft_s, options, tpot)
    return Decision(SPLIT, reason, p.engine, d.engine, opt.ttft_s, options, tpot)


def _option_score(option: tuple[OptionCost, Candidate[E], Candidate[E]]) -> float:
    """The score of an option over a pair (exploration asks the cheapest first)."""
    return option[0].score_s


def _judged_order(judged: tuple[SloValue, OptionCost, Candidate[E], Candidate[E]]) -> tuple[float, int]:
    """:func:`~disagg.routecost.score_order` of a judged option's cost (the SLO's tie-break)."""
    return score_order(judged[1])


def _decodes_on(path: Option, p: Candidate[E], d: Candidate[E]) -> Candidate[E]:
    """The engine that decodes an option's request (as :func:`~disagg.routecost.slo_value` takes it)."""
    return p if path is WHOLE else d


def _cost_order(option: tuple[OptionCost, Candidate[E], Candidate[E]]) -> tuple[float, int]:
    """:func:`~disagg.routecost.score_order` of an option over a pair (the SLO's choice where no
    option gives the prompt an even chance)."""
    return score_order(option[0])


def decodes_slower(prefill: EngineCost, decodes: Sequence[EngineCost], factor: float) -> bool:
    """The ``decode_load`` rule (module doc): one more decode would take more than ``factor`` x
    the prefill engine's time per output token on every decode engine (False while any of
    them is unmeasured)."""
    if prefill.tpot_s is None or not decodes:
        return False
    return all(d.tpot_s is not None and d.tpot_s > factor * prefill.tpot_s for d in decodes)


def _engines(path: Option, p: Candidate[E], d: Candidate[E]) -> tuple[E | None, E]:
    """The engines an option uses, as :class:`Explorer` keys them: (prefill engine or None, decode engine)."""
    return (p.engine if path is SPLIT else None), d.engine


class Explorer:
    """Which (path, prefill engine, decode engine) has gone unmeasured long enough to explore.

    Pure state with the clock passed in (``now``, any monotonic seconds), so that
    tests drive it. The router (:class:`disagg.proxy.router.Router`) passes
    :meth:`stale` to :func:`decide`, calls :meth:`taken` with every auto
    decision's outcome, and :meth:`forget` when an engine comes back. Keys are
    whatever names the engines (the router uses URLs; ``None`` for no engine).
    """

    __slots__ = ("_after_decisions", "_after_s", "_decisions", "_last")

    def __init__(self, after_s: float = EXPLORE_AFTER_S, after_decisions: int = EXPLORE_AFTER_DECISIONS) -> None:
        self._after_s = after_s
        self._after_decisions = after_decisions
        self._decisions = 0
        #: per key: (when it was last taken or first considered, the decision count then)
        self._last: dict[tuple[Option, Hashable, Hashable], tuple[float, int]] = {}

    def stale(self, path: Option, prefill: Hashable, decode: Hashable, now: float) -> bool:
        """Whether ``path`` over these engines has gone untaken for long enough (both bounds).

        A key never seen (neither taken nor asked about) starts its clock now: nothing
        is stale before the whole period has passed since it was first asked about
        (:func:`decide` asks only about options within the factor) or last taken."""
        key = (path, prefill, decode)
        last = self._last.get(key)
        if last is None:
            self._last[key] = (now, self._decisions)
            return False
        return now - last[0] >= self._after_s and self._decisions - last[1] >= self._after_decisions

    def taken(self, path: Option, prefill: Hashable, decode: Hashable, now: float) -> None:
        """One auto decision sent a prompt along ``path`` over these engines: it is fresh."""
        self._decisions += 1
        self._last[(path, prefill, decode)] = (now, self._decisions)

    def forget(self, engine: Hashable) -> None:
        """The engine came back (a new process, seeded estimates): its keys start over."""
        for key in [k for k in self._last if engine in (k[1], k[2])]:
            del self._last[key]

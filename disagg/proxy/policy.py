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
  predicted TTFT, plus for ``local`` the stall a prefill imposes on the decodes
  running on that engine). ``whole`` is an option only where the connector allows
  it (``RoutingConfig.whole``), on a prefill engine with nothing in flight, while
  every decode engine has prefills waiting (the decode side is the bottleneck).

Reasons (the ``reason`` label of ``disagg_route_total``): ``policy`` for the
static policies, ``predicted`` for an ``auto`` choice, ``decode_backlog`` for
``whole``, and ``no_prefill`` / ``no_decode`` when a pool has no healthy engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from disagg.routecost import EngineCost, LinkCost, Option, OptionCost, cheapest, option_costs

E = TypeVar("E")


@dataclass(frozen=True)
class Candidate(Generic[E]):
    """One healthy engine (``engine``: the proxy's Backend, or anything in tests) and its costs."""

    engine: E
    cost: EngineCost


@dataclass(frozen=True)
class Decision(Generic[E]):
    """Where one prompt goes: the path, why, the engines, and the prediction behind it."""

    path: Option
    reason: str
    prefill: E | None
    decode: E | None
    predicted_s: float | None
    options: tuple[OptionCost, ...] = ()


def decide(policy: str, tokens: float, kv_bytes: float, prefills: Sequence[Candidate[E]],
           decodes: Sequence[Candidate[E]], link: Callable[[E, E], LinkCost], *, whole: bool = False,
           local: bool = True, stall_weight: float = 1.0) -> Decision[E]:
    """The route of one prompt (see the module doc). ``local`` false: decode engines cannot serve
    alone (SGLang), so only ``split`` remains."""
    if policy == "split" or not local:
        return Decision(Option.SPLIT, "policy", None, None, None)
    if not decodes:
        if whole and prefills:
            best = min(prefills, key=lambda c: c.cost.ttft_s(tokens))
            return Decision(Option.WHOLE, "no_decode", best.engine, None, best.cost.ttft_s(tokens))
        return Decision(Option.SPLIT, "no_decode", None, None, None)
    if policy == "local" or not prefills:
        best_d = min(decodes, key=lambda c: c.cost.ttft_s(tokens))
        return Decision(Option.LOCAL, "policy" if policy == "local" else "no_prefill", None, best_d.engine,
                        best_d.cost.ttft_s(tokens))
    backlog = whole and all(d.cost.queued_tokens > 0 for d in decodes)
    per_path: dict[Option, tuple[OptionCost, Candidate[E], Candidate[E]]] = {}
    for p in prefills:
        idle = backlog and p.cost.queued_tokens == 0 and p.cost.running == 0
        for d in decodes:
            for opt in option_costs(tokens, kv_bytes, p.cost, d.cost, link(p.engine, d.engine), whole=idle,
                                    stall_weight=stall_weight):
                held = per_path.get(opt.path)
                if held is None or opt.score_s < held[0].score_s:
                    per_path[opt.path] = (opt, p, d)
    options = tuple(v[0] for v in per_path.values())
    opt = cheapest(list(options))
    _, p, d = per_path[opt.path]
    if opt.path is Option.LOCAL:
        return Decision(Option.LOCAL, "predicted", None, d.engine, opt.ttft_s, options)
    if opt.path is Option.WHOLE:
        return Decision(Option.WHOLE, "decode_backlog", p.engine, None, opt.ttft_s, options)
    return Decision(Option.SPLIT, "predicted", p.engine, d.engine, opt.ttft_s, options)

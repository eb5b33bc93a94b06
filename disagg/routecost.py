"""Predicted time to first token of one prompt on each path: the routing arithmetic.

Pure functions and value classes, no I/O: the proxy's routing policy
(:mod:`disagg.proxy.policy`) calls them per prompt with live measurements, and
``disagg plan`` (:mod:`disagg.planning`) with stored or estimated ones, so the
break-even prompt length ``plan`` prints is the one the policy uses at idle load.

For a prompt of ``n`` tokens whose KV cache is ``kv_bytes``:

- ``local`` (the decode engine prefills it): ``wait(D) + n / rate(D)``;
- ``whole`` (an idle prefill engine serves the request alone): ``wait(P) + n / rate(P)``;
- ``split``: ``max(wait(P) + n / rate(P) + fixed + exposed, wait(D))``
  (with an engine's busy time, :attr:`EngineCost.busy_s`, ``wait(E)`` is the longer
  of the two: :meth:`EngineCost.ttft_s`):
  the decode engine takes the prompt's KV and computes its first token only
  once the prefills queued on it ahead are done, so the handoff overlaps that
  wait but the first token never comes before it ends. ``exposed`` is the
  part of the transfer (``kv_bytes / link rate``) that the prefill does not
  hide: all of it when the KV leaves after the prefill (the default), less
  when it is streamed layer by layer while the prefill computes
  (``LinkCost.streaming_layers``, :func:`exposed_transfer_s`);

where ``wait(E)`` is the engine's outstanding prefill tokens over its prefill
rate, and ``fixed`` the handoff's cost that does not depend on its size
(two HTTP hops, the prefill reply, the decode engine scheduling a remote
prefill and its first step). ``rate`` is the engine's prefill rate in tokens
per second, ``overhead`` its per-request cost (HTTP, scheduling, the first
decode step) so that ``ttft = overhead + (queued + n) / rate``.

An engine whose KV cache is full admits no new prompt until the requests it holds free
enough of it (vLLM schedules a waiting prompt only once its blocks fit): ``wait(E)`` is
also never shorter than that (:func:`kv_wait_s`: the engine's free KV tokens now and when
the requests holding the rest are expected to end), and a split's first token waits for
room on the decode engine as well. Where the KV cache is not known, nothing waits for it.

Besides its own TTFT, a prompt prefilled on an engine stalls the decodes
running there for about its prefill time, and holds up the prompts that will
queue behind it there: :func:`option_costs` adds ``(stall_weight x running +
waiting) x prefill time`` to the score, for ``local`` with the decode engine's
running decodes and waiting prefills, for ``split`` and ``whole`` with the
prefill engine's (requests it serves ``whole``: none unless the policy sent it
some). A split's transfer, likewise, slows the handoffs on the link with it:
``split`` adds ``in_transit x kv_bytes / link rate`` (:func:`link_held_up_s`).

Time per output token under load (:func:`tpot_with_prefills_s`): a decode step on an engine
that also prefills waits for the prefill work arriving meanwhile, so its decodes progress in the
``1 - share`` of its time the prefills leave (``share``: prefill time arriving per second,
:func:`prefill_tokens_share`), and each step reads the weights and the batch's KV
(:func:`decode_step_s`): ``TPOT = tpot_s / (1 - share - decode tokens per second x tpot_added_s)``.
``disagg plan --classes ... --rate R`` (:mod:`disagg.workload_plan`) predicts every
configuration's TPOT with it.

The fixed cost was measured per connector on the project's 2-core CPU machine
by ``benchmarks/handoff_fixed_cost.py`` (2026-11-30, load average 4.5-5.2 from
other work, embedded tiny model, one core per engine, loopback, 64/256/1,024-token
prompts, 5 repeats): ``TTFT(split) - TTFT(plain request on P)`` fitted as fixed
+ per token gave NIXL 29.9 ms + 177 us/token and socket 15.7 ms + 23 us/token:
:data:`HANDOFF_FIXED_S`. The per-token part is the connectors' own transfer
speed on one core, far below the loopback link's; the proxy measures both
live per prefill -> decode pair and uses these figures only as a seed.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

#: measured fixed handoff cost per connector (seconds); see the module doc for how
HANDOFF_FIXED_S: dict[str, float] = {"nixl": 0.030, "socket": 0.016, "nixl-push": 0.074}
#: where :data:`HANDOFF_FIXED_S` comes from, printed by ``disagg plan``
HANDOFF_FIXED_SOURCE = ("measured 2026-11-30 on a 2-core CPU machine by benchmarks/handoff_fixed_cost.py: "
                        "TTFT of a split minus a plain request on P, tiny model, loopback; "
                        "nixl 30 ms, socket 16 ms; nixl-push 74 ms, measured 2026-12-01 by "
                        "benchmarks/streaming_ttft.py (P's answer to D's, minus P's WRITE and decode's first "
                        "step; tiny-kvdeep in float32, emulated 1 and 2.5 Gb/s); the proxy measures it live")
#: where :data:`STREAMED_HANDOFF_FIXED_S` comes from, printed by ``disagg plan`` for a streamed handoff
STREAMED_HANDOFF_FIXED_SOURCE = ("measured 2026-12-01 on a 2-core CPU machine by benchmarks/streaming_ttft.py: "
                                 "TTFT of a streamed split minus the prefill alone minus the transfer it "
                                 "leaves exposed, median of 9 rows; socket 40 ms")
#: bytes per second a CPU decode engine on one core reads in its first step of a sequential split:
#: vLLM recomputes the last prompt token on the decode engine, a step over the model's weights and the
#: whole prompt's KV that begins only once the KV is in. Fitted 2026-12-01 on this project's 2-core CPU
#: machine from benchmarks/streaming_ttft.py's pulled handoffs measured within each request (P's answer
#: to D's, minus D's transfer; embedded tiny-kvdeep in float32, 128-2,048 tokens, emulated 1 and 2.5
#: Gb/s): 47 ms + 0.32 ms per MB of KV, where the model's 78 MB of weights and its KV at ~3 GB/s make
#: up all but the connector's own fixed part (the 2-layer tiny model's first step is ~1 ms of the
#: 16 ms in :data:`HANDOFF_FIXED_S`); per core the engine is pinned to (an estimate beyond one)
FIRST_STEP_CPU_BYTES_PER_S = 3.0e9
#: where :data:`FIRST_STEP_CPU_BYTES_PER_S` comes from, printed by ``disagg plan``
FIRST_STEP_CPU_SOURCE = ("decode's first step read at 3 GB/s (weights + the prompt's KV), fitted 2026-12-01 on "
                         "a 2-core CPU machine by benchmarks/streaming_ttft.py, one core per engine")
#: connectors without a measurement of their own use the largest measured one of a pulled handoff
DEFAULT_HANDOFF_FIXED_S = max(HANDOFF_FIXED_S["nixl"], HANDOFF_FIXED_S["socket"])
#: longest prompt the break-even search considers
MAX_SEARCH_TOKENS = 1 << 20


class Option(enum.StrEnum):
    """The ways a prompt can be served (the proxy's route paths)."""

    SPLIT = "split"
    LOCAL = "local"
    WHOLE = "whole"


#: the options as module names, for the decision's code: a member read through its Enum class costs
#: about four times a module name's (Python 3.11), and each decision reads them dozens of times
SPLIT, LOCAL, WHOLE = Option.SPLIT, Option.LOCAL, Option.WHOLE


#: measured fixed cost of a *streamed* handoff per connector (seconds): TTFT of a streamed split minus
#: the prefill alone minus :func:`exposed_transfer_s`, the median over the 9 rows (loopback, emulated 1
#: and 2.5 Gb/s; 128, 512 and 2,048 tokens) of ``benchmarks/streaming_ttft.py`` on 2026-12-01 (the
#: embedded tiny-kvdeep in float32, one pinned core per engine): 24-57 ms on 7 rows, 357 and 382 ms on
#: the 2,048-token rows at 1 Gb/s and over loopback, where sending 134 MB during the prefill slowed it
#: (docs/socket-connector.md)
STREAMED_HANDOFF_FIXED_S: dict[str, float] = {"socket": 0.040}


def first_step_s(weight_bytes: float, kv_bytes: float, bytes_per_s: float) -> float:
    """The decode engine's first step of a sequential split: vLLM recomputes the last prompt token
    there, reading the model's weights and the prompt's whole KV, once the KV is in. It adds to the
    handoff (a colocated prefill computes that token within its own pass). ``disagg plan`` prices
    it with the decode host's memory rate (:data:`FIRST_STEP_CPU_BYTES_PER_S` on a CPU); a streamed
    handoff's measured fixed cost already holds it (D's step overlaps P's own reply there)."""
    return decode_step_s(weight_bytes, kv_bytes, bytes_per_s)


def decode_step_s(weight_bytes: float, kv_bytes: float, bytes_per_s: float) -> float:
    """One decode step on an engine whose steps are bound by memory reads (a GPU; a CPU engine at
    :data:`FIRST_STEP_CPU_BYTES_PER_S` per core): the model's active weights and the KV of every
    request in the batch, read at ``bytes_per_s``. The estimate behind :class:`DecodeLine` where
    no decode step was measured on the engine's host (:meth:`DecodeLine.from_memory_rate`), and
    behind decode's first step after a handoff (:func:`first_step_s`)."""
    return (weight_bytes + kv_bytes) / bytes_per_s


@dataclass(frozen=True)
class DecodeLine:
    """How long a decode step takes on an engine: ``fixed_s`` for a step of one request with no
    context, plus ``per_kv_byte_s`` for each byte of KV the batch's requests hold (each decoding
    request reads its whole context's KV every step). Measured (``disagg bench prefill`` and
    ``disagg bench compare`` fit it from a request decoding alone at two context lengths:
    :func:`disagg.measurements.fit_decode_step`), or from a memory rate (:meth:`from_memory_rate`:
    the weights and the KV read at ``bytes_per_s``, :func:`decode_step_s`). A measured line holds
    what a step costs beyond its reads (on a CPU engine most of it: the tiny-kvheavy model's
    23 MiB of weights at 3 GB/s predicted 8 ms a step where it took 5 ms with a 64-token context
    and 9 ms with 1,000 tokens). ``disagg plan``'s workload model (:mod:`disagg.workload_plan`)
    builds an engine's :class:`EngineCost` decode line from it: ``tpot_s`` = ``fixed_s``,
    ``tpot_added_s`` = ``per_kv_byte_s`` x one request's KV; a further request is taken to add
    only its KV (its own per-request overhead in a batch is not measured alone)."""

    fixed_s: float
    per_kv_byte_s: float
    source: str
    measured: bool = False

    @classmethod
    def from_memory_rate(cls, weight_bytes: float, bytes_per_s: float, source: str) -> DecodeLine:
        """The estimate: the active weights and the KV read at ``bytes_per_s`` (:func:`decode_step_s`)."""
        return cls(decode_step_s(weight_bytes, 0.0, bytes_per_s), decode_step_s(0.0, 1.0, bytes_per_s), source)

    def step_s(self, kv_bytes: float) -> float:
        """One decode step over ``kv_bytes`` of context KV (the batch's, or one request's alone)."""
        return self.fixed_s + self.per_kv_byte_s * kv_bytes

    @property
    def kv_bytes_per_s(self) -> float:
        """The rate its KV part reads at (inf: a measured line with no KV part)."""
        return math.inf if self.per_kv_byte_s <= 0 else 1.0 / self.per_kv_byte_s


def handoff_fixed_source(streaming: bool) -> str:
    """Where the seeded fixed cost comes from (what ``disagg plan`` prints beside it)."""
    return STREAMED_HANDOFF_FIXED_SOURCE if streaming else HANDOFF_FIXED_SOURCE


def handoff_fixed_s(connector: str, streaming: bool = False) -> float:
    """The seeded fixed handoff cost of ``connector`` (:data:`HANDOFF_FIXED_S`), or of its streamed
    handoff (:data:`STREAMED_HANDOFF_FIXED_S`)."""
    if streaming and connector in STREAMED_HANDOFF_FIXED_S:
        return STREAMED_HANDOFF_FIXED_S[connector]
    return HANDOFF_FIXED_S.get(connector, DEFAULT_HANDOFF_FIXED_S)


class Decoding(NamedTuple):
    """One request decoding on an engine, as far as its stream has come: ``elapsed_s`` since its first
    token, ``gaps`` between the tokens sent so far, ``total_gaps`` it is expected to have in all (its
    expected output tokens less one). Its TPOT is the mean gap over all of them, so what it may still
    spend and meet a TPOT objective is the objective over every gap less what it has spent. (A
    named tuple; ``EngineCost.decodes`` holds these three numbers, as a Decoding or a plain tuple.)"""

    elapsed_s: float
    gaps: float
    total_gaps: float

    def left_gaps(self) -> float:
        """The gaps it has still to go (at least one: a request past its expected length goes on)."""
        return self.slack(0.0)[1]

    def allowed_tpot_s(self, objective_s: float) -> float:
        """The time per output token its remaining gaps may take and still meet ``objective_s``
        (0 or below: it has missed it already)."""
        return self.slack(objective_s)[0]

    def slack(self, objective_s: float) -> tuple[float, float]:
        """(:meth:`allowed_tpot_s`, :meth:`left_gaps`) in one call: what :func:`running_slack` takes
        of each followed decode (written out there, for its cost)."""
        elapsed, gaps, total = self
        left = total - gaps
        if left < 1.0:
            left = 1.0
        return (objective_s * (total if total > gaps + 1.0 else gaps + 1.0) - elapsed) / left, left


#: where one followed stream stands, ``(elapsed_s, gaps, total_gaps)`` as :class:`Decoding` names
#: them: what ``EngineCost.decodes`` holds (a Decoding, or a plain tuple: the router builds one per
#: followed stream for every decision, and a plain tuple costs half as much)
Progress = tuple[float, float, float]


@dataclass(slots=True)
class EngineCost:
    """What predicts a prefill on one engine. (Not frozen, though nothing changes one once built:
    the router builds one per engine for every routing decision, and a frozen dataclass's
    ``__init__`` costs about four times as much.)

    ``tokens_per_s``: its prefill rate; ``overhead_s``: per-request cost on top;
    ``queued_tokens``: prompt tokens it has still to prefill (its queue, as estimated);
    ``running``: requests it is decoding now (a prefill computed there stalls them);
    ``waiting``: prefills sent to it that have not produced their first token yet;
    ``tpot_s``: predicted time per output token of one more request decoding there
    (None: not measured; without an SLO the policy offers ``whole`` on it only from the backlog rule);
    ``busy_s``: what its load (requests in flight) adds to a prefill's time to first token
    beyond its line (the step in progress, decodes batched with the prefill): part of
    :meth:`ttft_s`, not of :meth:`prefill_s`, so not of the stall a prefill imposes;
    ``tpot_added_s``: how much one more request there raises the time per output token of each
    request decoding there (the slope of the line behind ``tpot_s``; 0 when it is flat or unmeasured).
    """

    tokens_per_s: float
    overhead_s: float = 0.0
    queued_tokens: float = 0.0
    running: int = 0
    waiting: int = 0
    tpot_s: float | None = None
    busy_s: float = 0.0
    tpot_added_s: float = 0.0
    #: KV cache tokens free on the engine now (inf: its capacity is not known)
    kv_free_tokens: float = math.inf
    #: (seconds from now, KV tokens) the requests holding the rest are expected to free, soonest first
    kv_frees: tuple[tuple[float, float], ...] = ()
    #: the share of its time it spent prefilling lately (in ``tpot_s``; for the proxy's log)
    prefill_duty: float = 0.0
    #: the requests decoding there whose streams the proxy sees, each with its :data:`Progress`; the
    #: rest of ``running`` are taken as on the line from their first token (:func:`running_harm`)
    decodes: Sequence[Progress] = ()

    def wait_s(self) -> float:
        """Queue wait: the outstanding prefill tokens at this engine's rate."""
        return self.queued_tokens / self.tokens_per_s

    def prefill_s(self, tokens: float) -> float:
        """Prefill time of ``tokens`` on this engine, idle (its overhead included)."""
        return self.overhead_s + tokens / self.tokens_per_s

    def ttft_s(self, tokens: float, *, known_kv_wait_s: float | None = None) -> float:
        """Prefill of ``tokens`` after the longer of the queue wait and what the engine's load adds
        (``busy_s``). Both price the same delay, the work the engine does before it starts the
        prompt: the busy line is learned from prompts sent with next to nothing queued (where
        the queue estimate missed that work), so where a queue is estimated it covers the same
        time, and their sum counted it twice. Summed, a prefill engine with 7-10 requests in
        flight predicted splits at 7.9 s where they took 4.7 s on average (MAE 79%; 39% with the
        longer of the two), and past saturation the policy sent every prompt to the decode engine.
        A prompt that finds the engine's KV cache full waits as well for the room its ``tokens``
        need (:meth:`kv_wait_s`; ``known_kv_wait_s``: that wait, where the caller has it); the
        longest of the three delays counts."""
        room = self.kv_wait_s(tokens) if known_kv_wait_s is None else known_kv_wait_s
        return max(self.wait_s(), self.busy_s, room) + self.prefill_s(tokens)

    def kv_wait_s(self, tokens: float) -> float:
        """How long a prompt of ``tokens`` waits for room in the engine's KV cache
        (:func:`kv_wait_s`); 0 where the capacity is not known."""
        return kv_wait_s(tokens, self.kv_free_tokens, self.kv_frees)


def kv_wait_s(tokens: float, free_tokens: float, frees: tuple[tuple[float, float], ...]) -> float:
    """Seconds until an engine's KV cache has room for ``tokens`` more: 0 when ``free_tokens``
    already hold them, else the moment the requests expected to end soonest (``frees``: seconds
    from now and the KV tokens each frees, soonest first) have freed enough; ``math.inf`` when even all of
    them would not (a prompt larger than the cache: the engine refuses it, so no path through
    it is good). vLLM's scheduler admits a waiting prompt once its blocks fit, first come first
    served, and a running request frees its blocks when it ends; the holders are counted at the
    size they are expected to reach (prompt and output), so growth that would preempt a
    newcomer is counted as taken."""
    short = tokens - free_tokens
    if short <= 0:
        return 0.0
    for seconds, freed in frees:
        short -= freed
        if short <= 0:
            return max(seconds, 0.0)
    return math.inf


def exposed_transfer_s(transfer_s: float, prefill_s: float, layers: int | None) -> float:
    """What a KV transfer of ``transfer_s`` seconds adds to a prefill of ``prefill_s`` seconds
    when the KV is streamed layer by layer over ``layers`` attention layers (the fixed cost apart).

    The derivation. Write ``X`` for ``transfer_s``, ``P`` for ``prefill_s``, ``L`` for
    ``layers``. The prefill computes the layers one after another, ``P / L`` each, so layer
    ``l``'s KV exists from ``l P / L`` (``l = 1..L``); it can leave only then, and the link sends
    one layer after another, ``X / L`` each. Layer ``l``'s send ends at
    ``e(l) = max(l P / L, e(l - 1)) + X / L`` (``e(0) = 0``), which unrolls to
    ``e(L) = max over k = 1..L of (k P / L + (L - k + 1) X / L)``: the send of layer ``k``
    starts as soon as that layer is computed and every later one follows without a gap. That
    is linear in ``k``, so its maximum is at an end: ``k = L`` (the link keeps up; only the
    last layer's send is left after the prefill) or ``k = 1`` (the link is the bottleneck from
    the first layer on). So the last byte arrives at ``max(P + X / L, X + P / L)`` after the
    prefill starts, and what it adds to the prefill is::

        exposed = max(X / L, X - P + P / L)      (X / L <= exposed <= X)

    ``L`` of 1, or None (the layers unknown, or the KV sent after the prefill: the sequential
    handoff), gives ``X``: nothing is hidden, the safe side. It takes the layers as alike in
    compute and bytes (sliding-window layers hold fewer) and the prefill as one forward pass
    (a prefill in chunks sends each chunk's layers as they come, which overlaps at least as
    much), and the sends as costing the prefill nothing: where the sending thread shares the
    prefill's cores (a CPU engine on one core) it is optimistic.
    """
    if layers is None or layers <= 1:
        return transfer_s
    return max(transfer_s / layers, transfer_s - prefill_s + prefill_s / layers)


def max_transfer_s(exposed_s: float, prefill_s: float, layers: int | None) -> float:
    """The longest transfer whose :func:`exposed_transfer_s` next to a prefill of ``prefill_s``
    is at most ``exposed_s`` (its inverse; ``exposed_s`` <= 0: 0). ``exposed`` rises with the
    transfer, so it is ``min(L x exposed_s, exposed_s + P - P / L)``."""
    if exposed_s <= 0:
        return 0.0
    if layers is None or layers <= 1:
        return exposed_s
    return min(layers * exposed_s, exposed_s + prefill_s - prefill_s / layers)


@dataclass(slots=True)
class LinkCost:
    """A prefill -> decode handoff: ``fixed_s + nbytes / bytes_per_s``, or with
    ``streaming_layers`` (the KV streamed layer by layer while the prefill computes, over a
    model of that many layers) ``fixed_s`` + the part of the transfer the prefill does not hide
    (:func:`exposed_transfer_s`); None: sent after the prefill. ``in_transit``: the handoffs on
    the link now. (Not frozen, like :class:`EngineCost`: one per engine pair and decision.)"""

    fixed_s: float
    bytes_per_s: float
    streaming_layers: int | None = None
    #: handoffs moving KV over this link now (their prefill answered, their first token not yet come;
    #: a streamed one from when it was sent; one whose first token is not seen, to its predicted end):
    #: what a transfer sent now holds up (:func:`link_held_up_s`)
    in_transit: int = 0
    #: measured on this pair (:func:`disagg.measurements.fit_handoff`): what each byte adds to the
    #: split's TTFT beyond ``fixed_s``, in place of :meth:`exposed_s`'s model; None: modelled
    exposed_per_byte_s: float | None = None

    def transfer_s(self, nbytes: float) -> float:
        """Time the link takes to move ``nbytes`` of KV cache, on its own."""
        return nbytes / self.bytes_per_s

    def seconds(self, nbytes: float) -> float:
        """Time to hand over ``nbytes`` of KV cache after the prefill (the sequential handoff)."""
        return self.fixed_s + self.transfer_s(nbytes)

    def exposed_s(self, nbytes: float, prefill_s: float) -> float:
        """What moving ``nbytes`` adds to a prefill of ``prefill_s`` seconds, the fixed cost apart
        (the whole transfer unless streamed: :func:`exposed_transfer_s`; as measured on the pair
        where :attr:`exposed_per_byte_s` is set)."""
        if self.exposed_per_byte_s is not None:
            return nbytes * self.exposed_per_byte_s
        return exposed_transfer_s(self.transfer_s(nbytes), prefill_s, self.streaming_layers)

    def after_prefill_s(self, nbytes: float, prefill_s: float) -> float:
        """What the handoff of ``nbytes`` adds to a prefill of ``prefill_s`` seconds: the fixed
        cost plus :meth:`exposed_s` (:meth:`seconds` when not streamed)."""
        return self.fixed_s + self.exposed_s(nbytes, prefill_s)


def local_ttft(tokens: float, decode: EngineCost) -> float:
    """Predicted TTFT when the decode engine prefills the prompt itself."""
    return decode.ttft_s(tokens)


def whole_ttft(tokens: float, prefill: EngineCost) -> float:
    """Predicted TTFT when a prefill engine serves the request alone."""
    return prefill.ttft_s(tokens)


def split_ttft(tokens: float, kv_bytes: float, prefill: EngineCost, link: LinkCost,
               decode: EngineCost | None = None, *, prefill_ttft_s: float | None = None,
               decode_room_s: float | None = None) -> float:
    """Predicted TTFT of a split: prefill on P, then the handoff (fixed + the transfer the prefill
    does not hide: all of it, or with ``link.streaming_layers`` what :func:`exposed_transfer_s`
    leaves of it next to P's ``tokens / rate``), but no earlier than the end of the prefill
    work queued on the decode engine (``decode``), nor before that engine has room in its KV
    cache for the prompt (:meth:`EngineCost.kv_wait_s`) and the handoff that follows.
    ``prefill_ttft_s`` and ``decode_room_s``: ``prefill.ttft_s(tokens)`` and
    ``decode.kv_wait_s(tokens)`` where the caller has them (:func:`option_costs`)."""
    if prefill_ttft_s is None:
        prefill_ttft_s = prefill.ttft_s(tokens)
    arrived = prefill_ttft_s + link.after_prefill_s(kv_bytes, tokens / prefill.tokens_per_s)
    if decode is None:
        return arrived
    room = decode.kv_wait_s(tokens) if decode_room_s is None else decode_room_s
    if room > 0:          # the KV moves only once the decode engine has room for it
        room += link.seconds(kv_bytes)
    return max(arrived, decode.wait_s(), room)


def prefill_tokens_share(prompt_tokens_per_s: float, engine: EngineCost) -> float:
    """The share of ``engine``'s time prompt tokens arriving at ``prompt_tokens_per_s`` take to
    prefill at its rate (what :func:`stall_s` charges the decodes there, per second)."""
    return prompt_tokens_per_s / engine.tokens_per_s


def tpot_with_prefills_s(engine: EngineCost, share: float, decode_tokens_per_s: float = 0.0) -> float:
    """Time per output token of the requests decoding on ``engine`` while prefills take ``share``
    of its time (:func:`prefill_tokens_share`) and its decodes produce ``decode_tokens_per_s``
    tokens per second in all; ``math.inf`` at or past saturation.

    The model. vLLM steps a prefill chunk and the running decodes together and a prefill goes
    first, so a decode step waits for the prefill work that arrives meanwhile: the decodes
    progress only in the ``1 - share`` of the time the prefills leave, which is :func:`stall_s`
    per second (each running decode waits out each prefill once). A decode step itself takes
    ``tpot_s`` (one request: the weights read, :func:`decode_step_s`) plus ``tpot_added_s`` for
    each further request in the batch, and by Little's law the batch holds
    ``decode_tokens_per_s x TPOT`` requests (each stays one TPOT per token it decodes), so

        TPOT = (tpot_s + batch x tpot_added_s) / (1 - share),  batch = decode_tokens_per_s x TPOT
             = tpot_s / (1 - share - decode_tokens_per_s x tpot_added_s)

    It rises with the prefill load and with the decode load, and is unbounded where the two
    leave the engine no time (the saturation ``disagg plan`` reports). Raises ValueError when
    ``engine`` has no decode line (``tpot_s`` None)."""
    if engine.tpot_s is None:
        raise ValueError("the engine has no decode line (tpot_s)")
    left = 1.0 - share - decode_tokens_per_s * engine.tpot_added_s
    return math.inf if left <= 0 else engine.tpot_s / left


class OptionCost(NamedTuple):
    """One path's prediction: its TTFT and the score the policy compares (TTFT + stall cost +
    ``decode_s``, the decode work it places on an engine: :func:`decode_s`). (A named tuple: built
    for every option of every decision.)"""

    path: Option
    ttft_s: float
    score_s: float
    decode_s: float = 0.0


def option_costs(tokens: float, kv_bytes: float, prefill: EngineCost, decode: EngineCost, link: LinkCost,
                 *, whole: bool = False, stall_weight: float = 0.0, out_tokens: float = 0.0) -> list[OptionCost]:
    """Every option's predicted TTFT and score for one prompt and one (prefill, decode) pair.

    The score is the TTFT plus ``stall_weight`` x the stall the prompt's prefill imposes on
    the decodes running on the engine that computes it (:func:`stall_s`), plus what it holds up
    the prompts that will queue behind it there (:func:`held_up_s`), for a split plus what its
    transfer holds up the handoffs on the link (:func:`link_held_up_s`), plus the decode
    work of the request's ``out_tokens`` on the engine that will decode it (:func:`decode_s`:
    the decode engine for split and local, the prefill engine for whole; counted only when
    every engine compared has a decode line, else no option carries it). ``whole`` adds the
    option of the prefill engine serving the request alone.
    Order: split, local, whole (ties of score: :func:`cheapest`).
    """
    # each engine's TTFT and the decode engine's wait for KV room once, for every option
    on_p_ttft = prefill.ttft_s(tokens)
    room = decode.kv_wait_s(tokens)
    split = split_ttft(tokens, kv_bytes, prefill, link, decode, prefill_ttft_s=on_p_ttft, decode_room_s=room)
    local = decode.ttft_s(tokens, known_kv_wait_s=room)
    on_prefill = _imposed_s(tokens, prefill, stall_weight)
    on_d = decode_s(out_tokens, decode, stall_weight)
    on_p = decode_s(out_tokens, prefill, stall_weight) if whole else 0.0
    if on_d is None or on_p is None:
        on_d = on_p = 0.0
    out = [OptionCost(SPLIT, split, split + on_prefill + link_held_up_s(kv_bytes, link) + on_d, on_d),
           OptionCost(LOCAL, local, local + _imposed_s(tokens, decode, stall_weight) + on_d, on_d)]
    if whole:
        w = on_p_ttft
        out.append(OptionCost(WHOLE, w, w + on_prefill + on_p, on_p))
    return out


def decode_s(out_tokens: float, engine: EngineCost, stall_weight: float = 1.0) -> float | None:
    """Decode time a request of ``out_tokens`` output tokens costs when ``engine`` decodes it
    (None: the engine has no decode line, ``tpot_s``).

    Its own: ``out_tokens x tpot_s`` (the time per output token of one more request there).
    What it adds to the ``running`` decodes there, weighted like a stall: each of them runs
    ``tpot_added_s`` slower per token while both decode, for about half of this request's
    tokens (a running decode is, on average, half-way through answers of like length). So
    past saturation, where decodes limit goodput, an option is priced by where its decode
    goes, not only by its first token: split and local put it on the decode engine, whole
    on the prefill engine."""
    if engine.tpot_s is None:
        return None
    return out_tokens * (engine.tpot_s + stall_weight * engine.running * engine.tpot_added_s / 2)


def stall_s(tokens: float, engine: EngineCost) -> float:
    """Decode time a prefill of ``tokens`` takes from the requests decoding on ``engine``: each of
    its ``running`` decodes waits about that prefill's time once (vLLM steps prefill and decodes
    together)."""
    return engine.running * (tokens / engine.tokens_per_s)


def held_up_s(tokens: float, engine: EngineCost) -> float:
    """First-token time a prefill of ``tokens`` on ``engine`` costs the prompts that will be sent
    there while it waits: about as many as are ``waiting`` there now (in a steady queue as many
    arrive during one prompt's wait as were waiting ahead of it: Little's law), each held up
    by its prefill time. Nothing on an idle engine; on one past its saturation it grows with
    the queue, so the policy stops feeding a queue that only grows. Without it a prefill
    engine's queue of splits grew to 3-4 s at 4 req/s on one core (a split predicted at 3.5 s
    scored below a 0.5 s local prefill priced by its stall on the decode engine's 10 decodes),
    and ``auto``'s goodput fell to 0.6 x the replica pool's."""
    return engine.waiting * (tokens / engine.tokens_per_s)


def link_held_up_s(kv_bytes: float, link: LinkCost) -> float:
    """Handoff time a transfer of ``kv_bytes`` over ``link`` costs the other handoffs: the ones in
    transit there now (``in_transit``; about as many as will come while it moves, by the same
    Little's-law argument as :func:`held_up_s`) share the link with it, each slowed by about its
    transfer time. Nothing on an idle link; on a saturated one it grows with the handoffs piled
    up there, so the policy stops feeding a link queue that only grows. The transfer time is the
    link's fitted line, which under load also holds the queueing it measured: that errs towards
    relieving a loaded link. Without it NIXL on an emulated 1 Gb/s link at 8 req/s split 55 of
    60 long prompts (handoffs 329 ms alone, ~1 s with 5 in transit), each predicted at about 2.1
    s against a local prefill's 0.4 s, because the local prefill's stall on the decode engine's
    20 decodes (4.6 s) outweighed the split's own wait: no split met a 2 s TTFT target, and
    ``auto``'s goodput fell to 0.23 x static split's."""
    return link.in_transit * link.transfer_s(kv_bytes)


def _imposed_s(tokens: float, engine: EngineCost, stall_weight: float) -> float:
    """What a prefill of ``tokens`` on ``engine`` costs others, in the score: its stall on the
    decodes running there, weighted, and what it holds up the prompts that will queue there."""
    return stall_weight * stall_s(tokens, engine) + held_up_s(tokens, engine)


def cheapest(options: Sequence[OptionCost]) -> OptionCost:
    """The option with the lowest score; on a tie, local before split before whole
    (no handoff beats one, and decodes belong on decode engines)."""
    return min(options, key=score_order)


#: on a tie of scores: local before split before whole (:func:`cheapest`)
TIE_RANK = {Option.LOCAL: 0, Option.SPLIT: 1, Option.WHOLE: 2}


def score_order(option: OptionCost) -> tuple[float, int]:
    """How options compare: by score, ties by :data:`TIE_RANK` (:func:`cheapest`, and the SLO
    routing among options equally good for it)."""
    return option.score_s, TIE_RANK[option.path]


def split_gain_s(tokens: int, kv_bytes: Callable[[int], float], prefill: EngineCost, decode: EngineCost,
                 link: LinkCost) -> float:
    """How much sooner a split answers than a local prefill (negative: later), at the engines' load."""
    return local_ttft(tokens, decode) - split_ttft(tokens, kv_bytes(tokens), prefill, link)


def break_even_tokens(kv_bytes: Callable[[int], float], prefill: EngineCost, decode: EngineCost,
                      link: LinkCost, limit: int = MAX_SEARCH_TOKENS) -> int | None:
    """The shortest prompt (<= ``limit``) that a split answers no later than a local prefill,
    or None when none does.

    The gain of a split grows with the prompt when the prefill engine is faster
    per token than the decode engine by more than the link costs per token
    (KV bytes per token grow no faster than linearly: sliding windows cap it);
    the search is a bisection on that monotone gain. ``kv_bytes(n)``: the KV
    cache of an ``n``-token prompt.
    """
    return shortest(lambda n: split_gain_s(n, kv_bytes, prefill, decode, link) >= 0, limit)


def shortest(holds: Callable[[int], bool], limit: int) -> int | None:
    """The smallest n in 1..limit for which ``holds(n)``, by bisection (``holds`` must stay true
    once true as n grows), or None when it does not hold at ``limit``."""
    return first_true(holds, 1, limit) if holds(limit) else None


def first_true(holds: Callable[[int], bool], lo: int, hi: int) -> int:
    """The smallest n in lo..hi for which ``holds(n)``, by bisection: ``holds(hi)`` is true and
    ``holds`` stays true from its first true n up to ``hi``."""
    while lo < hi:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def last_true(holds: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest n in lo..hi for which ``holds(n)``, by bisection: ``holds(lo)`` is true and
    ``holds`` stays true from ``lo`` up to its last true n (the mirror of :func:`first_true`)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if holds(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


# --- routing for goodput under a service-level objective ------------------------------------

#: the typical relative error of a prediction (TTFT or TPOT) before any is measured: what the
#: proxy's routing assumes until it has observed its own (``disagg_route_ttft_error_ratio``)
DEFAULT_PREDICTION_ERROR = 0.3
_SQRT2 = math.sqrt(2.0)


@dataclass(frozen=True)
class ServiceObjective:
    """The user's SLO: a request is good when its TTFT and its mean time per output token are
    within these limits (seconds; None: no limit on that one)."""

    ttft_s: float | None = None
    tpot_s: float | None = None


def meet_probability(predicted_s: float, limit_s: float | None, error: float) -> float:
    """The probability that what is predicted at ``predicted_s`` is observed within ``limit_s``.

    A distribution, not a margin: the observed value is taken as the prediction times a log-normal
    error whose typical relative size is ``error`` (``ln(observed / predicted)`` normal with
    standard deviation ``ln(1 + error)``), ``error`` being the mean relative error the proxy has
    measured of its own predictions (:data:`DEFAULT_PREDICTION_ERROR` before any). So a prediction
    right at the limit meets it half the time, one ``error`` below it about 84% of the time. No
    limit: 1; an infinite prediction (a saturated engine): 0."""
    return chance_within(limit_s, error)(predicted_s)


def chance_within(limit_s: float | None, error: float) -> Callable[[float], float]:
    """``meet_probability(predicted_s, limit_s, error)`` as a function of ``predicted_s``, the
    limit's logarithm and the spread taken once (a decision judges every option's TTFT by it)."""
    if limit_s is None:
        return _certain
    if limit_s <= 0:
        return _hopeless
    log_limit, spread = math.log(limit_s), _spread(error)

    def chance(predicted_s: float) -> float:
        return _chance(predicted_s, log_limit, spread)
    return chance


def _certain(predicted_s: float) -> float:
    return 1.0


def _hopeless(predicted_s: float) -> float:
    return 0.0


def _chance(predicted_s: float, log_limit: float, spread: float) -> float:
    """:func:`meet_probability` of a limit above 0 from its logarithm and :func:`_spread` (for
    callers that take them once for many predictions)."""
    if math.isinf(predicted_s):
        return 0.0
    if predicted_s <= 0:
        return 1.0
    return _meet(math.log(predicted_s), log_limit, spread)


def _spread(error: float) -> float:
    """The log-normal error's standard deviation times sqrt(2), as :func:`_meet` takes it."""
    return math.log1p(max(error, 1e-3)) * _SQRT2


def _meet(log_predicted: float, log_limit: float, spread: float) -> float:
    """:func:`meet_probability` from the logarithms and :func:`_spread` (for loops that take them once)."""
    return 0.5 * math.erfc((log_predicted - log_limit) / spread)


class SloValue(NamedTuple):
    """One option judged against the SLO: ``good`` is the expected number of requests meeting it
    (this one, ``own``, less the running ones it makes miss, ``harm``); ``tpot_s`` this request's
    predicted time per output token (None: its engine has no decode line yet). (A named tuple:
    built for every option of every decision.)"""

    good: float
    own: float
    harm: float
    tpot_s: float | None


class RunningSlack(NamedTuple):
    """The requests decoding on one engine judged against the TPOT objective, taken once per
    decision (:func:`running_slack`) and asked by every option that loads the engine
    (:meth:`harm`): the logarithms, the gaps to go and each decode's chance to meet the objective
    before any option are the same for all of them.

    ``step_s``: the running decodes' step now (the engine's ``tpot_s`` less ``tpot_added_s``, at
    least 1e-9); ``spread``: the log-normal error's as :func:`_meet` takes it;
    ``followed``: per decode whose stream the proxy follows and that may still meet the objective,
    (log of the time per output token it may still spend, the gaps it has still to go, its chance
    before); ``unseen``: the others, taken as on the line from their first token, ``unseen_gaps``
    gaps each, their chance before ``unseen_before`` against ``log_objective``; ``newcomer``: the
    chance that one more request decoding there (at the engine's ``tpot_s``) meets the objective
    (1 without an objective or a decode line); ``most_stall_s``: the largest prefill :meth:`harm`
    may be asked about (with one request joining at most), for which the decodes left out of
    ``followed`` as safe were judged (:func:`running_slack`)."""

    step_s: float = 0.0
    tpot_added_s: float = 0.0
    spread: float = 1.0
    followed: tuple[tuple[float, float, float], ...] = ()
    unseen: int = 0
    unseen_gaps: float = 1.0
    log_objective: float = 0.0
    unseen_before: float = 0.0
    newcomer: float = 1.0
    most_stall_s: float = math.inf
    # (a named tuple: built for each engine of every decision)

    def harm(self, stall_s: float, joins: int) -> float:
        """:func:`running_harm` of an option that computes a prefill of ``stall_s`` seconds on the
        engine and has ``joins`` more requests decode there (at most ``most_stall_s`` and one:
        ValueError otherwise, as the decodes left out as safe were judged for those)."""
        if stall_s > self.most_stall_s or joins > 1:
            raise ValueError(f"harm asked of a stall of {stall_s} s and {joins} joining; the decodes were "
                             f"judged for {self.most_stall_s} s and one at most")
        added = joins * self.tpot_added_s
        if stall_s <= 0 and added <= 0:
            return 0.0
        step, spread, log, erfc = self.step_s, self.spread, math.log, math.erfc
        harm = 0.0
        for log_allowed, left, before in self.followed:
            # :func:`_meet` written out: this runs for every followed decode of every option that
            # loads the engine, and the call costs a third of the arithmetic
            after = 0.5 * erfc((log(step + stall_s / left + added) - log_allowed) / spread)
            if not before < after:       # max(before - after, 0.0)
                harm += before - after
        if self.unseen > 0:
            after = _meet(math.log(step + stall_s / self.unseen_gaps + added), self.log_objective, spread)
            harm += self.unseen * max(self.unseen_before - after, 0.0)
        return harm


#: a followed decode whose allowed time per output token is this many spreads below the engine's
#: line (a chance to meet the objective of 0.5 erfc(2.63), 1e-4) is taken as lost, and the decision
#: skips its sums: no option can take more than its chance from it (a hundred such decodes, a
#: hundredth of a request, the margin within which the policy calls options equal)
LOST_Z = 2.63

#: a followed decode that even the largest stall an option may impose leaves this many spreads
#: within the time per output token it may still spend (1e-4 from certain, as :data:`LOST_Z`) is
#: taken as safe, and the decision skips its sums: no option can take more than that chance from it
SAFE_Z = LOST_Z

#: the slack of an engine where no option can harm a decode and a newcomer meets the objective
#: (no TPOT objective, no decode line)
NO_RUNNING = RunningSlack()


def running_slack(engine: EngineCost, out_tokens: float, slo: ServiceObjective, error: float, *,
                  most_stall_s: float = math.inf) -> RunningSlack:
    """The requests decoding on ``engine`` as :func:`running_harm` judges them, and the chance
    of one more there (:attr:`RunningSlack.newcomer`), taken once for a decision (see
    :func:`running_harm` for who counts how); ``error``: the measured relative error of the time
    per output token predicted. ``most_stall_s``: the largest prefill any option will ask
    :meth:`RunningSlack.harm` about on this engine (one request joining at most); a followed decode
    that such a stall and one more request leave as good as certain to meet the objective
    (:data:`SAFE_Z`) is left out of the sums, as one as good as lost is (:data:`LOST_Z`). Infinite
    (the default): none is left out as safe, and harm may be asked about any stall."""
    objective = slo.tpot_s
    if objective is None or engine.tpot_s is None:
        return NO_RUNNING
    spread = _spread(error)
    log_objective = math.log(objective) if objective > 0 else -math.inf
    newcomer = _newcomer(engine.tpot_s, objective, log_objective, spread)
    # their step now: tpot_s prices one more request beside them, which an option adds as ``joins``
    step = engine.tpot_s - engine.tpot_added_s
    if engine.running <= 0 or not step < math.inf:   # none to harm; or an endless step: every decode misses
        return RunningSlack(newcomer=newcomer)
    step = max(step, 1e-9)       # above 0 for the logarithm
    log_step = math.log(step)
    lost_below = step * math.exp(-LOST_Z * spread)
    # safe at or above this, spread over the gaps it has to go: the step with one more request,
    # and the stall (an infinite stall: never safe; inf / left stays inf)
    safe_factor = math.exp(SAFE_Z * spread)
    safe_step = (step + engine.tpot_added_s) * safe_factor
    safe_stall = most_stall_s * safe_factor
    followed: list[tuple[float, float, float]] = []
    seen = 0
    log, erfc = math.log, math.erfc
    for elapsed, gaps, total in engine.decodes[:engine.running]:
        if gaps >= total:
            continue
        seen += 1
        # :meth:`Decoding.slack`, written out: this runs for every followed stream of every engine at
        # every decision, and the call costs as much as the arithmetic (a test holds the two equal)
        left = total - gaps if total - gaps > 1.0 else 1.0
        allowed = (objective * (total if total > gaps + 1.0 else gaps + 1.0) - elapsed) / left
        if allowed < lost_below:     # missed already, or as good as (:data:`LOST_Z`): nothing to take
            continue
        if allowed >= safe_step + safe_stall / left:    # no option can take its chance (:data:`SAFE_Z`)
            continue
        log_allowed = log(allowed)
        followed.append((log_allowed, left, 0.5 * erfc((log_step - log_allowed) / spread)))   # :func:`_meet`
    return RunningSlack(step, engine.tpot_added_s, spread, tuple(followed), engine.running - seen,
                        max(out_tokens - 1.0, 1.0), log_objective, _meet(log_step, log_objective, spread),
                        newcomer, most_stall_s)


def newcomer_chance(engine: EngineCost, slo: ServiceObjective, error: float) -> float:
    """The chance that one more request decoding on ``engine``, at its predicted time per output
    token, meets the TPOT objective (:attr:`RunningSlack.newcomer` without the pass over the
    decodes running there: what an option's own chance needs; ``error``: as :func:`running_slack`
    takes it). 1 without a TPOT objective or a decode line."""
    objective = slo.tpot_s
    if objective is None or engine.tpot_s is None:
        return 1.0
    return _newcomer(engine.tpot_s, objective, math.log(objective) if objective > 0 else -math.inf,
                     _spread(error))


def _newcomer(tpot_s: float, objective: float, log_objective: float, spread: float) -> float:
    """:func:`newcomer_chance` of an engine with a decode line, from the objective's logarithm (an
    objective of 0 or below: none meets it) and :func:`_spread`."""
    return _chance(tpot_s, log_objective, spread) if objective > 0 else 0.0


def running_harm(engine: EngineCost, stall_s: float, joins: int, out_tokens: float, slo: ServiceObjective,
                 error: float) -> float:
    """How many of the requests decoding on ``engine`` are expected to miss the TPOT objective
    because of what an option adds there: a prefill of ``stall_s`` seconds computed on it (each
    running decode waits it out once) and ``joins`` more requests decoding beside them (each step
    ``tpot_added_s`` longer for each). Their steps to come are taken at the engine's line with
    the requests running now (``tpot_s`` less ``tpot_added_s``: ``tpot_s`` is one more). Those
    whose streams the proxy follows (``engine.decodes``) are judged by where each stands: the
    stall spread over the gaps it has still to go, against the time per output token it may still
    spend (:meth:`Decoding.allowed_tpot_s`), so one that has missed already, or
    that has time to spare, is next to never harmed, and the stall falls where it costs the
    fewest. The others (up to ``running``), and those past their expected length (how far they
    have to go is not known), are taken as on the line from their first token, the stall spread
    over their ``out_tokens`` - 1 gaps. 0 without a TPOT objective or a decode line, or when the
    option adds nothing there. (A caller judging many options takes :func:`running_slack` once
    per engine and asks its :meth:`RunningSlack.harm`.)"""
    return running_slack(engine, out_tokens, slo, error).harm(stall_s, joins)


def slo_value(option: OptionCost, tokens: float, prefill: EngineCost, decode: EngineCost, out_tokens: float,
              slo: ServiceObjective, *, ttft_error: float = DEFAULT_PREDICTION_ERROR,
              tpot_error: float = DEFAULT_PREDICTION_ERROR,
              slacks: tuple[RunningSlack, RunningSlack] | None = None, own: float | None = None) -> SloValue:
    """``option`` (for one prompt of ``tokens`` over the pair ``prefill`` -> ``decode``) judged by
    the requests expected to meet ``slo``: this one's chance to meet both objectives (its TTFT
    as predicted; its TPOT the line of the engine that will decode it: the decode engine for
    split and local, the prefill engine for whole) less the running decodes it makes miss
    (:func:`running_harm`: on the engine that computes its prefill, the stall; on the engine
    that decodes it, one more in the batch). ``out_tokens``: the output tokens expected
    (below 2: one gap). ``slacks``: :func:`running_slack` of ``prefill`` and ``decode`` with these
    ``out_tokens``, ``slo`` and ``tpot_error``, and ``own`` this option's own chance (its TTFT's
    chance times :func:`newcomer_chance` of the engine that decodes it), from a caller judging many
    options (taken here when not given; given, they hold the errors, and ``ttft_error`` and
    ``tpot_error`` are not read). The TPOT chance is the slack's :attr:`RunningSlack.newcomer` of
    the engine that decodes it, the number :func:`newcomer_chance` gives."""
    if slacks is None:
        slacks = (running_slack(prefill, out_tokens, slo, tpot_error),
                  running_slack(decode, out_tokens, slo, tpot_error))
    computes = decode if option.path is LOCAL else prefill
    decodes_on = prefill if option.path is WHOLE else decode
    computes_slack = slacks[1] if option.path is LOCAL else slacks[0]
    decodes_slack = slacks[0] if option.path is WHOLE else slacks[1]
    if own is None:
        own = meet_probability(option.ttft_s, slo.ttft_s, ttft_error) * decodes_slack.newcomer
    stall = computes.prefill_s(tokens)
    if computes is decodes_on:
        harm = computes_slack.harm(stall, 1)
    else:
        harm = computes_slack.harm(stall, 0) + decodes_slack.harm(0.0, 1)
    return SloValue(own - harm, own, harm, decodes_on.tpot_s)

"""The one question: does moving a request's KV cache cost less than its prefill?

For each prompt class (prompt length n, output length m) the planner works out

* **KV moved**: the prompt's KV cache, ``ModelArch.kv_bytes(n, dtype)``;
* **handoff**: ``fixed + bytes x 8 / link rate``, where the link rate is the
  measured one (``disagg probe-link``) or the practical TCP/RDMA rate of the
  link class (:data:`LINK_CLASSES`), and ``fixed`` is the connector's measured
  fixed cost (:data:`disagg.routecost.HANDOFF_FIXED_S`, measured on loopback)
  plus :data:`HANDOFF_ROUND_TRIPS` round trips of the link (without a connector:
  :data:`PROXY_HOP_S` for the proxy's second request instead of the measured part); once
  ``disagg bench compare`` stored this pair's own fixed cost
  (:func:`disagg.measurements.lookup_handoff`), that measurement instead (:func:`pair_handoff`).
  Sent after the prefill, the handoff also holds decode's first step
  (:func:`first_step`: vLLM recomputes the last prompt token there, reading the
  weights and the prompt's KV at the decode host's memory rate).
  When the KV is streamed layer by layer while the prefill computes (the socket
  connector's ``streaming``), ``fixed`` + only the part of the transfer the
  prefill does not hide: :func:`disagg.routecost.exposed_transfer_s` over the
  model's layers (the streamed ``fixed``, measured, holds the first step);
* **prefill**: ``n / rate`` from a rate ``disagg bench`` measured, else an
  *estimate* ``prefill_flops(n) / (peak FLOP/s x PREFILL_UTILISATION)`` for
  the prefill host's device;
* **local**: the decode host prefilling the prompt itself, measured or estimated
  the same way for the decode host's device (unknown: taken as the prefill host's);
* **verdict**: the split answers at *prefill + handoff*: it *pays* when that is
  no later than the local prefill, is *marginal* when it is later but the
  handoff costs less than the prefill it takes off the decode host (worth it
  when the decode host is busy decoding), and *does not pay* when moving the
  KV takes longer than the decode host computing it; where the model's weights
  do not fit a host's device memory, the rows say *does not fit* instead;
* **decode memory**: how many conversations of the class (n + m tokens of KV)
  fit in the decode host's KV memory at once.

The summary and the routing line come from the same comparison as the rows
(:func:`span`: the shortest and longest prompt for which the split pays, up to
the topology's ``max_model_len``), with no assumption that it stays true as
prompts grow.

At idle load the proxy's ``auto`` routing splits a prompt when that answers
sooner than the decode engine prefilling it itself: the same comparison. It
starts from seeds (:func:`route_seeds`, handed to it by ``disagg up``): each
host's rate at 2,048 tokens; the plan says where they put its idle threshold
when that differs (estimated rates fall with length as attention grows).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from disagg_connectors.socket_connector.config import wire_ratio

from disagg.errors import PlanError
from disagg.hardware import DEVICES, PREFILL_UTILISATION, DeviceSpec, lookup_device
from disagg.kvmath import ModelArch, human_count, kv_dtype_bytes, resolve_model
from disagg.measurements import (
    NO_CONNECTOR,
    LinkMeasurement,
    engine_words,
    load_link,
    load_prefill,
    lookup_handoff,
    lookup_prefill,
)
from disagg.routecost import (
    FIRST_STEP_CPU_BYTES_PER_S,
    FIRST_STEP_CPU_SOURCE,
    EngineCost,
    LinkCost,
    break_even_tokens,
    exposed_transfer_s,
    first_step_s,
    first_true,
    handoff_fixed_s,
    handoff_fixed_source,
    last_true,
    max_transfer_s,
)
from disagg.topology import HostSpec, InstanceSpec, Topology, parse_rate
from disagg.units import fmt_bytes, fmt_count, fmt_rate, fmt_seconds

#: KV-cache bytes per second that the socket connector's fp8 wire format converts on CPU engines
#: (P quantizes as it serves, D dequantizes as it receives, each on the engine's one core beside
#: its own loop, one layer at a time so that the conversions overlap the wire): fitted to
#: benchmarks/connector_throughput.py's socket-fp8 rows (tiny-kvheavy, 512-8,000 tokens, emulated
#: 1 and 2.5 Gb/s, 2026-12-04) as handoff = wire bytes / min(link, this x the wire ratio); it
#: predicts all six of those transfers within 11%. (Fitted to the run of 2026-12-01, whose fp8
#: messages were a single block of one layer, it was 300 MB/s.)
FP8_CPU_CONVERT_BYTES_PER_S = 500e6
FP8_CPU_CONVERT_SOURCE = ("about 500 MB/s of KV cache, measured in one-core CPU engines by "
                          "benchmarks/connector_throughput.py on 2026-12-04")
#: the same for GPU engines, where the device converts: the slower side (P quantizing into host
#: staging) of benchmarks/wire_conversion_cost.py on one H200 (2026-12-04, Llama-3.1-8B-shaped bf16
#: cache, 2,048 and 8,000 tokens: 268 MB in 23 ms, 1,049 MB in 92 ms); other GPUs and PCIe links differ
FP8_GPU_CONVERT_BYTES_PER_S = 11e9
FP8_GPU_CONVERT_SOURCE = ("about 11 GB/s of KV cache, measured on one H200 by "
                          "benchmarks/wire_conversion_cost.py on 2026-12-04")
#: network round trips per handoff besides the bulk transfer (request the
#: blocks, the transfer's first byte, completion notice)
HANDOFF_ROUND_TRIPS = 3
#: the proxy's second HTTP request (to the decode engine), assumed
PROXY_HOP_S = 1e-3
#: longest prompt the break-even search considers
MAX_SEARCH_TOKENS = 1 << 20
#: fraction of GPU memory vLLM takes when the instance does not say
DEFAULT_GPU_MEMORY_UTILISATION = 0.9

#: a prefill instance and the decode instance it hands its KV to
Pair = tuple[InstanceSpec, InstanceSpec]

PAYS, MARGINAL, NO_PAY, DOES_NOT_FIT = "pays", "marginal", "does not pay", "does not fit"


@dataclass(frozen=True)
class LinkClass:
    """A kind of link with the rate a TCP (or RDMA) transfer actually reaches."""

    name: str
    label: str
    nominal_bps: float | None           # the line rate written on the box
    usable_bps: float                   # what a bulk transfer reaches
    rtt_s: float                        # typical round-trip time
    note: str


#: Practical rates (docs/the-one-question.md): TCP payload over 1500-byte
#: frames is ~94% of the line rate; RoCE reaches ~88%.
LINK_CLASSES: dict[str, LinkClass] = {c.name: c for c in (
    LinkClass("loopback", "loopback (same machine)", None, 4.3e9 * 8, 30e-6,
              "one TCP stream over loopback moved 4.3-5.2 GB/s here"),
    LinkClass("1gbe", "1 GbE, TCP", 1e9, 0.94e9, 200e-6, "TCP payload ~94% of line rate"),
    LinkClass("2.5gbe", "2.5 GbE, TCP", 2.5e9, 2.35e9, 200e-6, "TCP payload ~94% of line rate"),
    LinkClass("10gbe", "10 GbE, TCP", 10e9, 9.4e9, 100e-6, "TCP payload ~94% of line rate"),
    LinkClass("25gbe", "25 GbE, TCP", 25e9, 23.5e9, 50e-6, "needs several streams to fill"),
    LinkClass("100gbe", "100 GbE, TCP", 100e9, 94e9, 50e-6, "needs several streams and tuning"),
    LinkClass("thunderbolt", "Thunderbolt (IP)", None, 16e9, 100e-6,
              "IP over a Thunderbolt 4 cable reaches ~16 Gb/s"),
    LinkClass("roce-100g", "100 Gb RoCE", 100e9, 88e9, 10e-6, "RDMA reads reach 10-12 GB/s"),
    LinkClass("roce-200g", "200 Gb RoCE (ConnectX-7)", 200e9, 176e9, 10e-6, "~88% of line rate"),
)}

TCP_EFFICIENCY = 0.94
ROCE_EFFICIENCY = 0.88


@dataclass(frozen=True)
class LinkEstimate:
    """The rate and round-trip time the plan uses, and where they come from."""

    usable_bps: float
    rtt_s: float
    label: str
    measured: bool
    #: the connector's measured fixed cost per handoff (None: only the proxy's hop, PROXY_HOP_S)
    connector_fixed_s: float | None = None
    #: wire bytes per second the wire format's conversions sustain (P encodes, D decodes), when
    #: they, not the link, can be the limit (None: not modelled; see :func:`conversion_limit`)
    convert_wire_bps: float | None = None
    #: the decode engine's first step after a sequential handoff (:func:`disagg.routecost.first_step_s`):
    #: its part that does not depend on the prompt (reading the weights), seconds ...
    first_step_fixed_s: float = 0.0
    #: ... and the wire bytes per second at which its part that does (reading the prompt's KV) goes
    #: (None: not priced; a streamed handoff, or a decode host whose memory rate is unknown)
    first_step_wire_bps: float | None = None
    #: where the first step's memory rate comes from (what ``disagg plan`` prints beside it)
    first_step_source: str = ""
    #: the fixed cost ``disagg bench`` measured on this pair (:func:`disagg.measurements.lookup_handoff`):
    #: when set it is the whole of :attr:`fixed_s` (the connector's part, the first step's fixed part and
    #: the round trips, as measured), in place of the connector's seed; None: not measured
    measured_fixed_s: float | None = None
    #: where :attr:`measured_fixed_s` comes from (``measured on this pair <date> (<source>)``)
    measured_fixed_label: str = ""
    #: probed at two prompt lengths on this pair (:func:`disagg.measurements.fit_handoff`): what each
    #: wire byte adds to a split beyond :attr:`fixed_s` (the exposed transfer and the first step's
    #: read of the KV together), in place of their model; None: modelled
    measured_exposed_per_byte_s: float | None = None

    @property
    def round_trips_s(self) -> float:
        """The fixed cost's part that is the link's round trips (:data:`HANDOFF_ROUND_TRIPS`)."""
        return HANDOFF_ROUND_TRIPS * self.rtt_s

    @property
    def own_fixed_s(self) -> float:
        """The fixed cost's part that is the connector's (measured) or the proxy's hop (assumed)."""
        return PROXY_HOP_S if self.connector_fixed_s is None else self.connector_fixed_s

    @property
    def fixed_s(self) -> float:
        """Per-handoff cost that does not depend on the size (with the first step's fixed part): the
        pair's measured one when stored, else the sum of the seeded parts."""
        if self.measured_fixed_s is not None:
            return self.measured_fixed_s
        own = PROXY_HOP_S if self.connector_fixed_s is None else self.connector_fixed_s
        return HANDOFF_ROUND_TRIPS * self.rtt_s + own + self.first_step_fixed_s

    def first_step_kv_s(self, nbytes: float) -> float:
        """The first step's part that grows with the ``nbytes`` wire bytes of KV moved (0: not priced)."""
        return 0.0 if self.first_step_wire_bps is None else nbytes / self.first_step_wire_bps

    def added_s(self, nbytes: float, prefill_s: float, streaming_layers: int | None) -> float:
        """What handing over ``nbytes`` of wire bytes adds to a prefill of ``prefill_s`` seconds: the
        fixed cost, the transfer's exposed part (:meth:`exposed_s`) and the first step's read of
        the KV; the fixed cost and :attr:`measured_exposed_per_byte_s` per byte where the pair's
        handoff was probed at two lengths."""
        read_s = 0.0 if self.measured_exposed_per_byte_s is not None else self.first_step_kv_s(nbytes)
        return self.fixed_s + self.exposed_s(nbytes, prefill_s, streaming_layers) + read_s

    def exposed_s(self, nbytes: float, prefill_s: float, streaming_layers: int | None) -> float:
        """Of moving ``nbytes`` of wire bytes after (or, streamed over ``streaming_layers``, during)
        a prefill of ``prefill_s`` seconds, the part the prefill does not hide
        (:func:`disagg.routecost.exposed_transfer_s`); as measured on the pair where
        :attr:`measured_exposed_per_byte_s` is set (with the first step's read of the KV)."""
        if self.measured_exposed_per_byte_s is not None:
            return nbytes * self.measured_exposed_per_byte_s
        return exposed_transfer_s(nbytes / self.bytes_per_s, prefill_s, streaming_layers)

    @property
    def bytes_per_s(self) -> float:
        """Wire bytes per second a handoff moves: the link's usable rate, or the conversions'
        when slower (they run while the bytes cross, message by message)."""
        link = self.usable_bps / 8
        return link if self.convert_wire_bps is None else min(link, self.convert_wire_bps)

    def cost(self) -> LinkCost:
        """The handoff line the routing predictor uses (bytes per second: the link's, with the first
        step's read of the KV folded in, since both come after the prefill)."""
        rate = self.bytes_per_s
        if self.first_step_wire_bps is not None and self.measured_exposed_per_byte_s is None:
            rate = 1.0 / (1.0 / rate + 1.0 / self.first_step_wire_bps)
        return LinkCost(fixed_s=self.fixed_s, bytes_per_s=rate, exposed_per_byte_s=self.measured_exposed_per_byte_s)

    def handoff_s(self, nbytes: float) -> float:
        """Seconds to hand over ``nbytes`` of KV cache."""
        return self.cost().seconds(nbytes)


@dataclass(frozen=True)
class PrefillEstimate:
    """How long the prefill host takes for a prompt, measured or estimated."""

    label: str
    estimated: bool
    arch: ModelArch
    tokens_per_s: float | None = None   # measured rate
    flops_per_s: float | None = None    # effective FLOP/s for the estimate
    #: (a, b): a measured time ``a x n + b x n^2`` for an n-token prompt, fitted on the rates probed at
    #: two lengths (:meth:`disagg.measurements.PrefillMeasurement.fit`); None: ``n / tokens_per_s``
    shape: tuple[float, float] | None = None

    def seconds(self, tokens: int) -> float:
        """Prefill time for ``tokens`` prompt tokens."""
        if self.shape is not None:
            a, b = self.shape
            return a * tokens + b * tokens * tokens
        if self.tokens_per_s is not None:
            return tokens / self.tokens_per_s
        assert self.flops_per_s is not None
        return self.arch.prefill_flops(tokens) / self.flops_per_s

    def rate(self, tokens: int = 2048) -> float:
        """Tokens per second at ``tokens``: the measured rate (from its fitted time where it was
        probed at two lengths), or the estimate's (attention makes a rate fall with the prompt's
        length)."""
        if self.tokens_per_s is not None and self.shape is None:
            return self.tokens_per_s
        return tokens / self.seconds(tokens)

    def cost(self, tokens: int = 2048) -> EngineCost:
        """An idle engine at this rate, for the routing predictor."""
        return EngineCost(tokens_per_s=self.rate(tokens))


@dataclass(frozen=True)
class MemoryEstimate:
    """KV memory on the decode host (None when unknown)."""

    kv_bytes: float | None
    label: str


@dataclass(frozen=True)
class ClassPlan:
    """The answer for one prompt class."""

    prompt_tokens: int
    output_tokens: int
    kv_bytes: int
    handoff_s: float                    # what the split adds to the prefill: fixed + exposed_s
    prefill_s: float
    verdict: str
    reason: str
    conversations: int | None           # that fit in the decode host's KV memory
    transfer_s: float                   # kv_bytes over the link, on its own
    exposed_s: float                    # of transfer_s, what the prefill does not hide (all unless streamed)
    #: the decode host prefilling the prompt itself (None: unknown, taken as long as prefill_s)
    local_s: float | None = None

    @property
    def split_s(self) -> float:
        """When the split's first token can come: the prefill host's prefill, then the handoff."""
        return self.prefill_s + self.handoff_s

    @property
    def local_prefill_s(self) -> float:
        """The decode host prefilling the prompt itself (the prefill host's time when unknown)."""
        return self.prefill_s if self.local_s is None else self.local_s

    @property
    def ratio(self) -> float:
        """handoff / the prefill it takes off the decode host (above 1: does not pay)."""
        return self.handoff_s / self.local_prefill_s


@dataclass(frozen=True)
class Plan:
    """Everything ``disagg plan`` prints."""

    model: ModelArch
    kv_dtype: str
    link: LinkEstimate
    prefill: PrefillEstimate
    memory: MemoryEstimate
    classes: tuple[ClassPlan, ...]
    break_even_tokens: int | None       # shortest prompt whose handoff costs no more than a local prefill
    pays_from_tokens: int | None        # shortest prompt the split answers no later than a local prefill
    search_limit: int = MAX_SEARCH_TOKENS  # longest prompt the break-even search considered
    notes: tuple[str, ...] = ()
    #: the decode host's own prefill (local prefill), when known
    decode_prefill: PrefillEstimate | None = None
    #: the shortest prompt the proxy's auto routing splits at idle load (None: none up to search_limit)
    idle_split_from_tokens: int | None = None
    #: how the KV crosses the link (``connector.wire_format``); ``classes[].kv_bytes`` are wire bytes
    wire_format: str = "raw"
    #: the model's layers when the KV is streamed layer by layer while the prefill computes (the
    #: socket connector's ``streaming``); None: it is sent after the prefill
    streaming_layers: int | None = None
    #: shortest and longest prompt the split answers no later than the decode host prefilling it (None: none)
    pays_span: tuple[int, int] | None = None
    #: shortest and longest prompt whose handoff costs no more than the decode host's own prefill
    worth_span: tuple[int, int] | None = None
    #: where the weights do not fit a host: why (every row then says so, with no verdict)
    not_fit: str | None = None
    #: the idle split threshold the proxy starts from: its seeds, rates at 2,048 tokens
    seed_split_from_tokens: int | None = None
    #: the longest prompt one conversation of which fits in the decode host's KV memory (None: unknown)
    fit_max_tokens: int | None = None

    @property
    def streaming(self) -> bool:
        """Whether the handoff is streamed while the prefill computes."""
        return self.streaming_layers is not None

    @property
    def fixed_source(self) -> str | None:
        """Where the handoff's fixed cost comes from: this pair's measurement, the connector's seed,
        or None (no connector: the proxy's hop, assumed)."""
        if self.link.measured_fixed_s is not None:
            return self.link.measured_fixed_label
        if self.link.connector_fixed_s is None:
            return None
        return handoff_fixed_source(self.streaming_layers is not None)

    @property
    def wire_bytes_per_token(self) -> float:
        """Bytes one prompt token puts on the link (full-attention layers; the KV cache's bytes
        times the wire format's ratio)."""
        return self.model.kv_bytes_per_token(self.kv_dtype) * wire_ratio_of(self.wire_format, self.kv_dtype)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary (times in seconds, sizes in bytes, rates in bit/s)."""
        m = self.model
        return {
            "model": {"name": m.name, "source": m.source, "attention": m.attention, "layers": m.layers,
                      "kv_heads": m.kv_heads, "head_dim": m.head_dim, "kv_lora_rank": m.kv_lora_rank,
                      "rope_dim": m.rope_dim, "sliding_window": m.sliding_window,
                      "sliding_layers": len(m.sliding_layers), "params": m.params,
                      "active_params": m.active_params},
            "kv_dtype": self.kv_dtype,
            "kv_bytes_per_token": m.kv_bytes_per_token(self.kv_dtype),
            "wire_format": self.wire_format,
            "wire_bytes_per_token": self.wire_bytes_per_token,
            "streaming": self.streaming,
            "streaming_layers": self.streaming_layers,
            "link": {"usable_bps": self.link.usable_bps, "rtt_s": self.link.rtt_s,
                     "handoff_bytes_per_s": self.link.bytes_per_s,
                     "convert_wire_bytes_per_s": self.link.convert_wire_bps,
                     "first_step_fixed_s": self.link.first_step_fixed_s,
                     "first_step_wire_bytes_per_s": self.link.first_step_wire_bps,
                     "fixed_s": self.link.fixed_s, "measured": self.link.measured, "source": self.link.label},
            "prefill": {"estimated": self.prefill.estimated, "source": self.prefill.label,
                        "tokens_per_s": self.prefill.tokens_per_s, "flops_per_s": self.prefill.flops_per_s},
            "decode_memory": {"kv_bytes": self.memory.kv_bytes, "source": self.memory.label},
            "classes": [{"prompt_tokens": c.prompt_tokens, "output_tokens": c.output_tokens,
                         "kv_bytes": c.kv_bytes, "handoff_s": c.handoff_s, "transfer_s": c.transfer_s,
                         "exposed_handoff_s": c.exposed_s, "prefill_s": c.prefill_s,
                         "split_s": c.split_s, "local_prefill_s": c.local_s,
                         "ratio": c.ratio, "verdict": c.verdict, "reason": c.reason,
                         "conversations_fit": c.conversations} for c in self.classes],
            "break_even_prompt_tokens": self.break_even_tokens,
            "handoff_fixed_source": self.fixed_source,
            "decode_prefill": None if self.decode_prefill is None else {
                "estimated": self.decode_prefill.estimated, "source": self.decode_prefill.label,
                "tokens_per_s": self.decode_prefill.rate()},
            "idle_split_from_prompt_tokens": self.idle_split_from_tokens,
            "pays_from_prompt_tokens": self.pays_from_tokens,
            "pays_span_prompt_tokens": None if self.pays_span is None else list(self.pays_span),
            "handoff_below_local_span_prompt_tokens": None if self.worth_span is None else list(self.worth_span),
            "fit_max_prompt_tokens": self.fit_max_tokens,
            "proxy_seed_split_from_prompt_tokens": self.seed_split_from_tokens,
            "does_not_fit": self.not_fit,
            "search_limit_tokens": self.search_limit,
            "notes": list(self.notes),
        }


# --- the arithmetic --------------------------------------------------------------

def _percent(ratio: float) -> str:
    return "<1%" if ratio < 0.01 else f"{ratio:.0%}"


def verdict_for(handoff_s: float, prefill_s: float, nbytes: float, link: LinkEstimate,
                conversations: int | None = None, streaming_layers: int | None = None,
                local_s: float | None = None) -> tuple[str, str]:
    """(verdict, one-line reason) for one request; ``conversations`` = 0 means it cannot fit.
    ``handoff_s``: what the split adds to the prefill host's ``prefill_s``; ``local_s``: the decode
    host prefilling the prompt itself (None: as long as ``prefill_s``, alike hosts);
    ``streaming_layers``: the KV is streamed over that many layers while the prefill computes
    (None: sent after it).

    *pays*: the split (prefill + handoff) answers no later than the decode host prefilling the
    prompt itself; *marginal*: it answers later, but moving the KV costs less than the prefill it
    takes off the decode host (worth it when that host is busy decoding); *does not pay*: moving
    the KV takes longer than the decode host computing it."""
    local = prefill_s if local_s is None else local_s
    split = prefill_s + handoff_s
    if streaming_layers is None:
        moving = f"moving {fmt_bytes(nbytes)} takes {fmt_seconds(handoff_s)}"
    else:
        moving = (f"streaming {fmt_bytes(nbytes)} ({fmt_seconds(nbytes / link.bytes_per_s)} on the link alone) "
                  f"adds {fmt_seconds(handoff_s)}")
    if conversations == 0:
        return NO_PAY, "not one conversation of this length fits in the decode host's KV memory"
    answers = (f"{moving}; the split answers in {fmt_seconds(split)} ({fmt_seconds(prefill_s)} prefill + "
               "handoff)")
    if split <= local:
        return PAYS, (f"{answers}, no later than the {fmt_seconds(local)} the decode host takes to prefill "
                      "it itself")
    if handoff_s <= local:
        return MARGINAL, (f"{answers}, {fmt_seconds(split - local)} later than the decode host prefilling it "
                          f"itself ({fmt_seconds(local)}), but it takes that prefill off the decode host")
    # the longest transfer with which the split answers no later than the local prefill
    budget = max_transfer_s(local - prefill_s - link.fixed_s, prefill_s, streaming_layers)
    need = (f"; the link would need {fmt_rate(nbytes * 8 / budget)} for the split to answer sooner"
            if budget > 0 else "")
    return NO_PAY, (f"{moving}, longer than the {fmt_seconds(local)} the decode host takes to prefill it "
                    f"itself{need}")


def span(holds: Callable[[int], bool], limit: int, also: Sequence[int] = ()) -> tuple[int, int] | None:
    """The shortest and longest prompt in 1..``limit`` for which ``holds``, or None: ``holds`` is
    tried on a geometric grid (8 lengths per doubling, with ``also``), its ends are then found by
    bisection between grid points. It does not assume ``holds`` stays true as prompts grow (a
    split can pay for mid-length prompts only, or stop paying as attention grows)."""
    grid = sorted({1, limit, *(n for n in also if 1 <= n <= limit),
                   *(round(2 ** (i / 8)) for i in range(8 * max(limit, 1).bit_length() + 1)
                     if 2 ** (i / 8) <= limit)})
    marks = [holds(n) for n in grid]
    if not any(marks):
        return None
    first = marks.index(True)
    last = len(marks) - 1 - marks[::-1].index(True)
    low = first_true(holds, grid[first - 1] + 1 if first else 1, grid[first])
    high = last_true(holds, grid[last], grid[last + 1] - 1 if last + 1 < len(grid) else grid[last])
    return low, high


def wire_ratio_of(wire_format: str, kv_dtype: str) -> float:
    """Bytes on the link per byte of KV cache (the socket connector's formats); PlanError when the
    format cannot carry this cache (fp8 over an fp8 cache)."""
    try:
        return float(wire_ratio(wire_format, kv_dtype_bytes(kv_dtype)))
    except ValueError as exc:
        raise PlanError(f"KV cache {kv_dtype}: {exc}") from None


def conversion_limit(link: LinkEstimate, wire_format: str, kv_dtype: str, cpu_converts: bool,
                     notes: list[str]) -> LinkEstimate:
    """``link`` with the wire format's conversion rate as a second limit (a note says which).

    fp8 converts at :data:`FP8_CPU_CONVERT_BYTES_PER_S` of cache on CPU engines (their one core)
    and :data:`FP8_GPU_CONVERT_BYTES_PER_S` on GPU engines (the device; measured on one H200).
    ``cpu_converts``: either engine of the pair runs on a CPU: the slower side's conversions set
    the rate (a CPU prefill engine feeding a GPU decode engine quantizes on its core).
    """
    if wire_format == "raw":
        return link
    rate, source = ((FP8_CPU_CONVERT_BYTES_PER_S, FP8_CPU_CONVERT_SOURCE) if cpu_converts
                    else (FP8_GPU_CONVERT_BYTES_PER_S, FP8_GPU_CONVERT_SOURCE))
    limit = rate * wire_ratio_of(wire_format, kv_dtype)
    if limit < link.usable_bps / 8:
        where = "a CPU engine" if cpu_converts else "GPU engines"
        notes.append(f"wire_format {wire_format} on {where}: the conversions, not the link, set the handoff's "
                     f"rate ({fmt_rate(limit * 8)} on the wire; {source})")
    return replace(link, convert_wire_bps=limit)


def make_plan(arch: ModelArch, kv_dtype: str, link: LinkEstimate, prefill: PrefillEstimate,
              memory: MemoryEstimate, prompt_tokens: Sequence[int], output_tokens: int,
              notes: Sequence[str] = (), max_prompt_tokens: int | None = None,
              decode_prefill: PrefillEstimate | None = None, wire_format: str = "raw",
              streaming_layers: int | None = None, not_fit: str | None = None) -> Plan:
    """Work out every prompt class; the pure arithmetic behind ``disagg plan``.

    One answer for rows, summary and routing line: a prompt's split answers at the prefill host's
    prefill + the handoff (:meth:`LinkEstimate.added_s`), its local prefill at ``decode_prefill``'s
    time (the decode host prefilling it itself; without it the prefill host's, alike hosts); the
    split *pays* where it answers no later (:func:`verdict_for`). The spans (:func:`span`) stop at
    ``max_prompt_tokens`` (the model's context limit, when known) or :data:`MAX_SEARCH_TOKENS`.
    ``wire_format``: what crosses the link (``fp8``: about half a 16-bit cache's bytes).
    ``streaming_layers``: the KV is streamed over that many layers while the prefill computes,
    so a split adds only the fixed cost and the transfer's exposed part
    (:func:`disagg.routecost.exposed_transfer_s`); None: sent after the prefill, all of it.
    ``not_fit``: the weights do not fit a host (why): every row says so, with no verdict.
    """
    limit = max_prompt_tokens or MAX_SEARCH_TOKENS
    to_wire = wire_ratio_of(wire_format, kv_dtype)
    local = decode_prefill or prefill

    def moved(n: int) -> float:
        return arch.kv_bytes(n, kv_dtype) * to_wire

    def handoff(n: int) -> float:
        return link.added_s(moved(n), prefill.seconds(n), streaming_layers)

    classes = []
    for n in prompt_tokens:
        nbytes = round(moved(n))
        pre = prefill.seconds(n)
        transfer = nbytes / link.bytes_per_s
        exposed = link.exposed_s(nbytes, pre, streaming_layers)
        fit = None
        if memory.kv_bytes is not None:
            fit = int(max(memory.kv_bytes, 0) // arch.kv_bytes(n + output_tokens, kv_dtype))
        handoff_s = link.added_s(nbytes, pre, streaming_layers)
        local_s = None if decode_prefill is None else decode_prefill.seconds(n)
        if not_fit is not None:
            verdict, reason = DOES_NOT_FIT, not_fit
        else:
            verdict, reason = verdict_for(handoff_s, pre, nbytes, link, fit, streaming_layers, local_s)
        classes.append(ClassPlan(n, output_tokens, nbytes, handoff_s, pre, verdict, reason, fit,
                                 transfer_s=transfer, exposed_s=exposed, local_s=local_s))
    def fits(n: int) -> bool:       # one conversation of n prompt tokens fits in the decode host's KV memory
        return memory.kv_bytes is None or arch.kv_bytes(n + output_tokens, kv_dtype) <= memory.kv_bytes

    pays = worth = None
    fit_max = None if memory.kv_bytes is None else (span(fits, limit) or (0, 0))[1]
    if not_fit is None:
        rows = list(prompt_tokens)
        pays = span(lambda n: fits(n) and prefill.seconds(n) + handoff(n) <= local.seconds(n), limit, rows)
        worth = span(lambda n: fits(n) and handoff(n) <= local.seconds(n), limit, rows)
    seed = None
    if decode_prefill is not None and not_fit is None:
        link_cost = replace(link.cost(), streaming_layers=streaming_layers)
        seed = break_even_tokens(moved, prefill.cost(), decode_prefill.cost(), link_cost, limit)
    return Plan(model=arch, kv_dtype=kv_dtype, link=link, prefill=prefill, memory=memory,
                classes=tuple(classes),
                break_even_tokens=None if worth is None else worth[0],
                pays_from_tokens=None if pays is None else pays[0],
                search_limit=limit, notes=tuple(notes), decode_prefill=decode_prefill,
                idle_split_from_tokens=None if decode_prefill is None or pays is None else pays[0],
                wire_format=wire_format, streaming_layers=streaming_layers,
                pays_span=pays, worth_span=worth, not_fit=not_fit, seed_split_from_tokens=seed,
                fit_max_tokens=fit_max)


# --- from a topology -------------------------------------------------------------

def link_class_estimate(name: str) -> LinkEstimate:
    """The nominal estimate for a named link class (``10gbe``, ``roce-100g``...) or a line rate
    (``5gbe``, ``2.5gb``, ``940mbit``, ``10gbit``, ``1.2GB/s``: :func:`parse_link_rate`)."""
    if name in LINK_CLASSES:
        c = LINK_CLASSES[name]
        return LinkEstimate(c.usable_bps, c.rtt_s, f"{c.label}: {fmt_rate(c.usable_bps)} usable "
                            f"(nominal table: {c.note})", measured=False)
    bps = parse_link_rate(name)
    if bps is None:
        from disagg.yamlsrc import did_you_mean
        raise PlanError(f"unknown link {name!r}; expected a link class ({', '.join(LINK_CLASSES)}) or a line "
                        "rate such as 5gbe, 2.5gbit, 940mbit or 1.2GB/s" + did_you_mean(name.lower(), LINK_CLASSES))
    for c in LINK_CLASSES.values():
        if c.nominal_bps == bps and not c.name.startswith("roce"):
            return LinkEstimate(c.usable_bps, c.rtt_s, f"{name}, {c.label}: {fmt_rate(c.usable_bps)} usable "
                                f"(nominal table: {c.note})", measured=False)
    usable = bps * TCP_EFFICIENCY
    rtt = 200e-6 if bps <= 2.5e9 else 100e-6 if bps <= 10e9 else 50e-6
    return LinkEstimate(usable, rtt, f"{name} ({fmt_rate(bps)} line rate), TCP: {fmt_rate(usable)} usable "
                        "(nominal: TCP payload ~94% of line rate)", measured=False)


_LINK_RATE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)\s*(bE|be|BE|b|bit|bits|bps|b/s|bit/s|B|Bps|B/s)")


def parse_link_rate(text: str) -> float | None:
    """A line rate in bits per second from ``5gbe``, ``2.5gb``, ``5gbit``, ``940mbit``, ``10gbit/s``
    or ``1.2GB/s`` (a capital B: bytes), or None. The number and prefix go through the topology's
    own ``link.rate`` parser (:func:`disagg.topology.parse_rate`)."""
    match = _LINK_RATE_RE.fullmatch(text.strip())
    if match is None:
        return None
    number, prefix, unit = match.groups()
    try:
        bps = parse_rate(f"{number}{prefix.lower()}bit")
    except ValueError:
        return None
    return bps * 8 if unit.startswith("B") and unit != "BE" else bps


def nominal_link(topo: Topology) -> LinkEstimate:
    """The link rate the topology implies, from the nominal table."""
    link = topo.link
    if link.type == "loopback":
        return link_class_estimate("loopback")
    if link.rate_bps is None:
        raise PlanError(f"{topo.file}: link.rate is missing: write the line rate (e.g. rate: 10gbit) "
                        "or run `disagg probe-link` to measure it")
    for c in LINK_CLASSES.values():
        if c.nominal_bps == link.rate_bps and (c.name.startswith("roce") == (link.type == "roce")):
            return LinkEstimate(c.usable_bps, c.rtt_s, f"{link.type} {link.rate_text}: "
                                f"{fmt_rate(c.usable_bps)} usable (nominal table: {c.note})", measured=False)
    if link.type == "roce":
        eff, rtt, why = ROCE_EFFICIENCY, 10e-6, "RoCE ~88% of line rate"
    elif link.type == "emulated":
        eff, rtt, why = TCP_EFFICIENCY, 100e-6, "tbf-shaped TCP ~94% of the shaped rate"
    else:
        eff, rtt, why = TCP_EFFICIENCY, 200e-6, "TCP payload ~94% of line rate"
    usable = link.rate_bps * eff
    return LinkEstimate(usable, rtt, f"{link.type} {link.rate_text}: {fmt_rate(usable)} usable "
                        f"(nominal: {why})", measured=False)


def measured_link(probe: LinkMeasurement) -> LinkEstimate:
    """The link as ``disagg probe-link`` measured it (best stream count)."""
    return LinkEstimate(probe.best_bps, probe.rtt_s,
                        f"measured by probe-link {probe.measured_at}: {fmt_rate(probe.best_bps)} "
                        f"with {probe.best_streams} stream(s), RTT {fmt_seconds(probe.rtt_s)}",
                        measured=True)


def first_pair(topo: Topology) -> tuple[InstanceSpec, InstanceSpec]:
    """The first prefill and first decode instance (the pair plan and probe-link look at)."""
    if topo.colocated:
        raise PlanError(f"{topo.file}: a colocated topology (roles.both) moves no KV cache; "
                        "plan a topology with prefill and decode roles")
    return topo.role("prefill")[0], topo.role("decode")[0]


def plan_pairs(topo: Topology) -> list[tuple[InstanceSpec, InstanceSpec]]:
    """Every prefill -> decode pair the proxy can route a split over, one per distinct pair of hosts
    and engine settings (two prefill engines alike on one host give one plan), first pair first."""
    first_pair(topo)
    seen: set[tuple[object, ...]] = set()
    out = []
    for p in topo.role("prefill"):
        for d in topo.role("decode"):
            key = (p.host, d.host, p.args, d.args, p.env, d.env, len(p.gpus), len(d.gpus), len(p.cpus), len(d.cpus))
            if key not in seen:
                seen.add(key)
                out.append((p, d))
    return out


def host_device(host: HostSpec) -> DeviceSpec | None:
    """The spec sheet for a host: its own (``gpu: {tflops, memory_gb}``), its ``gpu``'s, the CPU
    entry, or None (cuda, no gpu given)."""
    if host.gpu_spec is not None:
        return host.gpu_spec
    if host.gpu:
        return lookup_device(host.gpu)
    return DEVICES["cpu"] if host.device == "cpu" else None


def prefill_estimate(topo: Topology, arch: ModelArch, run_dir: str | None = None,
                     role: str = "prefill", pair: Pair | None = None) -> PrefillEstimate:
    """The measured prefill rate for the first ``role`` instance's host if stored for the
    topology's ``model.dtype``, else the spec estimate (``role`` decode: how fast the decode host
    prefills a prompt itself)."""
    p_inst, d_inst = pair or first_pair(topo)
    inst = p_inst if role == "prefill" else d_inst
    return host_prefill(topo, arch, topo.host_of(inst), run_dir, connector=engine_connector(topo, inst))


def engine_connector(topo: Topology, inst: InstanceSpec) -> str:
    """The KV connector ``inst``'s engine runs: the topology's for a prefill or decode engine,
    :data:`disagg.measurements.NO_CONNECTOR` for a colocated one (``roles.both``). Measured prefill
    rates and decode steps are kept per host and this (:mod:`disagg.measurements`)."""
    return NO_CONNECTOR if inst.role == "both" else topo.connector


def host_prefill(topo: Topology, arch: ModelArch, host: HostSpec, run_dir: str | None = None,
                 connector: str = NO_CONNECTOR) -> PrefillEstimate:
    """How fast one engine of ``host`` running ``connector`` (:func:`engine_connector`) prefills:
    the rate ``disagg bench`` stored for the topology's served model and ``model.dtype`` on that
    kind of engine (else on another kind of the same host, labelled so:
    :func:`disagg.measurements.lookup_prefill`), else the spec-sheet estimate. A host that emulates
    its prefill speed (``emulate.prefill_rate`` or ``cpu_share``) has no estimate: its stated rate is
    what the emulation aims at, not what the engines reach, so without a measurement this is a
    PlanError saying how to measure it. Called by :func:`prefill_estimate` and the workload model
    (:mod:`disagg.workload_plan`)."""
    from disagg.engines.vllm import served_model_name

    model = served_model_name(topo)
    found = lookup_prefill(run_dir or topo.run_dir, model, host.name, topo.model.dtype, connector)
    if found is not None:
        other = ("" if found.connector in (connector, "") else
                 f"; measured on {found.engine}, none stored for {engine_words(connector)}")
        shape = found.fit()
        lengths = "" if shape is None else (" and " + " and ".join(f"{n:,.0f}" for n, _ in found.points[1:])
                                             + " tokens")
        return PrefillEstimate(f"measured on {host.name}: {found.prompt_tokens_per_s:,.0f} prompt tokens/s"
                               f"{lengths} ({found.source}, {found.measured_at}{other})", estimated=False, arch=arch,
                               tokens_per_s=found.prompt_tokens_per_s, shape=shape)
    stored = next((m for m in load_prefill(run_dir or topo.run_dir).get(model, {}).values() if m.host == host.name),
                  None)
    emulated = host.emulate
    if emulated is not None and (emulated.prefill_rate is not None or emulated.cpu_share is not None):
        raise PlanError(f"hosts.{host.name} is emulated ({emulated.describe()}) and its prefill rate has not "
                        f"been measured: plan never uses the stated rate; measure it on the running engines: "
                        f"{MEASURE_HINT.format(file=topo.file)}; or `disagg bench serve URL --prefill-host "
                        f"{host.name} --prefill-probe 3` against that host's engine (its prefill rate only)")
    spec = host_device(host)
    if spec is None:
        raise PlanError(f"{topo.file}: hosts.{host.name}: device: cuda but no gpu: field; add "
                        f"gpu: (one of {', '.join(n for n in DEVICES if n != 'cpu')}) for an estimate, "
                        "or measure the prefill rate with `disagg bench`")
    estimate = device_prefill(spec, arch, f"for {host.name} ")
    if stored is not None:      # stored, but measured with another dtype: say why it is not used
        estimate = replace(estimate, label=f"{estimate.label} (the rate stored for {host.name}, "
                           f"{stored.prompt_tokens_per_s:,.0f} tokens/s, was measured in {stored.dtype}; "
                           f"this topology runs {topo.model.dtype})")
    return estimate


def device_prefill(spec: DeviceSpec, arch: ModelArch, who: str = "") -> PrefillEstimate:
    """The spec-sheet prefill estimate for ``arch`` on a device (peak x PREFILL_UTILISATION)."""
    return PrefillEstimate(
        f"ESTIMATE {who}({spec.label}, {spec.bf16_tflops:g} TFLOP/s bf16 peak at "
        f"{PREFILL_UTILISATION:.0%}): 2 x {human_count(arch.active_params)} params x tokens + attention; "
        "`disagg bench` measures it", estimated=True, arch=arch,
        flops_per_s=spec.bf16_flops * PREFILL_UTILISATION)


def decode_memory(topo: Topology, arch: ModelArch, pair: Pair | None = None) -> MemoryEstimate:
    """KV memory on the decode host: ``kv_memory_gb``, vLLM's CPU KV space, or a GPU estimate."""
    _, inst = pair or first_pair(topo)
    return engine_memory(topo, arch, inst)


def engine_memory(topo: Topology, arch: ModelArch, inst: InstanceSpec) -> MemoryEstimate:
    """KV memory of one engine (``inst``): an emulated host's ``emulate.kv_memory`` (enforced per
    engine through ``--kv-cache-memory-bytes``), the host's ``kv_memory_gb``, vLLM's CPU KV space,
    or a GPU estimate. Called by :func:`decode_memory` and the workload model."""
    from disagg.engines.vllm import DEFAULT_CPU_KVCACHE_GIB

    host = topo.host_of(inst)
    if host.emulate is not None and host.emulate.kv_memory_bytes is not None:
        return MemoryEstimate(float(host.emulate.kv_memory_bytes),
                              f"{host.name}: emulated, {fmt_bytes(host.emulate.kv_memory_bytes)} per engine "
                              "(emulate.kv_memory, enforced by --kv-cache-memory-bytes)")
    if host.kv_memory_gb is not None:
        return MemoryEstimate(host.kv_memory_gb * 1e9, f"{host.name}: kv_memory_gb {host.kv_memory_gb:g} "
                              "from the topology")
    if host.device == "cpu":
        gib = float(dict(inst.env).get("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB))
        return MemoryEstimate(gib * 2**30, f"{host.name}: VLLM_CPU_KVCACHE_SPACE {gib:g} GiB")
    spec = host_device(host)
    if spec is None or spec.memory_gb is None:
        return MemoryEstimate(None, f"{host.name}: unknown (add gpu: or kv_memory_gb: to the host)")
    util = float(inst.arg("--gpu-memory-utilization") or DEFAULT_GPU_MEMORY_UTILISATION)
    weight_bytes = model_weight_bytes(topo, arch)
    gpus = max(1, len(inst.gpus))
    kv = spec.memory_gb * 1e9 * util * gpus - weight_bytes
    label = (f"{host.name}: ESTIMATE {'' if gpus == 1 else f'{gpus} x '}{spec.memory_gb:g} GB x {util:g} - "
             f"{weight_bytes / 1e9:.1f} GB weights"
             + ("; the weights do not fit" if kv <= 0 else "; set kv_memory_gb to be exact"))
    return MemoryEstimate(max(kv, 0.0), label)


def model_weight_bytes(topo: Topology, arch: ModelArch, params: float | None = None) -> float:
    """Bytes of ``params`` (default: all the model's) in the topology's model dtype."""
    return (arch.params if params is None else params) * (4 if topo.model.dtype == "float32" else 2)


def first_step(topo: Topology, arch: ModelArch, link: LinkEstimate, kv_dtype: str, wire_format: str,
               notes: list[str], pair: Pair | None = None) -> LinkEstimate:
    """``link`` with the decode engine's first step after a sequential handoff priced
    (:func:`disagg.routecost.first_step_s`): its active weights and the prompt's KV read at the decode
    host's memory rate (a CPU engine: :data:`FIRST_STEP_CPU_BYTES_PER_S`, one core; a GPU: its
    spec-sheet bandwidth, an estimate). A CPU engine's rate is priced per core it is pinned to
    (``cpus``); an unpinned one's is unknown. A note says where the rate comes from, or that it is
    unknown."""
    _, inst = pair or first_pair(topo)
    host = topo.host_of(inst)
    if host.device == "cpu":
        if not inst.cpus:
            notes.append("decode's first step after the handoff is not priced: the decode engine is not pinned "
                         "to cores (cpus:), so its memory rate is unknown")
            return link
        rate = FIRST_STEP_CPU_BYTES_PER_S * len(inst.cpus)
        source = f"{FIRST_STEP_CPU_SOURCE}; x {len(inst.cpus)} pinned core(s)"
    else:
        spec = host_device(host)
        if spec is None or spec.memory_gbps is None:
            notes.append(f"decode's first step after the handoff is not priced: {host.name}'s memory rate is "
                         "unknown (add gpu: to the host)")
            return link
        rate, source = (spec.memory_gbps * 1e9, f"ESTIMATE, read at {spec.label}'s spec-sheet "
                        f"{spec.memory_gbps:g} GB/s")
    weights = model_weight_bytes(topo, arch, arch.active_params)
    fixed = first_step_s(weights, 0.0, rate)
    notes.append(f"the handoff includes decode's first step (vLLM recomputes the last prompt token there): "
                 f"{fmt_bytes(weights)} of weights and the prompt's KV, {fmt_seconds(fixed)} + "
                 f"{fmt_seconds(first_step_s(0.0, 1e9, rate))} per GB of KV ({source})")
    return replace(link, first_step_fixed_s=fixed, first_step_wire_bps=rate * wire_ratio_of(wire_format, kv_dtype),
                   first_step_source=f"{fmt_bytes(weights)} of weights: {source}")


def kv_cache_dtype(topo: Topology, pair: Pair | None = None) -> str:
    """``--kv-cache-dtype`` from the decode instance's args, else the model dtype."""
    _, inst = pair or first_pair(topo)
    given = inst.arg("--kv-cache-dtype")
    if given and given != "auto":
        return given
    return "float32" if topo.model.dtype == "float32" else (
        "float16" if topo.model.dtype == "float16" else "bfloat16")


def plan_topology(topo: Topology, prompt_tokens: Sequence[int], output_tokens: int, *,
                  model: str | None = None, link_class: str | None = None, kv_dtype: str | None = None,
                  use_probe: bool = True, run_dir: str | None = None, wire_format: str | None = None,
                  streaming: bool | None = None, pair: Pair | None = None, use_measured_handoff: bool = True) -> Plan:
    """The plan for a topology, with optional what-if overrides (model, link class, KV dtype, wire format,
    ``streaming``: the KV streamed layer by layer while the prefill computes, socket connector only;
    None: the topology's ``connector.streaming``); ``pair``: the (prefill, decode) instances to plan
    (:func:`plan_pairs`; default :func:`first_pair`); ``use_measured_handoff``: False prices the
    handoff by the model alone, not the pair's stored measurement (:func:`pair_handoff`; the
    handoff probe subtracts the model's part)."""
    arch = resolve_model(model or topo.model.source, local_path=None if model else topo.model.path)
    prefill_inst, decode_inst = pair = pair or first_pair(topo)
    limit = topo.model.max_model_len
    if limit is not None and (beyond := [n for n in prompt_tokens if n > limit]):
        raise PlanError(f"--prompt-tokens {', '.join(fmt_count(n) for n in beyond)}: longer than the topology's "
                        f"max_model_len ({fmt_count(limit)} tokens in {topo.file}); vLLM refuses such prompts")
    notes: list[str] = []
    probe = load_link(topo.file) if use_probe and not link_class else None
    if probe is not None and (probe.prefill_host, probe.decode_host) != (prefill_inst.host, decode_inst.host):
        notes.append(f"ignored the probe-link result: it measured {probe.prefill_host} -> {probe.decode_host}")
        probe = None
    if link_class:
        link = link_class_estimate(link_class)
    elif probe is not None:
        link = measured_link(probe)
    else:
        link = nominal_link(topo)
        notes.append("link rate from the nominal table; `disagg probe-link` measures the real one")
    streamed = topo.streaming if streaming is None else streaming
    link = replace(link, connector_fixed_s=handoff_fixed_s(topo.connector, streaming=streamed))
    prefill = prefill_estimate(topo, arch, run_dir, pair=pair)
    if prefill.estimated:
        notes.append("prefill times are ESTIMATES from the device's spec sheet; `disagg bench` measures them")
    try:
        decode_prefill: PrefillEstimate | None = prefill_estimate(topo, arch, run_dir, role="decode", pair=pair)
    except PlanError as exc:
        decode_prefill = None
        notes.append(f"no idle routing break-even: the decode host's prefill rate is unknown ({exc})")
    if arch.sliding_layers:
        notes.append(f"{len(arch.sliding_layers)} of {arch.layers} layers keep only the last "
                     f"{arch.sliding_window} tokens, so long prompts move less KV per token")
    dtype = kv_dtype or kv_cache_dtype(topo, pair)
    wire = wire_format or topo.wire_format
    if wire != "raw" and topo.connector != "socket":
        notes.append(f"wire_format {wire} is the socket connector's; connector {topo.connector} sends the "
                     "cache's own bytes")
    else:
        cpu_side = any(topo.host_of(inst).device == "cpu" for inst in (prefill_inst, decode_inst))
        link = conversion_limit(link, wire, dtype, cpu_side, notes)
    if streamed and topo.connector != "socket":
        raise PlanError(f"{topo.file}: a streamed handoff is the socket connector's (connector.streaming); "
                        f"connector {topo.connector} sends the KV after the prefill")
    layers = arch.layers if streamed else None
    if layers is not None:
        notes.append(streaming_note(layers))
    else:
        link = first_step(topo, arch, link, dtype, wire, notes, pair)
    if model is None and use_measured_handoff:      # a what-if model has other weights, so another first step
        link = pair_handoff(topo, link, pair, run_dir, streamed)
    return make_plan(arch, dtype, link, prefill, decode_memory(topo, arch, pair), prompt_tokens,
                     output_tokens, notes, max_prompt_tokens=topo.model.max_model_len,
                     decode_prefill=decode_prefill, wire_format=wire, streaming_layers=layers,
                     not_fit=weights_do_not_fit(topo, arch, pair))


def pair_handoff(topo: Topology, link: LinkEstimate, pair: Pair, run_dir: str | None, streamed: bool) -> LinkEstimate:
    """``link`` with the fixed handoff cost ``disagg bench compare`` measured on this pair of hosts
    for the topology's model and connector, when one is stored
    (:func:`disagg.measurements.lookup_handoff`), instead of the connector's seed."""
    from disagg.engines.vllm import served_model_name

    found = lookup_handoff(run_dir or topo.run_dir, served_model_name(topo), pair[0].host, pair[1].host,
                           topo.connector, streamed)
    if found is None:
        return link
    return replace(link, measured_fixed_s=found.fixed_s, measured_exposed_per_byte_s=found.exposed_per_byte_s,
                   measured_fixed_label=f"measured on this pair {found.date} ({found.source})")


def weights_do_not_fit(topo: Topology, arch: ModelArch, pair: Pair | None = None) -> str | None:
    """Why the model's weights do not fit the prefill or the decode host's GPU memory (its spec sheet's
    memory x ``--gpu-memory-utilization`` x the instance's GPUs), or None: they fit, or the memory is
    unknown (a CPU host, a GPU with no ``gpu:``)."""
    weights = model_weight_bytes(topo, arch)
    for role, inst in zip(("prefill", "decode"), pair or first_pair(topo), strict=True):
        host = topo.host_of(inst)
        spec = host_device(host) if host.device == "cuda" else None
        if spec is None or spec.memory_gb is None:
            continue
        util = float(inst.arg("--gpu-memory-utilization") or DEFAULT_GPU_MEMORY_UTILISATION)
        gpus = max(1, len(inst.gpus))
        room = spec.memory_gb * 1e9 * util * gpus
        if weights > room:
            return (f"{arch.name}'s weights ({weights / 1e9:,.0f} GB in {topo.model.dtype}) do not fit the {role} "
                    f"host {host.name} ({gpus} x {spec.label}, {spec.memory_gb:g} GB x {util:g} for vLLM: "
                    f"{room / 1e9:,.1f} GB)")
    return None


def streaming_note(layers: int) -> str:
    """The plan's one-line note on how a streamed handoff is priced."""
    return (f"streamed handoff: each layer's KV leaves once the prefill has computed that layer and the link "
            f"sends the layers one after another, so a split adds fixed + max(transfer / L, transfer - prefill "
            f"+ prefill / L) to the prefill, not fixed + transfer (L = {layers} layers, taken as alike in "
            "compute and bytes)")


@dataclass(frozen=True)
class RouteSeeds:
    """The figures the proxy's ``auto`` routing starts from (``disagg up`` passes them as
    options: the proxy reads no topology); rates per second, times in seconds."""

    kv_bytes_per_token: float           # on the wire (the topology's wire format)
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    link_bytes_per_s: float
    handoff_fixed_s: float
    sources: tuple[str, ...]
    #: the model's layers when the topology streams the KV while the prefill computes (None: it does not)
    streaming_layers: int | None = None
    #: the roles ("prefill", "decode") whose seed rate ``disagg bench`` measured, not estimated
    measured_rates: tuple[str, ...] = ()


def route_seeds(topo: Topology) -> RouteSeeds:
    """The routing seed figures for a split topology: KV bytes per token from the model's
    arch, prefill rates that ``disagg bench`` stored (else the spec estimate), the link
    ``disagg probe-link`` measured (else the nominal table), the connector's measured fixed
    handoff cost, and the model's layers when the topology streams the KV (the socket
    connector's ``streaming``); the same figures ``disagg plan`` prints. Raises PlanError or
    ModelError when the model or a host's rate cannot be worked out."""
    plan = plan_topology(topo, [], 0)
    decode = plan.decode_prefill or plan.prefill
    return RouteSeeds(kv_bytes_per_token=plan.wire_bytes_per_token,
                      prefill_tokens_per_s=plan.prefill.rate(), decode_tokens_per_s=decode.rate(),
                      link_bytes_per_s=plan.link.cost().bytes_per_s, handoff_fixed_s=plan.link.fixed_s,
                      sources=(plan.link.label, plan.prefill.label, decode.label,
                               plan.fixed_source or handoff_fixed_source(plan.streaming_layers is not None)),
                      streaming_layers=plan.streaming_layers,
                      measured_rates=tuple(role for role in ("prefill", "decode") if every_host_measured(topo, role)))


#: how to measure an emulated host's prefill rate and every host's decode step (what plan says)
MEASURE_HINT = ("`disagg up {file}`, then `disagg bench prefill {file}` (probes every host's prefill rate and "
                "decode step straight to its engines, and a split pair's handoff), or `disagg bench compare "
                "{file}` (the same probes after its sweep)")


def every_host_measured(topo: Topology, role: str) -> bool:
    """Whether ``disagg bench`` stored a prefill rate, for the topology's ``model.dtype``, on
    every host of ``role``, measured on the kind of engine the role runs (its connector:
    :func:`engine_connector`; one of unknown connector counts). The proxy seeds every engine of a
    role with the first host's rate
    (:func:`prefill_estimate`), and takes it as it is only where this holds; elsewhere the seed
    counts as an estimate, scaled by what live measurements say of the estimates (the first
    host's rate says nothing sure of another host's)."""
    from disagg.engines.vllm import served_model_name

    model = served_model_name(topo)
    for inst in topo.role(role):
        kind = engine_connector(topo, inst)
        found = lookup_prefill(topo.run_dir, model, inst.host, topo.model.dtype, kind)
        if found is None or found.connector not in (kind, ""):
            return False
    return True


def _prompts(span_: tuple[int, int], limit: int, fit_max: int | None = None) -> str:
    lo, hi = span_
    if hi >= limit:
        return f"prompts of {fmt_count(lo)} tokens and more (up to {fmt_count(limit)})"
    longer = (" (longer ones do not fit the decode host's KV memory, split or not)"
              if fit_max is not None and hi >= fit_max else "")
    return f"prompts of {fmt_count(lo)} to {fmt_count(hi)} tokens{longer}"


def idle_routing_line(plan: Plan) -> str | None:
    """One sentence: which prompts the proxy's auto routing splits at idle load (the rows' answer)."""
    if plan.decode_prefill is None or plan.not_fit is not None or plan.fit_max_tokens == 0:
        return None
    rates = (f"prefill host {fmt_count(round(plan.prefill.rate()))} tokens/s, decode host "
             f"{fmt_count(round(plan.decode_prefill.rate()))} tokens/s at 2,048 tokens, handoff "
             f"{fmt_seconds(plan.link.fixed_s)} fixed"
             + (f", streamed over {plan.streaming_layers} layers" if plan.streaming_layers is not None else ""))
    if plan.pays_span is None:
        line = (f"Routing (auto) at idle load: every prompt stays local (no split answers sooner than the "
                f"decode host prefilling it itself; {rates}); it splits only when the decode engines are busy.")
    else:
        line = (f"Routing (auto) at idle load: {_prompts(plan.pays_span, plan.search_limit, plan.fit_max_tokens)} "
                "split, where "
                f"the split answers sooner; others stay local ({rates}).")
    if plan.seed_split_from_tokens != plan.idle_split_from_tokens:
        seed = ("no prompt" if plan.seed_split_from_tokens is None
                else f"{fmt_count(plan.seed_split_from_tokens)} tokens and more")
        line += (f" The proxy starts from those rates at 2,048 tokens, which split {seed} at idle, until "
                 "its live measurements correct them.")
    return line


def summary_line(plan: Plan) -> str:
    """One sentence: for which prompt lengths the split pays on this link (the rows' answer)."""
    if plan.not_fit is not None:
        return f"No verdict: {plan.not_fit}."
    limit = fmt_count(plan.search_limit)
    if plan.fit_max_tokens == 0:
        return (f"No prompt pays: not one conversation fits in the decode host's KV memory "
                f"({plan.memory.label}).")
    if plan.fit_max_tokens is not None and plan.fit_max_tokens < plan.search_limit:
        limit = (f"{fmt_count(plan.fit_max_tokens)}, the longest prompt one conversation of which fits in "
                 "the decode host's KV memory")
    if plan.pays_span is None:
        if plan.worth_span is None:
            return (f"On this link the split does not pay for any prompt up to {limit} tokens: moving the KV "
                    "always takes longer than the decode host computing it.")
        return (f"The split never answers sooner than the decode host prefilling the prompt itself (up to "
                f"{limit} tokens); for {_prompts(plan.worth_span, plan.search_limit, plan.fit_max_tokens)} moving "
                "the KV costs less "
                "than that prefill, so it is marginal: it takes the prefill off a busy decode host.")
    return (f"The split pays (answers no later than the decode host prefilling the prompt itself) for "
            f"{_prompts(plan.pays_span, plan.search_limit, plan.fit_max_tokens)}.")

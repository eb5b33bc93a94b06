"""``disagg plan``: does the phase split pay on this topology, per prompt class?"""

from __future__ import annotations

import argparse
import json
import math
import textwrap
from dataclasses import replace
from pathlib import Path

from disagg.bench.slo import parse_slo
from disagg.bench.trace import load_trace
from disagg.bench.workload import parse_classes, trace_length_classes, trace_rate
from disagg.errors import DisaggError, PlanError
from disagg.planning import (
    HANDOFF_ROUND_TRIPS,
    LINK_CLASSES,
    Pair,
    Plan,
    first_pair,
    idle_routing_line,
    plan_pairs,
    plan_topology,
    summary_line,
)
from disagg.routecost import handoff_fixed_source
from disagg.topology import WIRE_FORMATS, Topology, load_topology
from disagg.units import fmt_bytes, fmt_count, fmt_seconds
from disagg.workload_plan import EngineModel, WorkloadPlan, describe_model, fmt_tpot, plan_workload

DEFAULT_PROMPTS = "256,2048,8192"
WIDTH = 100


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``plan``."""
    p = sub.add_parser(
        "plan", help="does the prefill/decode split pay? KV size vs link vs prefill time, per prompt length",
        description="For each prompt length and each prefill -> decode pair: the KV cache moved, the time "
                    "to move it over the topology's link, the prefill on the prefill host, when the split "
                    "answers beside the decode host prefilling the prompt itself, a verdict, and how many "
                    "such conversations fit in the decode host's KV memory.")
    p.add_argument("topology", metavar="TOPOLOGY.yaml")
    p.add_argument("--prompt-tokens", default=DEFAULT_PROMPTS, metavar="N,N,...",
                   help=f"prompt lengths to plan for (default {DEFAULT_PROMPTS})")
    p.add_argument("--output-tokens", type=int, default=256, metavar="N",
                   help="output length per request, for the decode-memory check (default 256)")
    p.add_argument("--model", metavar="NAME|DIR",
                   help="what if: another model (built-in name, HF id or a directory with config.json)")
    p.add_argument("--link", metavar="CLASS|RATE",
                   help=f"what if: another link: a class ({', '.join(LINK_CLASSES)}) or a line rate "
                        "(5gbe, 2.5gbit, 940mbit, 1.2GB/s; TCP at ~94%% of it)")
    p.add_argument("--kv-dtype", metavar="DTYPE", help="KV cache dtype: bfloat16, float16, fp8 (default: "
                   "the decode instance's --kv-cache-dtype, else the model dtype)")
    p.add_argument("--wire-format", choices=WIRE_FORMATS, metavar="FORMAT",
                   help="what if: the KV crosses the link as raw (the cache's bytes) or fp8 (about half a "
                        "16-bit cache; socket connector only) (default: the topology's connector.wire_format)")
    p.add_argument("--streaming", choices=("on", "off"),
                   help="what if: the KV streamed layer by layer while the prefill computes (on; socket "
                        "connector only) or sent after it (off) (default: the topology's connector.streaming)")
    p.add_argument("--no-probe", action="store_true", help="ignore a stored probe-link result")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    w = p.add_argument_group(
        "workload (per class TTFT/TPOT and goodput of colocated, replicas, split and auto, and a recommendation)")
    w.add_argument("--classes", metavar="SPEC",
                   help="prompt classes NAME=INPUT[:OUTPUT][@WEIGHT],... in tokens, as disagg bench takes them "
                        "(OUTPUT defaults to --output-tokens); needs --rate")
    w.add_argument("--rate", type=float, metavar="R",
                   help="requests per second of the workload (with --trace: instead of the trace's own rate)")
    w.add_argument("--slo", metavar="SPEC", help="e.g. ttft=1s,tpot=50ms[,e2el=30s]: goodput counts requests "
                   "meeting it (default: none, goodput = the rate where not saturated)")
    w.add_argument("--trace", type=Path, metavar="FILE",
                   help="the workload from a trace: an Azure CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or a "
                        "Mooncake JSONL (timestamp ms, input_length, output_length): its rate, and classes by "
                        "prompt length (lengths cut to max_model_len)")
    w.add_argument("--time-scale", type=float, metavar="X", help="with --trace: its arrivals X times as fast")
    w.add_argument("--trace-limit", type=int, metavar="N", help="with --trace: only its first N usable requests")
    p.set_defaults(handler=cmd_plan)


def parse_token_list(text: str) -> list[int]:
    """``256,2k,8192`` -> [256, 2048, 8192]; a PlanError for anything else."""
    out = []
    for part in text.split(","):
        item = part.strip().lower()
        scale = 1024 if item.endswith("k") else 1
        try:
            value = int(item.removesuffix("k")) * scale
        except ValueError:
            value = 0
        if value <= 0:
            raise PlanError(f"--prompt-tokens: expected positive integers like 256,2048,8192, got {part!r}")
        out.append(value)
    return out


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the plan for one topology."""
    if args.output_tokens < 0:
        raise PlanError("--output-tokens must be >= 0")
    topo = load_topology(args.topology)
    streaming = None if args.streaming is None else args.streaming == "on"
    if streaming and topo.connector != "socket":
        raise PlanError(f"--streaming on: only the socket connector streams the KV while the prefill computes; "
                        f"{topo.file} uses connector {topo.connector}, which sends it after the prefill")
    if args.classes is not None or args.trace is not None:
        return cmd_workload(args, topo, streaming)
    if args.rate is not None or args.slo is not None or args.time_scale is not None or args.trace_limit is not None:
        raise PlanError("--rate, --slo, --time-scale and --trace-limit go with --classes or --trace")
    prompts = parse_token_list(args.prompt_tokens)
    limit, left_out = topo.model.max_model_len, []
    if args.prompt_tokens == DEFAULT_PROMPTS and limit is not None:   # the defaults fit the context limit
        left_out = [n for n in prompts if n > limit]
        prompts = [n for n in prompts if n <= limit] or [limit]
    pairs = plan_pairs(topo)
    plans: list[Plan] = []
    for pair in pairs:
        plan = plan_topology(topo, prompts, args.output_tokens,
                             model=args.model, link_class=args.link, kv_dtype=args.kv_dtype,
                             use_probe=not args.no_probe, wire_format=args.wire_format, streaming=streaming,
                             pair=pair)
        if left_out:
            plan = replace(plan, notes=(f"default prompt lengths of {', '.join(fmt_count(n) for n in left_out)} "
                                        f"tokens left out: longer than max_model_len {fmt_count(limit or 0)}",
                                        *plan.notes))
        if plans:
            plan = replace(plan, notes=(*plan.notes, "the proxy starts every engine of a role from the first pair's "
                                        "rates (disagg up seeds it with them), until its live measurements "
                                        "correct them"))
        plans.append(plan)
    if args.json:     # the first pair's plan at the top level; with more pairs, each under "pairs"
        data = plans[0].to_json()
        data["topology"] = topo.file
        data["prefill_instance"], data["decode_instance"] = (i.name for i in pairs[0])
        if len(pairs) > 1:
            data["pairs"] = [{"prefill_instance": p.name, "decode_instance": d.name, **plan.to_json()}
                             for (p, d), plan in zip(pairs, plans, strict=True)]
        print(json.dumps(data, indent=2))
    else:
        print("\n\n".join(render_plan(plan, topo, args.model, pair,
                                      None if len(pairs) == 1 else f"pair {i} of {len(pairs)}")
                          for i, (pair, plan) in enumerate(zip(pairs, plans, strict=True), 1)))
    return 0


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def render_plan(plan: Plan, topo: Topology, model_override: str | None = None, pair: Pair | None = None,
                which: str | None = None) -> str:
    """The human-readable plan of one prefill -> decode ``pair`` (default: the first): header, one row
    per prompt class, verdict lines, summary; ``which``: the pair's place among several."""
    m = plan.model
    pre, dec = pair or first_pair(topo)
    written = model_override or topo.model.source
    est = " (est.)" if plan.prefill.estimated else ""
    out = [f"disagg plan: {topo.file}" + (f", {which}: {pre.name} on {pre.host} -> {dec.name} on {dec.host}"
                                          if which else "")]
    lk = plan.link
    own = (f"{fmt_seconds(lk.own_fixed_s)} the connector's own ({topo.connector}: "
           f"{handoff_fixed_source(plan.streaming_layers is not None)})" if lk.connector_fixed_s is not None
           else f"{fmt_seconds(lk.own_fixed_s)} the proxy's second request (assumed)")
    parts = [own]
    if lk.first_step_fixed_s > 0:
        parts.append(f"{fmt_seconds(lk.first_step_fixed_s)} decode's first step ({lk.first_step_source})")
    parts.append(f"{fmt_seconds(lk.round_trips_s)} for {HANDOFF_ROUND_TRIPS} round trips of the link "
                 f"({fmt_seconds(lk.rtt_s)} each)")
    if lk.measured_fixed_s is not None:     # the pair's own measurement replaces the seeded parts
        parts = [lk.measured_fixed_label]
    for key, value in (
        ("model", written + (f"  [{m.name}, {m.source}]" if m.name != written else f"  [{m.source}]")),
        ("", m.describe()),
        ("KV", f"{plan.kv_dtype}: {fmt_bytes(m.kv_bytes_per_token(plan.kv_dtype))} per token"
               + ("" if plan.wire_format == "raw" else
                  f"; {fmt_bytes(plan.wire_bytes_per_token)} on the wire ({plan.wire_format})")),
        ("link", f"{pre.host} -> {dec.host}: {plan.link.label}"),
        ("handoff", f"{fmt_seconds(lk.fixed_s)} fixed per request: " + " + ".join(parts)
         + ("" if lk.measured_exposed_per_byte_s is None else
            f"; then {fmt_seconds(lk.measured_exposed_per_byte_s * 2**20)} per MiB of KV moved, measured on this "
            "pair at two prompt lengths (the transfer the prefill does not hide and the first step's read)")),
        *((("", f"streamed layer by layer ({plan.streaming_layers} layers): the KV moves while the prefill "
                "computes, so the handoff below is the fixed cost plus the part of the transfer the prefill "
                "does not hide (notes)"),) if plan.streaming_layers is not None else ()),
        ("prefill", plan.prefill.label),
        *((("local", f"decode host prefilling itself: {plan.decode_prefill.label}"),)
          if plan.decode_prefill is not None else ()),
        ("decode", f"KV memory {plan.memory.label}"),
    ):
        out += _wrap(value, first=f"  {key:<9}", rest=" " * 11)
    out.append("")
    local_est = (" (est.)" if plan.decode_prefill.estimated else "") if plan.decode_prefill is not None else ""
    rows = [["prompt", "KV moved", "handoff", f"prefill{est}", "split", f"local{local_est}", "fit on decode",
             "verdict"],
            ["tokens", "", "", "on P", "P + handoff", "D prefills" if plan.decode_prefill else "as on P",
             f"(+{plan.classes[0].output_tokens if plan.classes else 0} out)", ""]]
    for c in plan.classes:
        fit = "?" if c.conversations is None else fmt_count(c.conversations)
        rows.append([fmt_count(c.prompt_tokens), fmt_bytes(c.kv_bytes), fmt_seconds(c.handoff_s),
                     fmt_seconds(c.prefill_s), fmt_seconds(c.split_s), fmt_seconds(c.local_prefill_s), fit,
                     c.verdict.upper()])
    right = {0, 1, 2, 3, 4, 5, 6}
    if plan.streaming:   # the transfer on its own, beside what the streamed handoff leaves of it
        rows[0][2:2], rows[1][2:2] = ["transfer"], ["(alone)"]
        rows[1][3] = "(streamed)"
        for row, c in zip(rows[2:], plan.classes, strict=True):
            row.insert(2, fmt_seconds(c.transfer_s))
        right = {0, 1, 2, 3, 4, 5, 6, 7}
    out += _table(rows, right=right)
    out.append("")
    width = max(len(fmt_count(c.prompt_tokens)) for c in plan.classes) if plan.classes else 0
    for c in plan.classes:
        out += _wrap(f"{c.verdict.upper()}: {c.reason}", first=f"  {fmt_count(c.prompt_tokens).rjust(width)} tokens: ",
                     rest=" " * (width + 11))
    out.append("")
    out += _wrap(summary_line(plan))
    if (idle := idle_routing_line(plan)) is not None:
        out += _wrap(idle)
    out += _wrap("Verdicts: PAYS when the split (prefill on P, then the handoff) answers no later than the "
                 "decode host prefilling the prompt itself ('local'); MARGINAL when it answers later but the "
                 "handoff costs less than the prefill it takes off the decode host (worth it when that host is "
                 "busy decoding); DOES NOT PAY when moving the KV takes longer than the decode host computing "
                 "it; DOES NOT FIT when the model's weights do not fit a host. 'fit on decode': conversations "
                 "of that length (prompt + output) whose KV fits in the decode host's KV memory at once.")
    if plan.notes:
        out.append("  notes:")
        for note in plan.notes:
            out += _wrap(note, first="   - ", rest="     ")
    return "\n".join(out)


def _wrap(text: str, first: str = "  ", rest: str = "  ") -> list[str]:
    return textwrap.wrap(text, width=WIDTH, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)


def cmd_workload(args: argparse.Namespace, topo: Topology, streaming: bool | None) -> int:
    """``disagg plan --classes ... --rate R`` or ``--trace FILE``: the workload plan
    (:func:`disagg.workload_plan.plan_workload`), as a table or ``--json``."""
    if args.classes is not None and args.trace is not None:
        raise PlanError("--classes or --trace, not both")
    if args.trace is None and (args.time_scale is not None or args.trace_limit is not None):
        raise PlanError("--time-scale and --trace-limit go with --trace FILE")
    if args.prompt_tokens != DEFAULT_PROMPTS:
        raise PlanError("--prompt-tokens sets the per-prompt table; with a workload the classes set the lengths")
    try:
        slo = parse_slo(args.slo)
        if args.trace is not None:
            trace = load_trace(args.trace, args.trace_limit)
            scale = 1.0 if args.time_scale is None else args.time_scale
            classes = trace_length_classes(trace, topo.model.max_model_len)
            rate = args.rate if args.rate is not None else trace_rate(trace, scale)
            source = (f"trace {trace.file} ({trace.format}, {fmt_count(len(trace.requests))} requests"
                      + (f", x{scale:g} time scale" if args.time_scale is not None else "")
                      + ("" if args.rate is None else ", its rate replaced by --rate") + ")")
        else:
            if args.rate is None:
                raise PlanError("--classes needs --rate R (requests per second)")
            classes = parse_classes(args.classes, args.output_tokens)
            rate, source = args.rate, "--classes"
    except (ValueError, DisaggError) as exc:
        raise PlanError(str(exc)) from None
    if not rate > 0 or math.isinf(rate):
        raise PlanError(f"--rate must be a positive number of requests per second, got {rate:g}")
    wp = plan_workload(topo, classes, rate, None if slo.empty else slo, model=args.model, link_class=args.link,
                       kv_dtype=args.kv_dtype, use_probe=not args.no_probe, wire_format=args.wire_format,
                       streaming=streaming, workload_source=source)
    if args.json:
        print(json.dumps(wp.to_json(), indent=2))
    else:
        print(render_workload(wp))
    return 0


def _gbs(bytes_per_s: float) -> str:
    gbs = bytes_per_s / 1e9
    return f"{gbs:,.0f}" if gbs >= 100 else f"{gbs:.3g}"


def _engine_rows(wp: WorkloadPlan) -> list[tuple[str, str]]:
    """(key, text) per engine: as the topology runs it (its KV connector: split and auto), then,
    where its figures differ, as a colocated topology runs it (no connector: colocated, replicas)."""
    def text(e: EngineModel, where: str) -> str:
        kv_read = ("" if e.decode.per_kv_byte_s <= 0 else
                   f" + KV read at {_gbs(e.memory_bytes_per_s)} GB/s")
        return (f"on {e.host}{where}: prefill {fmt_count(round(e.prefill.rate()))} tokens/s at 2,048 "
                f"({e.prefill.label}); decode step {fmt_seconds(e.idle_step_s)}{kv_read} ({e.decode_source}); KV "
                + ("unknown" if e.kv_capacity_bytes is None else fmt_bytes(e.kv_capacity_bytes))
                + f" ({e.kv_source})")

    plain = {e.name: e for e in wp.plain_engines}
    rows = []
    for e in wp.engines:
        alone = plain.get(e.name)
        differs = alone is not None and (alone.prefill.label, alone.decode) != (e.prefill.label, e.decode)
        rows.append((e.name, text(e, f", with {e.connector} (split, auto)" if differs else "")))
        if differs and alone is not None:
            rows.append(("", text(alone, ", without a KV connector (colocated, replicas)")))
    return rows


def render_workload(wp: WorkloadPlan) -> str:
    """The human-readable workload plan: the workload, each engine's figures, one block of rows per
    configuration (a row per class), the KV limits, the recommendation, the model's statement."""
    slo = ", ".join(f"{k}<={fmt_seconds(v)}" for k, v in wp.slo.items()) or "none (goodput = rate unless saturated)"
    out = [f"disagg plan: {wp.topology}: workload of {wp.rate:.3g} req/s"]
    for key, value in (
        ("model", f"{wp.model.name}: KV {wp.kv_dtype}, {fmt_bytes(wp.model.kv_bytes_per_token(wp.kv_dtype))} per "
                  "token"),
        ("classes", ", ".join(m.label for m in wp.mix) + f"  [{wp.workload_source}]"),
        ("SLO", slo),
        *_engine_rows(wp),
        ("handoff", f"{fmt_seconds(wp.handoff.fixed_s)} fixed ({wp.handoff_source}) + KV at "
                    f"{wp.handoff.bytes_per_s * 8 / 1e9:.3g} Gb/s ({wp.handoff.label})"),
    ):
        out += _wrap(value, first=f"  {key:<11}", rest=" " * 13)
    out.append("")
    rows = [["configuration", "class", "TTFT p50", "TPOT p50", "meets SLO", "routes", "goodput", "saturates at"]]
    for c in wp.configs:
        first = True
        for m, p in zip(wp.mix, c.classes, strict=True):
            routes = ", ".join(f"{k} {v:.0%}" for k, v in sorted(p.routes.items()) if v >= 0.005) \
                if c.layout.kind == "auto" else ""
            good = (f"{c.goodput_rps:.3g} req/s ({c.goodput_rps / wp.rate:.0%})" if not c.saturated else "saturated")
            sat = "-" if c.saturates_at_rps is None else f"{c.saturates_at_rps:.3g} req/s"
            rows.append([c.layout.label if first else "", m.name, fmt_tpot(p.ttft_p50_s), fmt_tpot(p.tpot_p50_s),
                         "-" if c.saturated else f"{p.meets:.0%}", routes, good if first else "",
                         sat if first else ""])
            first = False
    out += _table(rows, right={2, 3, 4})
    out.append("")
    for c in wp.configs:
        for why in c.saturated:
            out += _wrap(f"{c.layout.label}: saturated: {why}")
    for line in wp.kv_binds:
        out += _wrap(line)
    out.append("")
    rec = wp.recommendation
    out += _wrap(rec.text)
    if rec.prefill_hosts:
        out += _wrap(f"Which host prefills: {', '.join(rec.prefill_hosts)} (for {', '.join(rec.decode_hosts)}), "
                     "in the best split configuration.")
    if rec.prefill_warning:
        out += _wrap(rec.prefill_warning)
    out += _wrap(describe_model())
    if wp.notes:
        out.append("  notes:")
        for note in wp.notes:
            out += _wrap(note, first="   - ", rest="     ")
    return "\n".join(out)

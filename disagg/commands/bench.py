"""``disagg bench serve URL`` (old spelling ``disagg bench URL``), ``disagg bench compare
TOPOLOGY.yaml ...`` and ``disagg bench prefill TOPOLOGY.yaml``: argparse subcommands; serve and
compare share the workload and output option groups (:func:`add_workload_options`,
:func:`add_output_options`); prefill probes a running topology's engines for ``disagg plan``
(:func:`cmd_prefill`). :func:`old_spelling` is the small pre-dispatch :func:`disagg.cli.main`
runs so the old form keeps working."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from disagg.bench.compare import (
    AUTO_SLO,
    ROUTING_VARIANTS,
    TopologyUnderTest,
    compare,
    handoff_words,
    probe_engines,
    probe_handoff,
    variant_slo,
)
from disagg.bench.metrics import DEFAULT_PERCENTILES
from disagg.bench.prefill import HANDOFF_PROBE_MIN_PAIRS, prefill_rate_from_runs, probe_prefill_rate
from disagg.bench.prompts import DEFAULT_CHARS_PER_TOKEN
from disagg.bench.report import text_table, write_json, write_report
from disagg.bench.runner import Step, Target, run_sweep
from disagg.bench.slo import SLO, parse_slo
from disagg.bench.trace import Trace, load_trace
from disagg.bench.workload import (
    ARRIVALS,
    DEFAULT_OUTPUT_LEN,
    TRACE_ARRIVAL,
    PromptClass,
    Workload,
    parse_classes,
    trace_workload_classes,
)
from disagg.commands.stopping import sigterm_as_ctrl_c
from disagg.errors import DisaggError
from disagg.measurements import store_prefill
from disagg.proxy.config import ENGINE_KEY_ENV
from disagg.registry import engine_adapter
from disagg.topology import DEFAULT_RUN_DIR, DTYPES, load_topology

#: the subcommands of ``disagg bench``; anything else first is the old spelling ``disagg bench URL``
SUBCOMMANDS = ("serve", "compare", "prefill")
#: ``disagg bench prefill``'s default prompt length (cut to the model's max_model_len)
PREFILL_PROBE_TOKENS = 2048


def old_spelling(argv: Sequence[str]) -> list[str]:
    """``disagg bench URL ...`` (the spelling before subcommands) -> ``disagg bench serve URL ...``.

    Called by :func:`disagg.cli.main` on the whole argument list before parsing: when the
    word after ``bench`` is neither a subcommand nor ``-h``/``--help``, ``serve`` is inserted.
    Only global options (``--debug``) may come before ``bench``."""
    args = list(argv)
    i = 0
    while i < len(args) and args[i].startswith("-"):
        i += 1
    if i + 1 < len(args) and args[i] == "bench" and args[i + 1] not in (*SUBCOMMANDS, "-h", "--help"):
        args.insert(i + 1, "serve")
    return args


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``bench`` with its subcommands ``serve`` and ``compare`` (called by :mod:`disagg.cli`)."""
    p = sub.add_parser(
        "bench", help="measure TTFT/TPOT/goodput of an endpoint (serve), or compare topologies (compare)",
        usage="disagg bench {serve,compare,prefill} ... [options]\n"
              "       disagg bench URL [options]   (the old spelling of 'disagg bench serve URL')",
        description="Load an OpenAI-compatible endpoint with prompt classes at request rates and report "
                    "TTFT, TPOT, ITL, E2EL, throughput and goodput (vLLM bench definitions). 'serve URL' "
                    "measures one running endpoint; 'compare' brings each topology up in turn (disagg up "
                    "--detach), runs the identical workload against its proxy, brings it down, and writes "
                    "one report. 'disagg bench URL ...' is the old spelling of 'disagg bench serve URL ...' "
                    "and still works.")
    bench_sub = p.add_subparsers(dest="bench_command", metavar="{serve,compare,prefill}", required=True)
    serve = bench_sub.add_parser(
        "serve", help="measure one running endpoint (old spelling: disagg bench URL)",
        usage="disagg bench serve URL [options]",
        description="Load the OpenAI-compatible endpoint at URL (a vLLM or SGLang server, the disagg proxy) "
                    "with the workload below and report TTFT, TPOT, ITL, E2EL, throughput and goodput; "
                    "with the disagg proxy, also its route mix. Old spelling: disagg bench URL [options].")
    serve.add_argument("url", metavar="URL", help="endpoint base URL (http://host:port)")
    serve.add_argument("extra", nargs="*", help=argparse.SUPPRESS)
    add_workload_options(serve)
    m = add_output_options(serve, "(default: none)")
    m.add_argument("--label", help="name of this endpoint in the report (default host:port)")
    pf = serve.add_argument_group("prefill rate (stored for disagg plan)")
    pf.add_argument("--prefill-host", metavar="NAME",
                    help="store the measured prefill rate under this topology host name")
    pf.add_argument("--prefill-dtype", default="auto", choices=DTYPES,
                    help="the engine's dtype, as the topology's model.dtype says it (default auto): "
                         "`disagg plan` uses the stored rate only for that dtype")
    pf.add_argument("--prefill-probe", type=int, default=0, metavar="N",
                    help="probe N long prompts at concurrency 1 (default 0 = use requests that ran alone)")
    pf.add_argument("--run-dir", default=DEFAULT_RUN_DIR,
                    help="where measurements/prefill.json lives (default .disagg)")
    serve.set_defaults(handler=cmd_serve)

    comp = bench_sub.add_parser(
        "compare", help="bring topologies up one at a time and bench each with the same workload",
        usage="disagg bench compare TOPOLOGY.yaml [TOPOLOGY.yaml ...] [--routing POLICY,...] [options]",
        description="For each topology: disagg up --detach, the workload against its proxy, a prefill-rate "
                    "probe, disagg down (always); then one report in --out.")
    comp.add_argument("topologies", nargs="*", metavar="TOPOLOGY.yaml", help="the topologies, in order")
    comp.add_argument("--routing", metavar="POLICY[,POLICY...]",
                      help=f"run each split topology once per routing policy ({', '.join(ROUTING_VARIANTS)}) "
                           "from a copy with routing.policy set (written to OUT/topologies/), labelled "
                           f"NAME[POLICY]; {AUTO_SLO}: auto with --slo's ttft and tpot as routing.slo; "
                           "other topologies run once")
    add_workload_options(comp)
    add_output_options(comp, "(default bench-report)")
    pf = comp.add_argument_group("prefill rate (stored for disagg plan)")
    pf.add_argument("--prefill-probe", type=int, default=3, metavar="N",
                    help="probe N long prompts at concurrency 1 straight to an engine of each host that prefills "
                         "(prefill, colocated and decode engines; not SGLang's decode engines) (default 3, "
                         "0 = off); stored in each topology's run_dir")
    comp.set_defaults(handler=cmd_compare)

    pre = bench_sub.add_parser(
        "prefill", help="measure a running topology's prefill rates, decode steps and handoff for disagg plan",
        usage="disagg bench prefill TOPOLOGY.yaml [--prompt-tokens N] [--count N] [--no-handoff] [--json FILE]",
        description="Probe the topology that `disagg up TOPOLOGY.yaml` started: straight to the first engine of "
                    "each host (with the run's engine key, $DISAGG_ENGINE_KEY), its prefill rate (N prompts of "
                    "--prompt-tokens and N of an eighth of it, max_tokens 1, one at a time) and its decode "
                    "step (2 short and 2 long prompts, 64 tokens each); on a split topology of one prefill "
                    "and one decode engine, the pair's fixed handoff cost through the proxy (when it splits "
                    "every probe). All stored in the topology's run_dir, where `disagg plan` reads them.")
    pre.add_argument("topology", metavar="TOPOLOGY.yaml", help="the running topology (disagg up)")
    pre.add_argument("--prompt-tokens", type=int, default=PREFILL_PROBE_TOKENS, metavar="N",
                     help=f"the probes' long prompt (default {PREFILL_PROBE_TOKENS}, cut to max_model_len - 64)")
    pre.add_argument("--count", type=int, default=3, metavar="N",
                     help="prompts per prefill probe (default 3) and pairs of the handoff probe (at least "
                          f"{HANDOFF_PROBE_MIN_PAIRS})")
    pre.add_argument("--no-handoff", dest="handoff", action="store_false",
                     help="skip the split pair's handoff probe")
    pre.add_argument("--json", type=Path, metavar="FILE", help="write what was measured and stored as JSON")
    pre.set_defaults(handler=cmd_prefill)


def add_workload_options(p: argparse.ArgumentParser) -> None:
    """The workload options ``serve`` and ``compare`` share (read back by :func:`plan_from_args`)."""
    w = p.add_argument_group("workload")
    w.add_argument("--classes", metavar="SPEC",
                   help="prompt classes NAME=INPUT[:OUTPUT][@WEIGHT],... in tokens "
                        "(default short=128,medium=512,long=2048)")
    w.add_argument("--output-len", type=int, default=DEFAULT_OUTPUT_LEN,
                   help=f"answer tokens for classes that give none (default {DEFAULT_OUTPUT_LEN}; "
                        "exact via ignore_eos)")
    w.add_argument("--num-requests", "-n", type=int, default=None,
                   help="requests per run (default 100; with --trace see --trace-limit)")
    w.add_argument("--duration", type=float, metavar="S", help="stop sending new requests after S seconds")
    w.add_argument("--arrival", choices=ARRIVALS, default="poisson",
                   help="poisson (default), gamma (see --burstiness) or closed (loop at --concurrency)")
    w.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: <1 burstier, >1 more regular (default 1 = Poisson)")
    w.add_argument("--rates", default=None, metavar="R,R,...",
                   help="request rates in req/s for a sweep, 'inf' = all at once (default 1)")
    w.add_argument("--concurrency", default=None, metavar="C,C,...",
                   help="closed loop: requests in flight (a sweep if several); open loop: one cap")
    w.add_argument("--trace", type=Path, metavar="FILE",
                   help="replay a trace instead of classes and rates: each request's arrival and prompt and "
                        "answer lengths from an Azure CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or a "
                        "Mooncake JSONL (timestamp ms, input_length, output_length)")
    w.add_argument("--time-scale", default=None, metavar="X[,X...]",
                   help="with --trace: replay X times as fast (default 1; a sweep if several)")
    w.add_argument("--trace-limit", type=int, default=None, metavar="N",
                   help="with --trace: only its first N usable requests (the rest is not read)")
    w.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run every rate/concurrency step N times back to back (repeat k: seed+k, its own "
                        "prompts); the report shows medians and min-max (default 1)")
    w.add_argument("--seed", type=int, default=0, help="fixes the class order, prompts and arrivals (default 0)")
    w.add_argument("--prompt-salt", default=None, metavar="TEXT",
                   help="start every prompt's tag with TEXT (default: random per invocation, so a rerun "
                        "against the same server cannot hit its prefix cache; fix it to repeat prompts exactly)")
    w.add_argument("--api", choices=("completions", "chat"), default="completions",
                   help="/v1/completions (default) or /v1/chat/completions")
    w.add_argument("--model", help="model name to request (default: the first of GET /v1/models)")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let answers stop at EOS (lengths then vary)")
    w.add_argument("--timeout", type=float, default=600.0, help="per request, seconds (default 600)")
    w.add_argument("--warmup", type=int, default=1, help="warm-up requests before measuring (default 1)")
    w.add_argument("--tokenize-url", action="append", metavar="URL",
                   help="server(s) with /tokenize for exact prompt lengths (default: the target)")
    w.add_argument("--no-tokenize", action="store_true", help="estimate prompt lengths from --chars-per-token")
    w.add_argument("--chars-per-token", type=float, default=DEFAULT_CHARS_PER_TOKEN)
    w.add_argument("--header", action="append", default=[], metavar="K=V", help="extra HTTP header")


def add_output_options(p: argparse.ArgumentParser, out_default: str) -> argparse._ArgumentGroup:
    """The metrics and output options ``serve`` and ``compare`` share; returns the group."""
    m = p.add_argument_group("metrics and output")
    m.add_argument("--slo", help="e.g. ttft=2s,tpot=100ms[,e2el=30s]: goodput and attainment")
    m.add_argument("--percentiles", default=",".join(f"{q:g}" for q in DEFAULT_PERCENTILES),
                   help="percentiles to report (default 50,90,99)")
    m.add_argument("--json", type=Path, metavar="FILE", help="write every record and metric as JSON")
    m.add_argument("--out", type=Path, metavar="DIR",
                   help=f"write the report (results.json, report.md, PNG plots) here {out_default}")
    m.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    return m


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [math.inf if v.strip().lower() == "inf" else float(v) for v in text.split(",")]
    except ValueError:
        raise DisaggError(f"bad {what} {text!r}: expected comma-separated numbers") from None
    if not values or any(v <= 0 for v in values):
        raise DisaggError(f"bad {what} {text!r}: every value must be positive")
    return values


def _trace_plan(args: argparse.Namespace, concurrency: list[int]) -> tuple[Trace, tuple[PromptClass, ...],
                                                                          list[Step]]:
    """--trace: the trace, its one class and a step per --time-scale; options that set what the
    trace sets are refused."""
    given = [opt for opt, value in (("--classes", args.classes), ("--rates", args.rates),
                                    ("--num-requests", args.num_requests is not None),
                                    ("--output-len", args.output_len != DEFAULT_OUTPUT_LEN),
                                    ("--arrival", args.arrival != "poisson"), ("--burstiness", args.burstiness != 1.0))
             if value]
    if given:
        raise DisaggError(f"--trace sets the requests, their lengths and arrivals: drop {', '.join(given)} "
                          "(--trace-limit N takes the first N requests, --time-scale X replays X times as fast)")
    if len(concurrency) > 1:
        raise DisaggError("with --trace --concurrency is one cap, not a list")
    trace = load_trace(args.trace, args.trace_limit)
    cap = concurrency[0] if concurrency else None
    steps = [Step(time_scale=x, concurrency=cap) for x in _floats(args.time_scale or "1", "--time-scale")]
    if not all(math.isfinite(step.time_scale or 0) for step in steps):
        raise DisaggError(f"bad --time-scale {args.time_scale!r}: must be finite")
    return trace, trace_workload_classes(trace), steps


def plan_from_args(args: argparse.Namespace) -> tuple[Workload, list[Step], SLO, tuple[float, ...]]:
    """The workload, the sweep steps, the SLO and the percentiles the options ask for."""
    concurrency = [int(c) for c in _floats(args.concurrency, "--concurrency")] if args.concurrency else []
    trace: Trace | None = None
    if args.trace is None and (args.time_scale is not None or args.trace_limit is not None):
        raise DisaggError("--time-scale and --trace-limit go with --trace FILE")
    if args.trace is not None:
        trace, classes, steps = _trace_plan(args, concurrency)
    elif args.arrival == "closed":
        if args.rates:
            raise DisaggError("--rates is for open-loop arrivals; a closed loop sweeps --concurrency")
        if not concurrency:
            raise DisaggError("--arrival closed needs --concurrency N[,N...]")
        steps = [Step(concurrency=c) for c in concurrency]
    else:
        if len(concurrency) > 1:
            raise DisaggError("with open-loop arrivals --concurrency is one cap, not a list")
        cap = concurrency[0] if concurrency else None
        steps = [Step(rate=r, concurrency=cap) for r in _floats(args.rates or "1", "--rates")]
    try:
        if trace is None:
            classes = parse_classes(args.classes, args.output_len)
        n = len(trace.requests) if trace else 100 if args.num_requests is None else args.num_requests
        workload = Workload(classes, num_requests=n,
                            duration_s=args.duration, arrival=TRACE_ARRIVAL if trace else args.arrival,
                            burstiness=args.burstiness, trace=trace,
                            concurrency=concurrency[0] if concurrency else None, seed=args.seed,
                            salt=secrets.token_hex(3) + "-" if args.prompt_salt is None else args.prompt_salt,
                            api=args.api,
                            ignore_eos=args.ignore_eos, temperature=args.temperature, timeout_s=args.timeout)
        slo = parse_slo(args.slo)
        percentiles = tuple(float(q) for q in args.percentiles.split(","))
    except ValueError as exc:
        raise DisaggError(str(exc)) from None
    if args.repeats < 1:
        raise DisaggError(f"bad --repeats {args.repeats}: at least 1")
    return workload, steps, slo, percentiles


def _headers(items: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise DisaggError(f"bad --header {item!r}: expected KEY=VALUE")
        out.append((key.strip(), value.strip()))
    return tuple(out)


def cmd_serve(args: argparse.Namespace) -> int:
    """``disagg bench serve URL`` (old spelling ``disagg bench URL``): one endpoint, one report."""
    if args.extra:
        raise DisaggError(f"unexpected arguments after the URL: {' '.join(args.extra)} "
                          "(topology files go with 'disagg bench compare')")
    workload, steps, slo, percentiles = plan_from_args(args)
    tokenize: tuple[str, ...] | None = None if args.no_tokenize else tuple(args.tokenize_url or ())
    target = Target(args.url, model=args.model, tokenize_urls=tokenize, headers=_headers(args.header),
                    chars_per_token=args.chars_per_token)
    result = asyncio.run(run_sweep(target, workload, steps, slo, progress=args.progress, warmup=args.warmup,
                                   percentiles=percentiles, repeats=args.repeats))
    label = args.label or urlsplit(result.base_url).netloc
    doc: dict[str, Any] = {label: result.to_dict()}
    if not all(run.exact_prompts for run in result.runs):
        print("note: prompt lengths are estimates (no /tokenize); usage counts are reported", file=sys.stderr)
    if args.prefill_host:
        doc[label]["prefill_measured"] = _measure_prefill(args, result.base_url, result.model, workload,
                                                          [run.records for run in result.runs])
    print(text_table(doc), end="")
    if args.json:
        print(f"wrote {write_json(doc, args.json)}", file=sys.stderr)
    if args.out:
        write_report(doc, args.out, title=f"disagg bench {label}")
        print(f"wrote the report to {args.out}/", file=sys.stderr)
    return 0


def _measure_prefill(args: argparse.Namespace, base_url: str, model: str, workload: Workload,
                     runs: list[Any]) -> dict[str, Any]:
    probe = args.prefill_probe or 0
    longest = max(c.input_len for c in workload.classes)
    if probe > 0:
        rate = asyncio.run(probe_prefill_rate(base_url, model, longest, probe, seed=workload.seed,
                                              headers=dict(_headers(args.header))))
        source = f"disagg bench: probe of {probe} prompts of {longest} tokens, max_tokens 1, at {base_url}"
    else:
        found = prefill_rate_from_runs(runs)
        if found is None:
            print("no request ran alone: prefill rate not stored (use --prefill-probe N)", file=sys.stderr)
            return {}
        rate, used = found
        source = f"disagg bench: TTFT of {used} requests that ran alone at {base_url}"
    path = store_prefill(args.run_dir, model, args.prefill_host, rate, source, dtype=args.prefill_dtype)
    print(f"prefill rate {rate:.0f} prompt tokens/s for {args.prefill_host} stored in {path}", file=sys.stderr)
    return {args.prefill_host: {"prompt_tokens_per_s": rate, "file": str(path)}}


def routing_policies(text: str | None, slo: SLO | None = None) -> list[str]:
    """``--routing auto,split`` -> ``["auto", "split"]`` (checked against ROUTING_VARIANTS, no duplicates;
    ``auto-slo`` only with an ``slo`` that limits TTFT or TPOT)."""
    if text is None:
        return []
    policies = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in policies if p not in ROUTING_VARIANTS]
    if not policies or bad or len(set(policies)) != len(policies):
        raise DisaggError(f"bad --routing {text!r}: expected distinct policies among {', '.join(ROUTING_VARIANTS)}")
    for p in policies:
        variant_slo(p, slo or SLO())
    return policies


def cmd_compare(args: argparse.Namespace) -> int:
    """``disagg bench compare FILES``: each topology up, benched, down; one report."""
    if not args.topologies:
        raise DisaggError("disagg bench compare needs at least one TOPOLOGY.yaml")
    workload, steps, slo, percentiles = plan_from_args(args)
    routing = routing_policies(args.routing, slo)
    out = args.out or Path("bench-report")
    probe = args.prefill_probe
    # one engine key for every `disagg up` this command runs (they inherit it), so the prefill
    # probe may talk to the engines directly
    key = os.environ.get(ENGINE_KEY_ENV) or secrets.token_urlsafe(32)
    os.environ[ENGINE_KEY_ENV] = key
    with sigterm_as_ctrl_c():   # killed, it still takes down the deployment it brought up
        doc = compare([Path(f) for f in args.topologies], workload, steps, out, slo=slo, progress=args.progress,
                      probe_count=probe, percentiles=percentiles, warmup=args.warmup, engine_key=key,
                      repeats=args.repeats, routing=routing)
    print(text_table(doc), end="")
    if args.json:
        write_json(doc, args.json)
    print(f"wrote the report to {out}/ (report.md, results.json, PNG plots)", file=sys.stderr)
    return 0


def run_engine_key(topo_file: str, guarded: bool, environ: dict[str, str] | None = None) -> str | None:
    """The key that lets a request reach a running topology's engines straight (sent as ``Authorization:
    Bearer KEY``): ``$DISAGG_ENGINE_KEY``, the key ``disagg up`` started them with; None when the
    engines are not guarded (``guarded`` False: SGLang, a Rust router in front). A guarded run
    without the variable is a DisaggError saying how to provide it."""
    if not guarded:
        return None
    key = (os.environ if environ is None else environ).get(ENGINE_KEY_ENV)
    if not key:
        raise DisaggError(f"the engines of a run started by `disagg up` answer only with the run's engine key, which "
                          f"up takes from ${ENGINE_KEY_ENV} (else it draws a random one nobody else knows): set "
                          f"{ENGINE_KEY_ENV} to the same value for `disagg up {topo_file}` and for this command (e.g. "
                          f"export {ENGINE_KEY_ENV}=$(python -c 'import secrets; print(secrets.token_urlsafe(32))'), "
                          "then `disagg down` and `disagg up` again), or measure with `disagg bench compare`, which "
                          "starts the engines with a key of its own")
    return key


def cmd_prefill(args: argparse.Namespace) -> int:
    """``disagg bench prefill TOPOLOGY``: probe a running topology's engines and store what ``disagg
    plan`` reads: each host's prefill rate and decode step (the first engine of each host that
    prefills or decodes, straight, with the run's engine key: :func:`run_engine_key`), and on a split
    topology of one pair its fixed handoff cost (:func:`disagg.bench.compare.probe_handoff`)."""
    if args.count < 1 or args.prompt_tokens < 2:
        raise DisaggError("--count must be at least 1 and --prompt-tokens at least 2")
    file = Path(args.topology)
    t = TopologyUnderTest.load(file)
    topo = load_topology(file)
    key = run_engine_key(str(file), engine_adapter(topo.engine).key_env(topo) is not None)
    limit = topo.model.max_model_len
    tokens = args.prompt_tokens if limit is None else min(args.prompt_tokens, limit - 1)
    # the first engine of each host that prefills (SGLang decode engines take only requests with a
    # bootstrap room: not probed)
    probed = asyncio.run(probe_engines(t, tokens, args.count, f"disagg bench prefill, {file}", engine_key=key))
    for host, found in probed.items():
        decode = found["decode"]
        step = (f"decode step {decode['fixed_s'] * 1e3:.2f} ms + {decode['per_kv_byte_s'] * 1e9 * 1e3:.3g} ms per "
                "GB of context KV" if decode["stored"] else f"decode step not stored: {decode['why']}")
        print(f"{host} ({found['engine']}, {found['connector']}): prefill {found['prompt_tokens_per_s']:,.0f} "
              f"tokens/s, {step}", file=sys.stderr)
    doc: dict[str, Any] = {"topology": str(file), "hosts": probed}
    if args.handoff and t.handoff_pair is not None:
        doc["handoff"] = handoff = asyncio.run(probe_handoff(t, t.handoff_pair, args.count, 0, key, tokens))
        print(f"handoff {t.handoff_pair[0]} -> {t.handoff_pair[1]}: " + (handoff_words(handoff) if handoff["stored"]
              else f"not stored: {handoff['why']}"), file=sys.stderr)
    elif t.handoff_pair is None and t.split:
        doc["handoff"] = {"stored": False, "why": "not one prefill and one decode engine"}
    if args.json:
        write_json(doc, args.json)
    print(f"stored in {Path(topo.run_dir) / 'measurements'}/ for disagg plan {file}", file=sys.stderr)
    return 0

"""``disagg bench compare``: the same workload against several topologies, one report.

For each topology file in turn: ``disagg up FILE --detach`` (returns once every
engine and the proxy are healthy), the sweep against the proxy, optionally a
probe straight to an engine of each host that prefills (prefill
hosts, and decode hosts whose engines serve the ``auto`` routing's local
prefills: both seed the proxy's routing) of its prefill rate and decode step, stored per host
and engine kind for ``disagg plan`` (:func:`disagg.bench.prefill.probe_engine`; results.json
keeps them under ``prefill_measured``) and, on a split topology of one pair, a probe of the
pair's handoff cost at two prompt lengths (:func:`probe_handoff`, stored for ``disagg plan``),
then ``disagg down FILE`` -- always, also when the bench fails or is interrupted -- and a copy of
the builtin proxy's log into ``logs/LABEL-proxy.log`` of the output directory (the next
``up`` of the same run starts the log afresh; with ``proxy.log_level: debug`` it holds
the routing decisions that ``benchmarks/prediction_floor.py`` and ``route_replay.py``
read). After each topology the results so far are written to ``results.json``; at the
end the full report (JSON, Markdown, PNGs) is written to the output directory.

With ``routing`` (``--routing auto,split``), each split topology (prefill and
decode roles behind the builtin proxy) runs once per routing policy, from a
derived copy of its file (:func:`routing_variant`) labelled ``NAME[POLICY]``;
other topologies run once, unchanged. The variant :data:`AUTO_SLO` is ``auto`` with the
run's SLO as ``routing.slo`` (the proxy then routes for goodput under it). With ``repeats`` every step runs that
many times (:func:`disagg.bench.runner.run_sweep`).

The up/down steps are a :data:`Lifecycle` callable, so tests (and other
launchers) can inject their own. Called by ``disagg bench compare``
(:mod:`disagg.commands.bench`).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from disagg.bench.metrics import DEFAULT_PERCENTILES
from disagg.bench.prefill import (
    HANDOFF_PROBE_LONG_FACTOR,
    HANDOFF_PROBE_MIN_PAIRS,
    HANDOFF_PROBE_TOKENS,
    probe_engine,
    probe_handoff_fixed,
)
from disagg.bench.report import write_json, write_report
from disagg.bench.runner import BenchResult, Step, Target, run_sweep
from disagg.bench.slo import NO_SLO, SLO
from disagg.bench.workload import Workload
from disagg.deployment import build_deployment
from disagg.emulation import emulation_lines
from disagg.engines.vllm import served_model_name
from disagg.errors import DisaggError, LaunchError
from disagg.kvmath import resolve_model
from disagg.measurements import fit_handoff, probe_path, store_handoff
from disagg.paths import LOGS, PROXY_LOG, run_path
from disagg.planning import engine_connector, kv_cache_dtype, plan_topology
from disagg.proxy.handoff import handoff_class
from disagg.serving import ROUTING_POLICIES
from disagg.topology import InstanceSpec, Topology, load_topology

#: ``lifecycle("up" | "down", topology_file)``; raises DisaggError on failure
Lifecycle = Callable[[str, Path], None]


def cli_lifecycle(action: str, file: Path) -> None:
    """Run ``python -m disagg up FILE --detach`` or ``python -m disagg down FILE``.

    The child's output goes to our stderr (stdout stays for the bench table).
    """
    argv = [sys.executable, "-m", "disagg", action, str(file)] + (["--detach"] if action == "up" else [])
    try:
        proc = subprocess.run(argv, stdout=sys.stderr, check=False)
    except OSError as exc:
        raise LaunchError(f"cannot run {' '.join(argv)}: {exc}") from exc
    if proc.returncode != 0:
        raise LaunchError(f"`disagg {action} {file}` exited with status {proc.returncode} (its output is above)")


@dataclass(frozen=True)
class TopologyUnderTest:
    """What the bench needs to know about one topology file."""

    file: Path
    label: str
    proxy_url: str
    model: str
    run_dir: str
    log_dir: Path                       # the run's log directory on this machine (the proxy's log is there)
    dtype: str                          # the topology's model.dtype (stored with the prefill rate)
    engine_urls: tuple[str, ...]
    #: (host name, engine name, engine URL), the first engine of each host that prefills: prefill and
    #: both roles, and decode engines (the auto routing's local prefills run there), one per host
    prefilling_engines: tuple[tuple[str, str, str], ...]
    split: bool = False                 # prefill and decode roles behind the builtin proxy
    source: Path | None = None          # the file this one was derived from (routing variants)
    routing: str | None = None          # the routing policy a variant sets
    emulated: tuple[str, ...] = ()      # what each host emulates (disagg.emulation.emulation_lines)
    #: (prefill host, decode host, prefill engine URL) of a split topology's one pair, whose handoff
    #: the probe measures (:func:`disagg.bench.prefill.probe_handoff_fixed`); None: not split, or several pairs
    handoff_pair: tuple[str, str, str] | None = None

    @classmethod
    def load(cls, file: Path) -> TopologyUnderTest:
        """Parse and plan ``file`` (no I/O besides reading it)."""
        dep = build_deployment(load_topology(file))
        topo = dep.topology
        prefilling: dict[str, tuple[str, str, str]] = {}
        # decode engines prefill the prompts routed local, where the handoff serves plain requests there
        # (an SGLang decode engine takes only requests with a bootstrap room)
        roles = ("prefill", "both", "decode") if handoff_class(topo.engine).serves_local else ("prefill", "both")
        for eng in dep.engines:
            if eng.instance.role in roles and eng.host.name not in prefilling:
                prefilling[eng.host.name] = (eng.host.name, eng.name, eng.url)
        pair = None
        if is_split(topo) and len(topo.role("prefill")) == 1 and len(topo.role("decode")) == 1:
            p_eng = next(e for e in dep.engines if e.instance.role == "prefill")
            pair = (p_eng.host.name, topo.host_of(topo.role("decode")[0]).name, p_eng.url)
        return cls(file=file, label=topo.name, proxy_url=dep.proxy_url, model=served_model_name(topo),
                   run_dir=topo.run_dir, log_dir=run_path(topo.run_dir, topo.name) / LOGS, dtype=topo.model.dtype,
                   engine_urls=tuple(e.url for e in dep.engines),
                   prefilling_engines=tuple(prefilling.values()), split=is_split(topo),
                   emulated=tuple(emulation_lines(topo)), handoff_pair=pair)


def is_split(topo: Topology) -> bool:
    """Whether ``topo`` is a split topology whose routing policy matters: prefill and decode
    roles, served by the builtin proxy (the routers of vllm-router / sglang-router do not read it)."""
    return bool(topo.role("prefill")) and bool(topo.role("decode")) and topo.proxy.kind == "builtin"


def routing_variant(file: Path, policy: str, out_dir: Path, stem: str, slo: SLO = NO_SLO) -> Path:
    """Write ``out_dir/STEM-POLICY.yaml``: ``file`` with ``routing: {policy: POLICY}`` set (for
    :data:`AUTO_SLO`: ``auto`` with ``slo``'s TTFT and TPOT limits as ``routing.slo``), and
    the same deployment otherwise. What the loader resolves against the file's own directory
    is pinned: ``name`` (the file's stem by default; it names the run directory) is written out,
    a model ``path`` on disk becomes absolute, and the link measurement ``disagg probe-link``
    stored next to the file (``<stem>.probe.json``, which the proxy's routing seeds and
    ``disagg plan`` read) is copied next to the copy. ``run_dir`` and the other paths resolve
    against the working directory, as before. Comments are not kept. Returns the new file."""
    routing_slo = variant_slo(policy, slo)
    topo = load_topology(file)
    data = {"name": topo.name, **{k: v for k, v in yaml.safe_load(file.read_text(encoding="utf-8")).items()
                                  if k != "name"}}
    model = topo.model
    if model.embedded is None and model.path != model.source:       # a path on disk, resolved from the file
        if isinstance(data["model"], dict):
            data["model"]["path"] = model.path
        else:
            data["model"] = model.path
    routing = data.get("routing")
    data["routing"] = {**(routing if isinstance(routing, dict) else {}), "policy": "auto" if routing_slo else policy}
    data["routing"].pop("slo", None)
    if routing_slo:
        data["routing"]["slo"] = routing_slo
    out_dir.mkdir(parents=True, exist_ok=True)
    derived = out_dir / f"{stem}-{policy}.yaml"
    derived.write_text(f"# {file} with routing.policy {policy} (written by disagg bench compare --routing)\n"
                       + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    probe = probe_path(file)
    if probe.exists():
        shutil.copyfile(probe, probe_path(derived))
    elif probe_path(derived).exists():
        probe_path(derived).unlink()
    load_topology(derived)      # the copy must load: a policy the topology refuses fails here, before any `up`
    return derived


#: the ``--routing`` variant that runs ``auto`` with the run's SLO in ``routing.slo``
AUTO_SLO = "auto-slo"
#: every ``--routing`` variant
ROUTING_VARIANTS = (*ROUTING_POLICIES, AUTO_SLO)


def variant_slo(policy: str, slo: SLO) -> dict[str, str] | None:
    """The ``routing.slo`` mapping variant ``policy`` sets (None: a plain policy); raises
    DisaggError for an unknown variant, or :data:`AUTO_SLO` without a TTFT or TPOT limit."""
    if policy not in ROUTING_VARIANTS:
        raise DisaggError(f"unknown routing policy {policy!r}: expected one of {', '.join(ROUTING_VARIANTS)}")
    if policy != AUTO_SLO:
        return None
    limits = {name: f"{value!r}s" for name in ("ttft", "tpot") if (value := getattr(slo, name)) is not None}
    if not limits:
        raise DisaggError(f"routing {AUTO_SLO} needs an SLO with a ttft or tpot limit (--slo ttft=2s,tpot=50ms)")
    return limits


def plan_topologies(files: Sequence[Path], routing: Sequence[str], out_dir: Path,
                    log: Callable[[str], None] = lambda s: None, slo: SLO = NO_SLO) -> list[TopologyUnderTest]:
    """What :func:`compare` runs, in order: each file once, or with ``routing`` each split
    topology once per policy (a derived copy under ``out_dir/topologies/``, labelled
    ``NAME[POLICY]``; :data:`AUTO_SLO` with ``slo``). Loads and writes files; starts nothing."""
    tops: list[TopologyUnderTest] = []
    stems: set[str] = set()
    for file in files:
        t = TopologyUnderTest.load(Path(file))
        if not routing:
            tops.append(t)
            continue
        if not t.split:
            log(f"disagg bench compare: {t.label}: not a split topology with the builtin proxy: "
                "runs once, routing unchanged")
            tops.append(t)
            continue
        stem, n = t.label, 1
        while stem in stems:
            n += 1
            stem = f"{t.label}-{n}"
        stems.add(stem)
        for policy in routing:
            derived = routing_variant(Path(file), policy, out_dir / "topologies", stem, slo)
            tops.append(replace(TopologyUnderTest.load(derived), label=f"{t.label}[{policy}]", source=Path(file),
                                routing=policy))
    return tops


async def _bench_one(t: TopologyUnderTest, workload: Workload, steps: Sequence[Step], slo: SLO,
                     progress: bool, probe_count: int, percentiles: Sequence[float],
                     warmup: int, engine_key: str | None,
                     repeats: int) -> tuple[BenchResult, dict[str, Any], dict[str, Any] | None]:
    """The sweep against ``t``'s proxy, then the probes: (result, prefill rates measured, the
    handoff probe's outcome or None)."""
    target = Target(t.proxy_url, model=t.model, tokenize_urls=(t.proxy_url, *t.engine_urls))
    result = await run_sweep(target, workload, steps, slo, progress=progress, warmup=warmup,
                             percentiles=percentiles, repeats=repeats)
    measured: dict[str, Any] = {}
    handoff: dict[str, Any] | None = None
    if probe_count > 0:
        longest = max(c.input_len for c in workload.classes)
        measured = await probe_engines(t, longest, probe_count, f"disagg bench compare, {t.file}",
                                       seed=workload.seed, engine_key=engine_key)
        if t.handoff_pair is not None:
            handoff = await probe_handoff(t, t.handoff_pair, probe_count, workload.seed, engine_key, longest)
    return result, measured, handoff


async def probe_handoff(t: TopologyUnderTest, pair: tuple[str, str, str], count: int, seed: int,
                        engine_key: str | None, long_tokens: int | None = None) -> dict[str, Any]:
    """Measure and store the handoff cost of ``t``'s one pair (:func:`disagg.bench.prefill.probe_handoff_fixed`,
    over ``count`` pairs of prompts, at least :data:`~disagg.bench.prefill.HANDOFF_PROBE_MIN_PAIRS`);
    what was stored, or why nothing was. Called after the sweep by :func:`compare` and by ``disagg
    bench prefill``.

    At :data:`~disagg.bench.prefill.HANDOFF_PROBE_TOKENS` and, where ``long_tokens`` (capped to the
    model's context) is at least :data:`HANDOFF_PROBE_LONG_FACTOR` times that, again at ``long_tokens``:
    the line through the two (:func:`disagg.measurements.fit_handoff`: the fixed cost and what each
    wire byte of KV adds, as measured). At one length: the fixed cost, with the part that grows with
    the KV priced as ``disagg plan`` prices it."""
    p_host, d_host, p_url = pair
    topo = load_topology(t.file)
    limit = topo.model.max_model_len
    lengths = [HANDOFF_PROBE_TOKENS]
    if long_tokens is not None:
        long_n = long_tokens if limit is None else min(long_tokens, limit - 1)
        if long_n >= HANDOFF_PROBE_LONG_FACTOR * HANDOFF_PROBE_TOKENS:
            lengths.append(long_n)
    try:
        plan = plan_topology(topo, lengths, 0, use_measured_handoff=False)
    except DisaggError as exc:
        return {"stored": False, "why": f"the plan's KV-sized part is unknown: {exc}"}
    count = max(count, HANDOFF_PROBE_MIN_PAIRS)
    headers = {"Authorization": f"Bearer {engine_key}"} if engine_key else None
    # the part of each length's handoff that grows with the KV, as the model prices it
    kv_part_s = [row.handoff_s - plan.link.fixed_s for row in plan.classes]
    found: list[tuple[float, float]] = []          # (fixed cost less the model's KV part, gap) per length
    for n, kv_s in zip(lengths, kv_part_s, strict=True):
        one = await probe_handoff_fixed(t.proxy_url, p_url, t.model, count, kv_s, prompt_tokens=n, seed=seed,
                                        engine_headers=headers)
        if one is None:
            return {"stored": False,
                    "why": "the proxy did not split every probe prompt by its policy (route it with --routing split)"}
        found.append(one)
    gaps = [gap for _, gap in found]
    said = ", ".join(f"{g * 1e3:.1f} ms at {n:,} tokens" for n, g in zip(lengths, gaps, strict=True))
    source = (f"disagg bench compare: median TTFT of {count} splits minus the same prompts straight to {p_url} "
              f"(one at a time): {said}")
    points = [(float(row.kv_bytes), g) for row, g in zip(plan.classes, gaps, strict=True)]
    exposed: float | None
    if len(lengths) == 1:
        fixed, exposed = found[0][0], None
        source += f", less {kv_part_s[0] * 1e3:.1f} ms for the KV as disagg plan prices it ({t.file})"
    else:
        fixed, exposed = fit_handoff(points)
        source += f"; the line through them ({t.file})"
    path = store_handoff(t.run_dir, t.model, p_host, d_host, topo.connector, topo.streaming, fixed, source,
                         exposed_per_byte_s=exposed, points=points if exposed is not None else ())
    return {"stored": True, "fixed_s": fixed, "exposed_per_byte_s": exposed,
            "split_minus_prefill_s": {str(n): g for n, g in zip(lengths, gaps, strict=True)}, "file": str(path)}


def handoff_words(stored: dict[str, Any]) -> str:
    """What :func:`probe_handoff` stored, in words (``disagg bench prefill`` prints it)."""
    per_byte = stored.get("exposed_per_byte_s")
    return (f"{stored['fixed_s'] * 1e3:.1f} ms fixed"
            + ("" if per_byte is None else f" + {per_byte * 2**20 * 1e3:.2f} ms per MiB of KV") + ", stored")


async def probe_engines(t: TopologyUnderTest, prompt_tokens: int, count: int, where: str, seed: int = 0,
                        engine_key: str | None = None) -> dict[str, dict[str, Any]]:
    """Probe each of ``t.prefilling_engines`` straight (:func:`disagg.bench.prefill.probe_engine`:
    its prefill rate and decode step, stored for ``disagg plan`` as its kind of engine), with the
    run's ``engine_key``: host -> what was stored. Called after the sweep by :func:`compare` and by
    ``disagg bench prefill``."""
    topo = load_topology(t.file)
    by_name = {i.name: i for i in topo.instances}
    headers = {"Authorization": f"Bearer {engine_key}"} if engine_key else None
    measured: dict[str, dict[str, Any]] = {}
    for host, engine, url in t.prefilling_engines:
        inst = by_name[engine]
        measured[host] = await probe_engine(
            t.run_dir, t.model, t.dtype, host, engine, url, engine_connector(topo, inst), prompt_tokens, count,
            engine_kv_bytes(topo, inst), where, seed=seed, headers=headers, max_model_len=topo.model.max_model_len)
    return measured


def engine_kv_bytes(topo: Topology, inst: InstanceSpec) -> Callable[[int], float]:
    """The KV bytes of an ``n``-token context in ``inst``'s engine (the topology's model, the
    engine's KV cache dtype): what the decode probe fits its step against
    (:func:`disagg.bench.prefill.fit_decode`)."""
    arch = resolve_model(topo.model.source, local_path=topo.model.path)
    dtype = kv_cache_dtype(topo, (inst, inst))
    return lambda n: float(arch.kv_bytes(n, dtype))


def kept_proxy_log(out_dir: Path, label: str) -> Path:
    """Where :func:`keep_proxy_log` keeps the proxy log of ``label``'s topology in the report
    directory ``out_dir`` (the label's brackets and other characters a shell would read made dashes)."""
    return out_dir / LOGS / f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', label).strip('-')}-{PROXY_LOG}"


def keep_proxy_log(t: TopologyUnderTest, label: str, out_dir: Path, since: float) -> Path | None:
    """Copy ``t``'s proxy log to ``out_dir/logs/LABEL-proxy.log`` (:func:`kept_proxy_log`); the
    copy's path, or None where this ``up`` left no proxy log (another router; an ``up`` that failed
    before the proxy started, leaving an earlier run's log, last written before ``since``, the time
    of the ``up``) or it cannot be copied.
    Called by :func:`compare` after each ``down``."""
    source = t.log_dir / PROXY_LOG
    try:
        # the file system stamps with a coarse clock: allow a second before ``since``
        if not source.is_file() or source.stat().st_mtime < since - 1.0:
            return None
    except OSError:
        return None
    target = kept_proxy_log(out_dir, label)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    except OSError:
        return None
    return target


def compare(files: Sequence[Path], workload: Workload, steps: Sequence[Step], out_dir: Path,
            slo: SLO = NO_SLO, lifecycle: Lifecycle = cli_lifecycle, progress: bool = True,
            probe_count: int = 3, percentiles: Sequence[float] = DEFAULT_PERCENTILES, warmup: int = 1,
            log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
            engine_key: str | None = None, repeats: int = 1,
            routing: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """Bench every topology in turn and write one report into ``out_dir``; returns the report document.

    ``engine_key``: the key ``lifecycle`` starts the engines with (the prefill probe goes
    straight to prefill engines, which answer only with it). ``repeats``: runs per step.
    ``routing``: policies to run each split topology with (:func:`plan_topologies`)."""
    tops = plan_topologies(files, routing, out_dir, log, slo)
    labels: dict[str, int] = {}
    doc: dict[str, dict[str, Any]] = {}
    for t in tops:
        n = labels[t.label] = labels.get(t.label, 0) + 1
        label = t.label if n == 1 else f"{t.label}-{n}"
        load_before_up = os.getloadavg()[0]
        up_at = time.time()
        log(f"disagg bench compare: {label}: up {t.file} (load average {load_before_up:.2f})")
        for line in t.emulated:
            log(f"disagg bench compare: {label}: EMULATED {line}")
        try:
            lifecycle("up", t.file)
            log(f"disagg bench compare: {label}: bench {t.proxy_url} (model {t.model})")
            result, measured, handoff = asyncio.run(_bench_one(t, workload, steps, slo, progress, probe_count,
                                                      percentiles, warmup, engine_key, repeats))
        finally:
            log(f"disagg bench compare: {label}: down {t.file}")
            try:
                lifecycle("down", t.file)
            except DisaggError as exc:
                log(f"disagg bench compare: {label}: down failed: {exc}")
            proxy_log = keep_proxy_log(t, label, out_dir, since=up_at)
            if proxy_log is not None:
                log(f"disagg bench compare: {label}: proxy log kept in {proxy_log}")
        if not all(run.exact_prompts for run in result.runs):
            log(f"disagg bench compare: {label}: no /tokenize answered; prompt lengths are estimates")
        doc[label] = {**result.to_dict(), "topology": str(t.file), "prefill_measured": measured,
                      "loadavg_before_up": load_before_up}
        if t.emulated:
            doc[label]["emulated"] = list(t.emulated)
        if handoff is not None:
            doc[label]["handoff_measured"] = handoff
        if proxy_log is not None:
            doc[label]["proxy_log"] = str(proxy_log)
        if t.routing is not None:
            doc[label].update(source_topology=str(t.source), routing=t.routing)
        write_json(doc, out_dir / "results.json")
    write_report(doc, out_dir, title="disagg bench compare: " + ", ".join(doc))
    return doc

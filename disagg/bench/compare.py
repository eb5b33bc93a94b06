"""``disagg bench compare``: the same workload against several topologies, one report.

For each topology file in turn: ``disagg up FILE --detach`` (returns once every
engine and the proxy are healthy), the sweep against the proxy, optionally a
prefill-rate probe straight to each prefill host's engine, then ``disagg down
FILE`` -- always, also when the bench fails or is interrupted. After each
topology the results so far are written to ``results.json``; at the end the
full report (JSON, Markdown, PNGs) is written to the output directory.

The up/down steps are a :data:`Lifecycle` callable, so tests (and other
launchers) can inject their own.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg.bench.metrics import DEFAULT_PERCENTILES
from disagg.bench.prefill import probe_prefill_rate
from disagg.bench.report import write_json, write_report
from disagg.bench.runner import BenchResult, Step, Target, run_sweep
from disagg.bench.slo import NO_SLO, SLO
from disagg.bench.workload import Workload
from disagg.deployment import build_deployment
from disagg.engines.vllm import served_model_name
from disagg.errors import DisaggError, LaunchError
from disagg.measurements import store_prefill
from disagg.topology import load_topology

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
    engine_urls: tuple[str, ...]
    prefill_engines: tuple[tuple[str, str, str], ...]   # (host name, engine name, engine URL), one per host

    @classmethod
    def load(cls, file: Path) -> TopologyUnderTest:
        """Parse and plan ``file`` (no I/O besides reading it)."""
        dep = build_deployment(load_topology(file))
        topo = dep.topology
        prefill: dict[str, tuple[str, str, str]] = {}
        for eng in dep.engines:
            if eng.instance.role in ("prefill", "both") and eng.host.name not in prefill:
                prefill[eng.host.name] = (eng.host.name, eng.name, eng.url)
        return cls(file=file, label=topo.name, proxy_url=dep.proxy_url, model=served_model_name(topo),
                   run_dir=topo.run_dir, engine_urls=tuple(e.url for e in dep.engines),
                   prefill_engines=tuple(prefill.values()))


async def _bench_one(t: TopologyUnderTest, workload: Workload, steps: Sequence[Step], slo: SLO,
                     progress: bool, probe_count: int, percentiles: Sequence[float],
                     warmup: int, engine_key: str | None) -> tuple[BenchResult, dict[str, Any]]:
    target = Target(t.proxy_url, model=t.model, tokenize_urls=(t.proxy_url, *t.engine_urls))
    result = await run_sweep(target, workload, steps, slo, progress=progress, warmup=warmup,
                             percentiles=percentiles)
    measured: dict[str, Any] = {}
    if probe_count > 0:
        longest = max(c.input_len for c in workload.classes)
        for host, engine, url in t.prefill_engines:
            rate = await probe_prefill_rate(url, t.model, longest, probe_count, seed=workload.seed,
                                            headers={"Authorization": f"Bearer {engine_key}"} if engine_key else None)
            source = (f"disagg bench compare: {probe_count} prompts of {longest} tokens, max_tokens 1, "
                      f"concurrency 1, straight to {engine} at {url} ({t.file})")
            path = store_prefill(t.run_dir, t.model, host, rate, source)
            measured[host] = {"prompt_tokens_per_s": rate, "file": str(path)}
    return result, measured


def compare(files: Sequence[Path], workload: Workload, steps: Sequence[Step], out_dir: Path,
            slo: SLO = NO_SLO, lifecycle: Lifecycle = cli_lifecycle, progress: bool = True,
            probe_count: int = 3, percentiles: Sequence[float] = DEFAULT_PERCENTILES, warmup: int = 1,
            log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
            engine_key: str | None = None) -> dict[str, dict[str, Any]]:
    """Bench every topology in turn and write one report into ``out_dir``; returns the report document.

    ``engine_key``: the key ``lifecycle`` starts the engines with (the prefill probe goes
    straight to prefill engines, which answer only with it)."""
    tops = [TopologyUnderTest.load(Path(f)) for f in files]
    labels: dict[str, int] = {}
    doc: dict[str, dict[str, Any]] = {}
    for t in tops:
        n = labels[t.label] = labels.get(t.label, 0) + 1
        label = t.label if n == 1 else f"{t.label}-{n}"
        log(f"disagg bench compare: {label}: up {t.file}")
        try:
            lifecycle("up", t.file)
            log(f"disagg bench compare: {label}: bench {t.proxy_url} (model {t.model})")
            result, measured = asyncio.run(_bench_one(t, workload, steps, slo, progress, probe_count,
                                                      percentiles, warmup, engine_key))
        finally:
            log(f"disagg bench compare: {label}: down {t.file}")
            try:
                lifecycle("down", t.file)
            except DisaggError as exc:
                log(f"disagg bench compare: {label}: down failed: {exc}")
        if not all(run.exact_prompts for run in result.runs):
            log(f"disagg bench compare: {label}: no /tokenize answered; prompt lengths are estimates")
        doc[label] = {**result.to_dict(), "topology": str(t.file), "prefill_measured": measured}
        write_json(doc, out_dir / "results.json")
    write_report(doc, out_dir, title="disagg bench compare: " + ", ".join(doc))
    return doc

"""disagg.bench.compare with injected up/down and stand-in servers (the real
``disagg up`` lives on another branch; the lead runs compare for real)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from disagg.bench.compare import TopologyUnderTest, compare
from disagg.bench.runner import Step
from disagg.bench.workload import Workload, parse_classes
from disagg.errors import DisaggError, LaunchError

TOPOLOGY = """\
name: {name}
run_dir: {run_dir}
model: {{path: disagg:tiny}}
engine: vllm
link: {{type: loopback}}
proxy: {{host: 127.0.0.1, port: {proxy_port}}}
hosts:
  box: {{address: 127.0.0.1, device: cpu}}
roles:
  both:
    - {{host: box, port: {engine_port}}}
"""


def _topology(tmp_path: Path, name: str, proxy_url: str, engine_url: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(TOPOLOGY.format(name=name, run_dir=tmp_path / "run", proxy_port=proxy_url.rsplit(":", 1)[1],
                                    engine_port=engine_url.rsplit(":", 1)[1]))
    return path


def _workload() -> Workload:
    return Workload(parse_classes("short=30,long=300", output_len=4), num_requests=6, seed=3)


def test_topology_under_test(tmp_path: Path) -> None:
    path = _topology(tmp_path, "colo", "http://127.0.0.1:18000", "http://127.0.0.1:18001")
    t = TopologyUnderTest.load(path)
    assert t.label == "colo" and t.proxy_url == "http://127.0.0.1:18000" and t.model == "tiny"
    assert t.prefill_engines == (("box", "both[0]", "http://127.0.0.1:18001"),)


async def _compare_in_thread(*args: Any, **kwargs: Any) -> dict[str, Any]:
    # compare() runs its own event loop per topology (asyncio.run): call it off the stand-ins' loop
    return await asyncio.to_thread(compare, *args, **kwargs)


async def test_compare_runs_each_topology_between_up_and_down(tmp_path: Path, standin_factory) -> None:
    proxy_a, engine_a = await standin_factory(), await standin_factory()
    proxy_b, engine_b = await standin_factory(), await standin_factory()
    for s in (proxy_a, proxy_b, engine_a, engine_b):
        s.model = "tiny"
    proxy_b.tpot = 0.05          # "b" decodes slower than "a", by more than scheduling noise on a loaded machine
    files = [_topology(tmp_path, "a", proxy_a.url, engine_a.url), _topology(tmp_path, "b", proxy_b.url, engine_b.url)]
    calls: list[tuple[str, str, int]] = []

    def lifecycle(action: str, file: Path) -> None:
        served = len(proxy_a.bodies) + len(proxy_b.bodies)
        calls.append((action, file.stem, served))

    doc = await _compare_in_thread(files, _workload(), [Step(rate=100.0), Step(rate=200.0)], tmp_path / "out",
                                     lifecycle=lifecycle, progress=False, probe_count=2, log=lambda s: None,
                                     engine_key="ek")
    # up a, (bench a), down a, up b, (bench b), down b -- requests only between each up and down
    assert [(a, f) for a, f, _ in calls] == [("up", "a"), ("down", "a"), ("up", "b"), ("down", "b")]
    assert calls[0][2] == 0 and calls[1][2] == 13 and calls[2][2] == 13 and calls[3][2] == 26
    # identical workload: same prompts sent to both proxies
    prompts_a = [b["prompt"] for b in proxy_a.bodies]
    assert prompts_a == [b["prompt"] for b in proxy_b.bodies]
    # the prefill probe went straight to the engines, and was stored
    assert len(engine_a.bodies) == 3 and all(b["max_tokens"] == 1 for b in engine_a.bodies)
    assert engine_a.authorizations == ["Bearer ek"] * 3, "engines answer only with the run's engine key"
    assert set(proxy_a.authorizations) == {None}, "the proxy is not sent the engine key"
    stored = json.loads((tmp_path / "run" / "measurements" / "prefill.json").read_text())
    assert set(stored["tiny"]) == {"box"} and stored["tiny"]["box"]["prompt_tokens_per_s"] > 0
    assert "straight to both[0]" in stored["tiny"]["box"]["source"]
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == json.loads(json.dumps(doc))
    assert list(doc) == ["a", "b"] and len(doc["a"]["runs"]) == 2
    assert doc["b"]["runs"][0]["metrics"]["all"]["tpot"]["mean_ms"] > doc["a"]["runs"][0]["metrics"]["all"]["tpot"][
        "mean_ms"]
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"report.md", "ttft_cdf.png", "goodput_vs_rate.png"}


async def test_compare_always_brings_the_topology_down(tmp_path: Path) -> None:
    # nothing listens on the proxy port: the bench fails after "up"; "down" must still run
    files = [_topology(tmp_path, "dead", "http://127.0.0.1:9", "http://127.0.0.1:10")]
    calls: list[str] = []
    with pytest.raises(DisaggError, match=r"warm-up request to http://127\.0\.0\.1:9/v1/completions failed"):
        await _compare_in_thread(files, _workload(), [Step(rate=10.0)], tmp_path / "out",
                                 lifecycle=lambda a, f: calls.append(a), progress=False, log=lambda s: None)
    assert calls == ["up", "down"]


async def test_compare_downs_after_a_failed_up(tmp_path: Path) -> None:
    files = [_topology(tmp_path, "x", "http://127.0.0.1:9", "http://127.0.0.1:10")]
    calls: list[str] = []

    def lifecycle(action: str, file: Path) -> None:
        calls.append(action)
        if action == "up":
            raise LaunchError("engine both[0] never became healthy")

    with pytest.raises(LaunchError, match="never became healthy"):
        await _compare_in_thread(files, _workload(), [Step(rate=10.0)], tmp_path / "out", lifecycle=lifecycle,
                                 progress=False, log=lambda s: None)
    assert calls == ["up", "down"]


async def test_compare_downs_on_ctrl_c(tmp_path: Path) -> None:
    files = [_topology(tmp_path, "x", "http://127.0.0.1:9", "http://127.0.0.1:10")]
    calls: list[str] = []

    def lifecycle(action: str, file: Path) -> None:
        calls.append(action)
        if action == "up":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        await _compare_in_thread(files, _workload(), [Step(rate=10.0)], tmp_path / "out", lifecycle=lifecycle,
                                 progress=False, log=lambda s: None)
    assert calls == ["up", "down"]

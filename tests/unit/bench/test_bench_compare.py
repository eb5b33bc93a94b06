"""disagg.bench.compare with injected up/down and stand-in servers (the real
``disagg up`` lives on another branch; the lead runs compare for real)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg.bench.compare import TopologyUnderTest, compare, plan_topologies, routing_variant
from disagg.bench.runner import Step
from disagg.bench.slo import SLO
from disagg.bench.workload import Workload, parse_classes
from disagg.commands.bench import routing_policies
from disagg.deployment import build_deployment
from disagg.errors import DisaggError, LaunchError
from disagg.launch.frontend import routing_config
from disagg.proxy.metrics import ProxyMetrics
from disagg.routecost import FIRST_STEP_CPU_BYTES_PER_S
from disagg.topology import load_topology

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
    assert t.prefilling_engines == (("box", "both[0]", "http://127.0.0.1:18001"),)


TWO_HOSTS = """name: {name}
run_dir: {run_dir}
model: {model}
engine: {engine}
connector: {connector}
link: {{type: loopback}}
proxy: {{host: 127.0.0.1, port: 18000}}
hosts:
  p: {{address: 127.0.0.1, device: {device}}}
  d: {{address: 127.0.0.2, device: {device}}}
roles:
  prefill:
    - {{host: p, port: 18100, kv_port: 18998}}
    - {{host: p, port: 18101, kv_port: 18999}}
  decode:
    - {{host: d, port: 18200, kv_port: 18997}}
"""


def test_a_split_topology_probes_one_engine_of_each_host_that_prefills(tmp_path: Path) -> None:
    """vLLM decode engines prefill the prompts the auto routing keeps local, so their host's rate
    seeds the proxy like the prefill host's; SGLang decode engines take no plain request."""
    vllm = tmp_path / "vllm.yaml"
    vllm.write_text(TWO_HOSTS.format(name="v", run_dir=tmp_path / "run", model="disagg:tiny", engine="vllm",
                                 connector="socket", device="cpu"))
    assert TopologyUnderTest.load(vllm).prefilling_engines == (
        ("p", "prefill[0]", "http://127.0.0.1:18100"), ("d", "decode[0]", "http://127.0.0.2:18200"))
    sglang = tmp_path / "sglang.yaml"
    sglang.write_text(TWO_HOSTS.format(name="s", run_dir=tmp_path / "run", model="Qwen/Qwen2.5-0.5B-Instruct",
                                   engine="sglang", connector="mooncake", device="cuda"))
    assert TopologyUnderTest.load(sglang).prefilling_engines == (("p", "prefill[0]", "http://127.0.0.1:18100"),)


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
    # the prefill probe went straight to the engines at two lengths (the longest class's 300 tokens
    # and 37, a warm-up each), then the decode probe (2 short and 2 long prompts, 64 tokens each);
    # both were stored, for an engine without a KV connector (colocated)
    assert [b["max_tokens"] for b in engine_a.bodies] == [1] * 6 + [64] * 4
    assert all(b["ignore_eos"] for b in engine_a.bodies[6:])
    assert engine_a.authorizations == ["Bearer ek"] * 10, "engines answer only with the run's engine key"
    assert set(proxy_a.authorizations) == {None}, "the proxy is not sent the engine key"
    stored = json.loads((tmp_path / "run" / "measurements" / "prefill.json").read_text())
    assert set(stored["tiny"]) == {"box"} and stored["tiny"]["box"]["prompt_tokens_per_s"] > 0
    assert "straight to both[0]" in stored["tiny"]["box"]["source"] and stored["tiny"]["box"]["connector"] == "none"
    assert [n for n, _ in stored["tiny"]["box"]["points"]] == [300, 37]
    decode = json.loads((tmp_path / "run" / "measurements" / "decode.json").read_text())["tiny"]["box"]
    assert decode["connector"] == "none" and len(decode["points"]) == 4 and decode["fixed_s"] > 0
    assert doc["a"]["prefill_measured"]["box"]["decode"]["stored"] is True
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == json.loads(json.dumps(doc))
    assert list(doc) == ["a", "b"] and len(doc["a"]["runs"]) == 2
    assert doc["b"]["runs"][0]["metrics"]["all"]["tpot"]["mean_ms"] > doc["a"]["runs"][0]["metrics"]["all"]["tpot"][
        "mean_ms"]
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"report.md", "ttft_cdf.png", "goodput_vs_rate.png"}


async def test_compare_always_brings_the_topology_down(tmp_path: Path) -> None:
    # nothing listens on the proxy port: the bench fails after "up"; "down" must still run
    files = [_topology(tmp_path, "dead", "http://127.0.0.1:9", "http://127.0.0.1:10")]
    # an earlier run's proxy log, which this `up` (a stand-in starting no proxy) did not replace
    stale = tmp_path / "run" / "runs" / "dead" / "logs" / "proxy.log"
    stale.parent.mkdir(parents=True)
    stale.write_text("an earlier run\n")
    os.utime(stale, (time.time() - 60, time.time() - 60))
    calls: list[str] = []
    with pytest.raises(DisaggError, match=r"warm-up request to http://127\.0\.0\.1:9/v1/completions failed"):
        await _compare_in_thread(files, _workload(), [Step(rate=10.0)], tmp_path / "out",
                                 lifecycle=lambda a, f: calls.append(a), progress=False, log=lambda s: None)
    assert calls == ["up", "down"]
    assert not (tmp_path / "out" / "logs").exists(), "an earlier run's proxy log is not kept as this one's"


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


SPLIT = """\
model: {{path: {model}}}
engine: vllm
connector: nixl
link: {{type: loopback}}
run_dir: {run_dir}
proxy: {{host: 127.0.0.1, port: {proxy_port}}}
hosts:
  box: {{address: 127.0.0.1, device: cpu}}
roles:
  prefill:
    - {{host: box, port: {prefill_port}, kv_port: 5601, cpus: [0], args: [-O0]}}
  decode:
    - {{host: box, port: {decode_port}, kv_port: 5602, cpus: [1]}}
"""

PROBE = {"prefill_host": "box", "decode_host": "box", "sender": "127.0.0.1", "receiver": "127.0.0.1",
         "path": "local", "method": "python", "seconds": 3.0, "streams_bps": {"1": 8e9}, "rtt_s": 0.0001,
         "measured_at": "2026-11-29T09:12:00+00:00"}


def _split(tmp_path: Path, stem: str, proxy_url: str = "http://127.0.0.1:18000", model: str = "disagg:tiny",
           prefill_port: int = 18101, decode_port: int = 18102) -> Path:
    path = tmp_path / "topos" / f"{stem}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SPLIT.format(model=model, run_dir=tmp_path / "run", proxy_port=proxy_url.rsplit(":", 1)[1],
                                 prefill_port=prefill_port, decode_port=decode_port))
    return path


def test_routing_variant_is_the_same_deployment_with_the_policy_set(tmp_path: Path, monkeypatch) -> None:
    original = _split(tmp_path, "pd")
    (tmp_path / "topos" / "pd.probe.json").write_text(json.dumps(PROBE))
    monkeypatch.chdir(tmp_path)                  # run_dir and the embedded model resolve from the working dir
    derived = {p: routing_variant(original, p, tmp_path / "out" / "topologies", "pd") for p in ("auto", "split")}
    assert derived["auto"] == tmp_path / "out" / "topologies" / "pd-auto.yaml"
    data = yaml.safe_load(derived["split"].read_text())
    assert data["routing"] == {"policy": "split"} and data["name"] == "pd"   # same name: same run directory
    assert (tmp_path / "out" / "topologies" / "pd-split.probe.json").read_text() == json.dumps(PROBE)
    dep = build_deployment(load_topology(original))
    for policy, file in derived.items():
        d = build_deployment(load_topology(file))
        assert d.topology.name == "pd" and d.topology.run_dir == dep.topology.run_dir
        assert d.topology.routing.policy == policy
        assert [(e.argv, e.env) for e in d.engines] == [(e.argv, e.env) for e in dep.engines]
    # auto is the default: its copy hands the proxy exactly the original's routing, seeds from the
    # link measurement stored next to the file included (8 Gb/s = 1e9 B/s, not the loopback table;
    # with decode's first step, which reads the KV at 3 GB/s on its one core, folded in)
    seeds = routing_config(dep)
    assert routing_config(build_deployment(load_topology(derived["auto"]))) == seeds
    assert seeds.link_bytes_per_s == pytest.approx(1 / (1 / 1e9 + 1 / FIRST_STEP_CPU_BYTES_PER_S))
    assert routing_config(build_deployment(load_topology(derived["split"]))).policy == "split"
    (tmp_path / "out" / "topologies" / "pd-auto.probe.json").unlink()     # the copy is what keeps the seeds
    assert routing_config(build_deployment(load_topology(derived["auto"]))).link_bytes_per_s != seeds.link_bytes_per_s


def test_routing_variant_pins_a_model_path_relative_to_the_file(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "topos" / "models" / "m").mkdir(parents=True)
    original = _split(tmp_path, "rel", model="./models/m")
    monkeypatch.chdir(tmp_path)
    derived = routing_variant(original, "split", tmp_path / "elsewhere", "rel")
    assert load_topology(derived).model.path == load_topology(original).model.path \
        == str((tmp_path / "topos" / "models" / "m").resolve())
    assert not (tmp_path / "elsewhere" / "rel-split.probe.json").exists()
    with pytest.raises(DisaggError, match="unknown routing policy"):
        routing_variant(original, "fastest", tmp_path / "elsewhere", "rel")


def test_plan_topologies_runs_split_ones_once_per_policy(tmp_path: Path) -> None:
    colo = _topology(tmp_path, "colo", "http://127.0.0.1:18000", "http://127.0.0.1:18001")
    pd = _split(tmp_path, "pd")
    plain = plan_topologies([colo, pd], (), tmp_path / "out")
    assert [(t.label, t.file) for t in plain] == [("colo", colo), ("pd", pd)]
    assert [t.split for t in plain] == [False, True]
    logged: list[str] = []
    tops = plan_topologies([colo, pd, pd], ("auto", "split"), tmp_path / "out", logged.append)
    assert [t.label for t in tops] == ["colo", "pd[auto]", "pd[split]", "pd[auto]", "pd[split]"]
    assert tops[0].file == colo and "colo: not a split topology" in logged[0]
    assert [t.file.name for t in tops[1:]] == ["pd-auto.yaml", "pd-split.yaml", "pd-2-auto.yaml", "pd-2-split.yaml"]
    assert all(t.source == pd for t in tops[1:]) and [t.routing for t in tops[1:3]] == ["auto", "split"]


async def test_compare_with_routing_variants_and_repeats(tmp_path: Path, standin_factory) -> None:
    proxy = await standin_factory()
    proxy.model = "tiny"
    proxy.routes = ProxyMetrics()
    pd = _split(tmp_path, "pd", proxy_url=proxy.url)
    ups: list[str] = []

    logs = tmp_path / "run" / "runs" / "pd" / "logs"

    def lifecycle(action: str, file: Path) -> None:
        if action == "up":
            ups.append(file.name)
            logs.mkdir(parents=True, exist_ok=True)
            (logs / "proxy.log").write_text(f"routing of {file.stem}\n")    # `up` starts the log afresh

    doc = await _compare_in_thread([pd], _workload(), [Step(rate=200.0)], tmp_path / "out", lifecycle=lifecycle,
                                   progress=False, probe_count=0, log=lambda s: None, repeats=2,
                                   routing=("auto", "split"))
    assert ups == ["pd-auto.yaml", "pd-split.yaml"]
    assert list(doc) == ["pd[auto]", "pd[split]"]
    for policy in ("auto", "split"):
        result = doc[f"pd[{policy}]"]
        assert result["routing"] == policy and result["source_topology"] == str(pd)
        assert result["topology"] == str(tmp_path / "out" / "topologies" / f"pd-{policy}.yaml")
        assert result["repeats"] == 2 and [r["repeat"] for r in result["runs"]] == [0, 1]
        # each variant's proxy log is kept before the next `up` of the same run replaces it
        kept = tmp_path / "out" / "logs" / f"pd-{policy}-proxy.log"
        assert result["proxy_log"] == str(kept) and kept.read_text() == f"routing of pd-{policy}\n"
        assert all(sum(sum(v.values()) for v in r["routes"]["routes"].values()) == 6 for r in result["runs"])
        # each request keeps the path the proxy named in its X-Disagg-Route (the stand-in splits
        # prompts of 100 tokens and more: this workload's long class)
        assert {(r["klass"], r["route"]) for run in result["runs"] for r in run["records"]} == \
            {("short", "local"), ("long", "split")}
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| pd[auto] | rate 200/s | all | 12/0 |" in md and "Route mix" in md
    assert "Paths per class" in md


def test_the_handoff_probe_is_for_a_split_topology_of_one_pair(tmp_path: Path) -> None:
    two = tmp_path / "two.yaml"
    two.write_text(TWO_HOSTS.format(name="v", run_dir=tmp_path / "run", model="disagg:tiny", engine="vllm",
                                    connector="socket", device="cpu"))
    assert TopologyUnderTest.load(two).handoff_pair is None          # two prefill engines: which pair is unknown
    one = tmp_path / "one.yaml"
    one.write_text(TWO_HOSTS.format(name="o", run_dir=tmp_path / "run", model="disagg:tiny", engine="vllm",
                                    connector="socket", device="cpu").replace(
        "    - {host: p, port: 18101, kv_port: 18999}\n", ""))
    assert TopologyUnderTest.load(one).handoff_pair == ("p", "d", "http://127.0.0.1:18100")


def test_the_auto_slo_variant_routes_for_the_runs_slo(tmp_path: Path, monkeypatch) -> None:
    """``--routing auto-slo`` is ``auto`` with the run's TTFT and TPOT limits in ``routing.slo``
    (the proxy gets them), and needs such a limit."""
    original = _split(tmp_path, "pd")
    monkeypatch.chdir(tmp_path)
    slo = SLO(ttft=2.0, tpot=0.05, e2el=30.0)
    tops = plan_topologies([original], ("auto", "auto-slo"), tmp_path / "out", slo=slo)
    assert [t.label for t in tops] == ["pd[auto]", "pd[auto-slo]"]
    data = yaml.safe_load((tmp_path / "out" / "topologies" / "pd-auto-slo.yaml").read_text())
    assert data["routing"] == {"policy": "auto", "slo": {"ttft": "2.0s", "tpot": "0.05s"}}
    topo = load_topology(tmp_path / "out" / "topologies" / "pd-auto-slo.yaml")
    assert (topo.routing.slo_ttft_s, topo.routing.slo_tpot_s) == (2.0, 0.05)
    assert load_topology(tmp_path / "out" / "topologies" / "pd-auto.yaml").routing.slo_ttft_s is None
    with pytest.raises(DisaggError, match="auto-slo needs an SLO with a ttft or tpot limit"):
        plan_topologies([original], ("auto-slo",), tmp_path / "out", slo=SLO(e2el=30.0))
    assert routing_policies("auto,auto-slo,split", slo) == ["auto", "auto-slo", "split"]
    with pytest.raises(DisaggError, match="auto-slo needs an SLO"):
        routing_policies("auto-slo", None)

"""benchmarks/emulated_house.py without engines: the topologies it derives, the SLO rule, and how it
reads a bench report (medians over repeats per configuration, rate and class)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.emulated_house import (
    PLAN_LABELS,
    Ratio,
    derive,
    label_of,
    main,
    markdown,
    measured,
    slo_of,
    validate,
)
from disagg.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
HOUSE = ROOT / "topologies" / "house-emulated.yaml"


def test_the_house_and_its_three_relatives(tmp_path: Path) -> None:
    files = derive(HOUSE, Ratio.parse("close=700:384MiB"), tmp_path)
    assert set(files) == {"split", "gamer", "workstation", "replicas"}
    split = load_topology(files["split"])
    assert split.link.type == "emulated" and split.link.rate_bps == 2.5e9
    ws, gamer = split.hosts["workstation"].emulate, split.hosts["gamer"].emulate
    assert ws is not None and gamer is not None
    assert ws.prefill_rate == 700 and ws.kv_memory_bytes == 2 * 2**30 and gamer.kv_memory_bytes == 384 * 2**20
    alone = load_topology(files["gamer"])
    assert alone.colocated and [i.host for i in alone.role("both")] == ["gamer"]
    assert alone.hosts["gamer"].emulate == gamer and alone.role("both")[0].cpus == (0,)
    pool = load_topology(files["replicas"])
    assert [i.host for i in pool.role("both")] == ["gamer", "workstation"]
    assert pool.hosts["workstation"].emulate == ws
    names = {load_topology(p).name for p in files.values()}
    assert len(names) == 4       # four run directories, four cgroup/namespace tags
    # one run_dir per ratio when given: the measurements plan reads stay with the emulation measured
    shared = derive(HOUSE, Ratio.parse("base"), tmp_path / "b", run_dir=tmp_path / "b" / "run")
    assert {load_topology(p).run_dir for p in shared.values()} == {str(tmp_path / "b" / "run")}


def test_the_connector_is_replaced_in_the_split_only(tmp_path: Path) -> None:
    files = derive(HOUSE, Ratio.parse("base"), tmp_path, connector="socket")
    assert load_topology(HOUSE).connector == "nixl"
    assert load_topology(files["split"]).connector == "socket"
    assert all(load_topology(files[c]).colocated for c in ("gamer", "workstation", "replicas"))


def test_the_base_ratio_keeps_the_file(tmp_path: Path) -> None:
    split = load_topology(derive(HOUSE, Ratio.parse("base"), tmp_path)["split"])
    original = load_topology(HOUSE)
    assert split.hosts["workstation"].emulate == original.hosts["workstation"].emulate


def _no_engines(argv: list[str], **_kw: object) -> None:
    raise AssertionError(f"--derive-only ran {argv}")


def test_derive_only_writes_the_four_files_and_starts_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``--derive-only`` writes the ratio's four topologies, prints their paths and runs nothing; on
    the float32 house (a CPU without native bf16) they keep the house's proportions: 6,144 tokens of
    KV on the gamer at 64 KiB a token, the workstation's prefill held to 100 tokens/s."""
    f32 = ROOT / "topologies" / "house-emulated-f32.yaml"
    monkeypatch.setattr("benchmarks.emulated_house.run", _no_engines)
    monkeypatch.setattr("sys.argv", ["emulated_house.py", "--topology", str(f32), "--ratio", "base",
                                     "--derive-only", "--out", str(tmp_path)])
    assert main() == 0
    written = sorted(Path(line) for line in capsys.readouterr().out.splitlines())
    assert [p.name for p in written] == [f"house-emulated-f32-base-{c}.yaml"
                                         for c in ("gamer", "replicas", "split", "workstation")]
    split = load_topology(tmp_path / "base" / "topologies" / "house-emulated-f32-base-split.yaml")
    assert split.model.dtype == "float32" and split.connector == "socket"
    gamer, ws = split.hosts["gamer"].emulate, split.hosts["workstation"].emulate
    assert gamer is not None and ws is not None
    assert gamer.kv_memory_bytes == 384 * 2**20 and ws.prefill_rate == 100
    assert split.run_dir == str(tmp_path / "base" / "run")
    assert not (tmp_path / "base" / "run").exists()       # nothing ran


def test_slo_rule_and_labels() -> None:
    ttft, tpot = slo_of({"gamer_long_ttft_s": 1.5, "workstation_tpot_s": 0.006})
    assert (ttft, tpot) == (3.0, 0.012)
    assert [label_of(x) for x in ("house-emulated-base-gamer", "house-emulated-base-split[auto]",
                                  "house-emulated-base-split[split]", "house-emulated-base-replicas",
                                  "house-emulated-base-split[auto-slo]")] == \
        ["gamer", "auto", "split", "replicas", "auto-slo"]


def _run(rate: float, repeat: int, ttft: float, goodput: float) -> dict:
    m = {"ttft": {"p50_ms": ttft * 1000}, "tpot": {"p50_ms": 10.0}, "goodput": goodput}
    return {"rate": rate, "repeat": repeat, "metrics": {"long": m, "all": m}}


def test_measured_takes_medians_over_repeats() -> None:
    doc = {"house-emulated-base-split[auto]": {"runs": [_run(0.2, 0, 1.0, 0.2), _run(0.2, 1, 3.0, 0.1),
                                                        _run(0.2, 2, 2.0, 0.15), _run(0.4, 0, 5.0, 0.0)]}}
    cell = measured(doc)["auto"][0.2]["long"]
    assert cell["ttft_p50"] == 2.0 and cell["goodput"] == 0.15
    assert (cell["goodput_min"], cell["goodput_max"]) == (0.1, 0.2)
    assert measured(doc)["auto"][0.4]["all"]["ttft_p50"] == 5.0


def _plan(cells: dict[str, tuple[float | None, float, float]]) -> dict:
    """A plan --json of the five: config -> (long TTFT p50 or None when saturated, goodput, saturates at)."""
    return {"configurations": [{"label": PLAN_LABELS[c], "goodput_rps": g, "saturates_at_rps": sat,
                                "classes": [{"class": "long", "ttft_p50_s": t, "tpot_p50_s": 0.01}]}
                               for c, (t, g, sat) in cells.items()]}


def test_validation_checks_ttft_below_saturation_the_ranking_and_a_saturated_verdict() -> None:
    doc = {f"house-emulated-base-{tag}": {"runs": [_run(0.2, 0, ttft, good), _run(0.2, 1, ttft, good)]}
           for tag, ttft, good in (("gamer", 1.0, 0.10), ("workstation", 10.0, 0.0), ("replicas", 1.5, 0.12),
                                   ("split[split]", 3.0, 0.0), ("split[auto]", 3.2, 0.0))}
    plan = _plan({"gamer": (1.1, 0.1, 0.5), "workstation": (None, 0.0, 0.1), "replicas": (2.5, 0.13, 0.6),
                  "split": (2.9, 0.0, 0.3), "auto": (3.0, 0.0, 0.35)})
    out = validate(measured(doc), {"0.2": plan}, ["long"])
    rows = {r["config"]: r for r in out["rows"]}
    assert rows["gamer"]["ttft_ok"] is True                   # 10% off, below 70% of saturation
    assert rows["replicas"]["ttft_ok"] is False               # 67% off
    assert rows["workstation"]["checked"] is False            # saturated in plan: not checked
    assert rows["split"]["checked"] is True and rows["auto"]["checked"] is True
    assert out["ranking_disagreements"] == {"0.2": []}
    # the workstation alone saturates in plan: the split answers sooner, as measured
    assert out["verdicts"]["long"] == {"bench_split_sooner": True, "plan_split_sooner": True, "agree": True}
    # overlapping repeats: a tie, which any verdict of the plan matches
    doc["house-emulated-base-split[split]"]["runs"][1] = _run(0.2, 1, 12.0, 0.0)
    tie = validate(measured(doc), {"0.2": plan}, ["long"])["verdicts"]["long"]
    assert tie == {"bench_split_sooner": "tie", "plan_split_sooner": True, "agree": True}


def test_auto_rows_show_each_class_paths_measured_and_planned() -> None:
    runs = [_run(0.2, k, 1.0, 0.1) for k in range(2)]
    runs[0]["records"] = [{"klass": "long", "route": "split"}, {"klass": "long", "route": "whole"}]
    runs[1]["records"] = [{"klass": "long", "route": "split"}, {"klass": "long", "route": "split"}]
    doc = {"house-emulated-base-split[auto]": {"runs": runs},
           "house-emulated-base-gamer": {"runs": [_run(0.2, 0, 1.0, 0.1)]}}
    got = measured(doc)
    assert got["auto"][0.2]["long"]["routes"] == {"split": 0.75, "whole": 0.25}   # pooled over both repeats
    assert got["gamer"][0.2]["long"]["routes"] is None                           # no record kept a path
    plan = _plan({c: (1.0, 0.1, 1.0) for c in PLAN_LABELS})
    plan["configurations"][-1]["classes"][0]["routes"] = {"split": 0.6, "local": 0.4}
    table = markdown({"validation": validate(got, {"0.2": plan}, ["long"])})
    assert table[0].endswith("| paths bench | plan |")
    auto = next(line for line in table if line.startswith("| 0.2 | auto | long |"))
    assert auto.endswith("| split 75% whole 25% | split 60% local 40% |")
    assert next(line for line in table if line.startswith("| 0.2 | gamer |")).endswith("|  |  |")

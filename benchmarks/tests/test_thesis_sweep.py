"""benchmarks/thesis_sweep.py on small numbers: the scaling helpers, the ratio and "which is best"
logic, the house as plan builds it (measured and estimated), and the command's output."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.thesis_sweep import (
    DECODE_ALONE,
    HOUSE,
    NIL_RPS,
    POOL,
    PREFILL_ALONE,
    Point,
    best_rival,
    compute_ratio,
    goodput,
    grid,
    load_house,
    main,
    rates_text,
    ratio_text,
    scale_decode,
    scale_first_step,
    scale_prefill,
    verdict,
    with_line_rate,
)
from disagg.bench.slo import parse_slo
from disagg.bench.workload import parse_classes
from disagg.kvmath import resolve_model
from disagg.measurements import store_decode, store_prefill
from disagg.planning import LinkEstimate, PrefillEstimate
from disagg.routecost import DecodeLine
from disagg.workload_plan import AUTO, SPLIT, predict

ARCH = resolve_model("disagg:tiny-kvheavy")
SLO = parse_slo("ttft=2471ms,tpot=31ms")
LONG = parse_classes("long=2048:256")


def test_scale_prefill_divides_every_kind_of_time() -> None:
    rate = PrefillEstimate("r", False, ARCH, tokens_per_s=300.0)
    shape = PrefillEstimate("s", False, ARCH, tokens_per_s=1750.0, shape=(5e-4, 2e-8))
    flops = PrefillEstimate("f", True, ARCH, flops_per_s=1e12)
    for p in (rate, shape, flops):
        fast = scale_prefill(p, 4.0)
        for n in (256, 2048):
            assert fast.seconds(n) == pytest.approx(p.seconds(n) / 4)
        assert fast.label == p.label and fast.estimated == p.estimated
    assert scale_prefill(rate, 0.5).rate() == pytest.approx(150.0)
    assert compute_ratio(scale_prefill(rate, 6.0), rate) == pytest.approx(6.0)
    with pytest.raises(ValueError):
        scale_prefill(rate, 0.0)


def test_scale_decode_divides_both_parts() -> None:
    line = DecodeLine(0.006, 1.4e-10, "measured", measured=True)
    fast = scale_decode(line, 2.0)
    assert fast.fixed_s == pytest.approx(0.003) and fast.per_kv_byte_s == pytest.approx(0.7e-10)
    assert fast.step_s(64 * 2**20) == pytest.approx(line.step_s(64 * 2**20) / 2)
    assert fast.measured and fast.source == "measured"
    with pytest.raises(ValueError):
        scale_decode(line, -1.0)


def test_the_link_and_its_first_step() -> None:
    link = LinkEstimate(2.35e9, 2e-4, "2.5gbit", False, first_step_fixed_s=0.008, first_step_wire_bps=3e9)
    at10 = with_line_rate(link, 10e9)
    assert at10.usable_bps == pytest.approx(9.4e9) and at10.bytes_per_s == pytest.approx(9.4e9 / 8)
    assert at10.rtt_s == link.rtt_s
    faster = scale_first_step(link, 2.0)
    assert faster.first_step_fixed_s == pytest.approx(0.004) and faster.first_step_wire_bps == pytest.approx(6e9)
    assert faster.fixed_s < link.fixed_s
    # a measured fixed cost holds the first step already: only the part per KV byte moves
    measured = replace(link, measured_fixed_s=0.02)
    kept = scale_first_step(measured, 2.0)
    assert kept.fixed_s == 0.02 and kept.first_step_wire_bps == pytest.approx(6e9)
    with pytest.raises(ValueError):
        with_line_rate(link, 0)


def _row(prefill: float, decode: float, pool: float, split: float, auto: float) -> dict[str, float]:
    return {PREFILL_ALONE: prefill, DECODE_ALONE: decode, POOL: pool, SPLIT: split, AUTO: auto}


def test_best_rival_and_the_ratio() -> None:
    assert best_rival(_row(0.1, 0.0, 0.2, 9, 9)) == (POOL, 0.2)
    assert best_rival(_row(0.2, 0.0, 0.2, 9, 9)) == (PREFILL_ALONE, 0.2)   # a tie: the first
    assert best_rival(_row(0.0, NIL_RPS / 2, 0.0, 9, 9)) == (None, 0.0)    # near zero serves nothing
    by_rate = {0.1: _row(0.10, 0.0, 0.08, 0.10, 0.11),    # 1.1 x the gamer alone
               0.25: _row(0.16, 0.0, 0.20, 0.22, 0.30),   # 1.5 x the pool
               0.5: _row(0.0, 0.0, 0.04, 0.045, 0.03),    # both below the floor: not counted
               1.0: _row(0.0, 0.0, 0.0, 0.0, 0.0)}
    v = verdict(AUTO, by_rate, threshold=1.2, min_goodput=0.05)
    assert (v.rate, v.rival) == (0.25, POOL)
    assert v.ratio == pytest.approx(1.5) and v.margin == pytest.approx(0.10) and v.holds
    assert v.holds_at == (0.25,)
    s = verdict(SPLIT, by_rate, threshold=1.2, min_goodput=0.05)
    assert s.rate == 0.25 and s.ratio == pytest.approx(1.1) and not s.holds and s.holds_at == ()
    assert ratio_text(v) == "1.50" and ratio_text(s) == "1.10"
    assert v.to_json()["holds_at_rates"] == [0.25] and v.to_json()["best_other"] == POOL


def test_where_the_rivals_serve_nothing_the_ratio_is_infinite() -> None:
    by_rate = {0.25: _row(0.2, 0.0, 0.2, 0.1, 0.5),       # 2.5 x
               0.5: _row(0.0, 0.0, 0.0, 0.1, 0.4),        # inf, 0.4
               0.75: _row(0.0, 0.0, 0.0, 0.1, 0.6)}       # inf, 0.6: the larger margin wins
    v = verdict(AUTO, by_rate)
    assert v.rate == 0.75 and math.isinf(v.ratio) and v.rival is None and v.holds
    assert v.holds_at == (0.25, 0.5, 0.75)
    assert ratio_text(v) == "inf" and v.to_json()["ratio"] is None and v.to_json()["margin_rps"] == 0.6
    nothing = verdict(AUTO, {0.5: _row(0.1, 0.0, 0.1, 0.0, 0.01)})
    assert nothing.rate is None and not nothing.holds and math.isnan(nothing.ratio) and ratio_text(nothing) == "-"
    big = verdict(AUTO, {0.5: _row(0.001, 0.0, 0.0, 0.0, 0.5)})
    assert big.ratio == pytest.approx(500) and ratio_text(big) == ">99"


def test_rates_text_joins_neighbours() -> None:
    rates = (0.1, 0.25, 0.35, 0.5, 1.0)
    assert rates_text((0.25, 0.35, 0.5), rates) == "0.25-0.5"
    assert rates_text((0.1, 0.35, 0.5, 1.0), rates) == "0.1,0.35-1"
    assert rates_text((), rates) == "-"


def test_grid_fills_in_the_house_and_drops_duplicates() -> None:
    base = Point(5.9, 1.0, 192 * 2**20, 2.5e9)
    points = grid(base, [2.0, None], [1.0, None, 4.0], [None], [None, 10e9])
    assert len(points) == 2 * 2 * 1 * 2            # memory 1 and None are the same point
    assert base in points and Point(2.0, 4.0, 192 * 2**20, 10e9) in points


def test_the_house_from_its_estimates(tmp_path: Path) -> None:
    """No measurements in the run directory: plan's own estimates, the workstation at its stated 300 tokens/s."""
    house = load_house(HOUSE, [LONG], SLO, run_dir=str(tmp_path))
    assert house.source.startswith("ESTIMATES") and "300" in house.source
    assert (house.prefill_host, house.decode_host) == ("gamer", "workstation")
    ws = house.layouts[DECODE_ALONE].both[0]
    gamer = house.layouts[PREFILL_ALONE].both[0]
    assert ws.prefill.rate() == pytest.approx(300.0) and ws.prefill.estimated
    assert house.base.compute_ratio == pytest.approx(gamer.prefill.rate() / 300.0)
    assert house.base.prefill_kv_bytes == 192 * 2**20 and house.base.link_bps == pytest.approx(2.5e9)
    assert house.layouts[SPLIT].prefill[0].host == "gamer" and house.layouts[AUTO].decode[0].host == "workstation"
    assert [e.host for e in house.layouts[POOL].both] == ["gamer", "workstation"]


def test_the_house_from_measurements_and_its_factors(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for kind in ("none", "socket"):
        store_prefill(run, "tiny-kvheavy", "gamer", 1750.0, "test", connector=kind)
        store_prefill(run, "tiny-kvheavy", "workstation", 300.0, "test", connector=kind)
        store_decode(run, "tiny-kvheavy", "gamer", 0.006, 1.4e-10, "test", connector=kind)
        store_decode(run, "tiny-kvheavy", "workstation", 0.007, 1.5e-10, "test", connector=kind)
    house = load_house(HOUSE, [LONG], SLO, run_dir=str(run), connector="socket")
    assert house.source.startswith("measured")
    assert house.base.compute_ratio == pytest.approx(1750 / 300)
    assert house.layouts[SPLIT].prefill[0].connector == "socket" and house.layouts[POOL].both[0].connector == "none"

    point = Point(house.base.compute_ratio * 2, 4.0, 768 * 2**20, 10e9)
    split = house.layout_at(SPLIT, point)
    p, d = split.prefill[0], split.decode[0]
    assert p.prefill.seconds(2048) == pytest.approx(house.layouts[SPLIT].prefill[0].prefill.seconds(2048) / 2)
    assert p.kv_capacity_bytes == 768 * 2**20 and p.decode == house.layouts[SPLIT].prefill[0].decode
    assert d.decode.fixed_s == pytest.approx(0.007 / 4) and d.decode.per_kv_byte_s == pytest.approx(1.5e-10 / 4)
    assert d.prefill == house.layouts[SPLIT].decode[0].prefill and d.kv_capacity_bytes == 2 * 2**30
    assert split.link is not None and split.link.usable_bps == pytest.approx(9.4e9)
    pool = house.layout_at(POOL, point)
    assert [e.prefill.rate() for e in pool.both] == pytest.approx([3500.0, 300.0])
    assert pool.link is None
    same = house.layout_at(SPLIT, house.base)      # the house's own factors change nothing
    assert same.prefill[0].prefill.seconds(2048) == pytest.approx(house.layouts[SPLIT].prefill[0].prefill.seconds(2048))
    assert same.decode == house.layouts[SPLIT].decode and same.prefill[0].kv_capacity_bytes == 192 * 2**20
    own = house.layouts[SPLIT].link
    assert same.link is not None and own is not None and same.link.bytes_per_s == pytest.approx(own.bytes_per_s)

    # goodput is predict()'s, without the saturation search
    for config in (POOL, SPLIT, AUTO):
        lay = house.layout_at(config, point)
        for rate in (0.1, 0.5):
            assert goodput(lay, house.mixes[0], rate, SLO) == pytest.approx(
                predict(lay, house.mixes[0], rate, SLO).goodput_rps)


def test_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--run-dir", str(tmp_path), "--workload", "long=2048:256", "--rates", "0.1,0.5",
            "--compute", "house,20", "--memory", "1", "--kv", "house", "--link", "house"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ESTIMATES" in out and "workload long=2048:256:" in out and "2 points x 1 workloads x 2 rates" in out
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (w,) = data["workloads"]
    assert len(w["points"]) == 2 and set(w["points"][0]["goodput_rps"]) == {"0.1", "0.5"}
    assert set(w["points"][0]["goodput_rps"]["0.1"]) == {PREFILL_ALONE, DECODE_ALONE, POOL, SPLIT, AUTO}
    assert w["points"][1]["compute_ratio"] == 20 and w["tally"]["compute"]["20x"]["points"] == 1
    assert main([*argv[:2], "--workload", "bad"]) == 2
    assert "thesis_sweep: error:" in capsys.readouterr().err
    assert main(["--topology", str(tmp_path / "none.yaml")]) == 2
    (tmp_path / "list.yaml").write_text("- 1\n")
    assert main(["--topology", str(tmp_path / "list.yaml")]) == 2
    assert capsys.readouterr().err.count("thesis_sweep: error:") == 2
    with pytest.raises(SystemExit) as exc:
        main(["--kv", "lots"])
    assert exc.value.code == 2

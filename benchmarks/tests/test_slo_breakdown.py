"""benchmarks/slo_breakdown.py: which SLO limit each run's requests crossed, and the paths a real
router logged during that run."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from benchmarks.slo_breakdown import main, parse_decisions, read_report
from disagg.bench.compare import kept_proxy_log
from disagg.proxy.backends import BackendPool
from disagg.proxy.config import RoutingConfig
from disagg.proxy.metrics import ProxyMetrics
from disagg.proxy.router import Router
from disagg.proxy.routes import COMPLETIONS, GenerationRequest, PromptRoute, RequestPlan, RoutePath

LABEL = "one-p-one-d[auto]"


def _router_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Two decisions of a real router (a short prompt local, a long one split at a fast prefill
    engine), the second with the first's handoff in transit, formatted as the proxy's log is."""
    metrics = ProxyMetrics()
    prefill, decode = BackendPool("prefill", ["http://p:1"], metrics), BackendPool("decode", ["http://d:1"], metrics)
    for pool in (prefill, decode):
        pool.mark_up(pool.backends[0])
    router = Router(RoutingConfig(policy="auto", kv_bytes_per_token=1024.0, prefill_tokens_per_s=20000.0,
                                  decode_tokens_per_s=200.0, link_bytes_per_s=1e9, handoff_fixed_s=0.01),
                    prefill, decode, metrics, local=True)
    formatter = logging.Formatter("%(asctime)s disagg-proxy %(levelname)s %(message)s")
    with caplog.at_level(logging.DEBUG, logger="disagg.proxy"):
        for i, prompt in enumerate(("x" * 4000, "y" * 4000)):
            req = GenerationRequest(COMPLETIONS, {"prompt": prompt, "stream": True}, b"{}", {}, f"req-{i}")
            route = PromptRoute(0, req, RoutePath.SPLIT)
            router.route(RequestPlan(req, [route]))
            assert route.path is RoutePath.SPLIT
            router.sent(route, stream=True)
            router.prefill_done(route, prefill.backends[0], 0.05, 1000)
    return [formatter.format(r) for r in caplog.records]


def _record(index: int, ttft: float, tpot: float, tokens: int = 4, error: str | None = None) -> dict[str, object]:
    times = [] if error else [1.0 + ttft + k * tpot for k in range(tokens)]
    return {"index": index, "klass": "long", "send": 1.0, "prompt_tokens": 100, "output_tokens": tokens,
            "chunk_times": times, "error": error}


def test_runs_are_broken_down_by_limit_and_by_the_paths_logged_meanwhile(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lines = _router_lines(caplog)
    decisions = parse_decisions(lines)
    assert [(d.path, d.in_transit) for d in decisions] == [("split", 0), ("split", 1)]
    first = decisions[0].at
    runs = [   # the first run spans both decisions; the second starts after them
        {"label": "rate 2/s", "repeat": 0, "started_at": (first - timedelta(seconds=0.5)).isoformat(),
         "duration_s": 5.0, "records": [_record(0, 0.1, 0.01), _record(1, 3.0, 0.01), _record(2, 3.0, 0.5),
                                        _record(3, 0.2, 0.2), _record(4, 0, 0, error="HTTP 500")]},
        {"label": "rate 2/s", "repeat": 1, "started_at": (first + timedelta(seconds=60)).isoformat(),
         "duration_s": 5.0, "records": [_record(0, 0.1, 0.01)]},
    ]
    doc = {LABEL: {"slo": {"ttft": 2.0, "tpot": 0.1}, "runs": runs}}
    (tmp_path / "results.json").write_text(json.dumps(doc))
    log = kept_proxy_log(tmp_path, LABEL)
    log.parent.mkdir(parents=True)
    log.write_text("\n".join(["unrelated line", *lines]) + "\n")
    first_run, second_run = read_report(tmp_path)
    assert (first_run.good, first_run.requests) == (1, 5)
    assert first_run.missed == {"ttft": 2, "tpot": 2, "failed": 1}
    assert first_run.paths == {"split": 2} and first_run.in_transit == (0, 1)
    assert first_run.tpot_p50_s == pytest.approx((0.01 + 0.2) / 2)   # of 0.01, 0.01, 0.2, 0.5
    assert (second_run.good, second_run.paths, second_run.in_transit) == (1, {}, ())


def test_a_log_from_before_the_in_transit_field_still_parses() -> None:
    old = ("2026-12-03 15:13:00,061 disagg-proxy DEBUG route abc: 525 tokens, 32 out -> whole (decode_load) P=http://p:1"
           " D=-; predicted split 1118.8 ms (score 13122.6); tpot and engines prefill http://p:1 11 in flight 142.6 ms"
           " (line 49.4 ms + n / 2341/s, queued 0, busy 118.6 ms)")
    (d,) = parse_decisions([old])
    assert (d.path, d.in_transit) == ("whole", None)
    assert d.at == datetime(2026, 12, 3, 15, 13, 0, 61000).astimezone()   # local time, made aware


def test_the_command_prints_one_markdown_row_per_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = {"label": "rate 4/s", "repeat": 2, "started_at": "2026-12-03T16:00:00+00:00", "duration_s": 1.0,
           "records": [_record(0, 0.1, 0.3)]}
    (tmp_path / "results.json").write_text(json.dumps({"replicas": {"slo": {"tpot": 0.1}, "runs": [run]}}))
    main([str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "| replicas | rate 4/s | 2 | 0 / 1 | 0 / 1 / 0 / 0 | 300 | - | - |"


def test_another_slo_rescores_the_same_requests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = {"label": "rate 4/s", "repeat": 0, "started_at": "2026-12-03T16:00:00+00:00", "duration_s": 1.0,
           "records": [_record(0, 0.1, 0.3), _record(1, 0.1, 0.05)]}
    (tmp_path / "results.json").write_text(json.dumps({"replicas": {"slo": {"tpot": 0.1}, "runs": [run]}}))
    main([str(tmp_path), "--slo", "tpot=400ms"])
    assert capsys.readouterr().out.splitlines()[-1].startswith("| replicas | rate 4/s | 0 | 2 / 2 | 0 / 0 / 0 / 0 |")
    main([str(tmp_path)])
    assert capsys.readouterr().out.splitlines()[-1].startswith("| replicas | rate 4/s | 0 | 1 / 2 | 0 / 1 / 0 / 0 |")

"""Trace workloads (disagg/bench/trace.py): parsing the Azure CSV and Mooncake JSONL formats, hostile
input, capping to max_model_len, and replay at the trace's offsets against the stand-in server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from disagg.bench.prompts import build_prompts
from disagg.bench.report import text_table, write_markdown
from disagg.bench.runner import Step, Target, run_sweep
from disagg.bench.trace import MAX_LINE, Trace, TraceRequest, cap_lengths, load_trace, parse_timestamp
from disagg.bench.workload import (
    TRACE_ARRIVAL,
    Workload,
    class_sequence,
    parse_classes,
    trace_workload_classes,
)
from disagg.cli import main
from disagg.commands import bench as bench_command
from disagg.errors import DisaggError
from disagg.proxy.config import ENGINE_KEY_ENV

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _azure(path: Path, rows: list[str], header: str = AZURE_HEADER) -> Path:
    path.write_text(header + "".join(r + "\n" for r in rows), encoding="utf-8")
    return path


def _mooncake(path: Path, rows: list[dict[str, object] | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _workload(trace: Trace, **kw: object) -> Workload:
    return Workload(trace_workload_classes(trace), num_requests=len(trace.requests), arrival=TRACE_ARRIVAL,
                    trace=trace, seed=1, **kw)  # type: ignore[arg-type]


def test_seven_digit_timestamps_parse_to_the_nanosecond() -> None:
    a = parse_timestamp("2023-11-16 18:17:03.9799600")
    b = parse_timestamp("2023-11-16 18:17:04.0000001")
    assert b - a == 20_040_100
    assert parse_timestamp("2023-11-16 18:17:04") == b - 100
    assert parse_timestamp("2023-11-16T18:17:04.5Z") == b - 100 + 500_000_000
    assert parse_timestamp("2023-11-16 19:17:04+01:00") == b - 100
    assert parse_timestamp("12.25") == 12_250_000_000                     # plain seconds
    for bad in ("2023-13-16 18:17:03.1", "yesterday", "nan", "2023-11-16 18:17"):
        with pytest.raises(ValueError):
            parse_timestamp(bad)


def test_azure_csv_offsets_and_lengths(tmp_path: Path) -> None:
    f = _azure(tmp_path / "azure.csv", ["2023-11-16 18:17:03.9799600,4808,10",
                                        "2023-11-16 18:17:04.0000000,3180,8",
                                        "2023-11-16 18:17:05.4799600,110,27"])
    t = load_trace(f)
    assert t.format == "azure-csv" and t.rows_read == 3 and t.file == str(f)
    assert [(r.input_len, r.output_len) for r in t.requests] == [(4808, 10), (3180, 8), (110, 27)]
    assert t.offsets() == pytest.approx([0.0, 0.02004, 1.5])
    assert t.offsets(2.0) == pytest.approx([0.0, 0.01002, 0.75])            # twice as fast
    assert t.offsets(0.5) == pytest.approx([0.0, 0.04008, 3.0])
    with pytest.raises(ValueError, match="positive"):
        t.offsets(0)


def test_azure_csv_columns_in_any_order_and_crlf(tmp_path: Path) -> None:
    f = tmp_path / "a.csv"
    f.write_bytes(b"\xef\xbb\xbfGeneratedTokens,TIMESTAMP,ContextTokens\r\n5,2023-11-16 18:17:03.1,7\r\n"
                  b"6,2023-11-16 18:17:03.3,8\r\n\r\n")
    t = load_trace(f)
    assert [(r.offset_s, r.input_len, r.output_len) for r in t.requests] == [(0.0, 7, 5), (pytest.approx(0.2), 8, 6)]


def test_mooncake_jsonl_ignores_other_keys(tmp_path: Path) -> None:
    f = _mooncake(tmp_path / "mc.jsonl", [
        {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]},
        {"timestamp": 30535, "input_length": 6472, "output_length": 26, "hash_ids": [46, 47]},
        "",
        {"timestamp": 32499.5, "input_length": 6, "output_length": 1.0}])
    t = load_trace(f)
    assert t.format == "mooncake-jsonl" and t.rows_read == 3
    assert t.offsets() == pytest.approx([0.0, 3.053, 5.0175])
    assert [(r.input_len, r.output_len) for r in t.requests] == [(6955, 52), (6472, 26), (6, 1)]
    assert t.offsets(4) == pytest.approx([0.0, 0.76325, 1.254375])


def test_limit_stops_reading_early(tmp_path: Path) -> None:
    # the line after the limit is garbage: it is never read
    f = _mooncake(tmp_path / "big.jsonl", [{"timestamp": i * 100, "input_length": 10, "output_length": 2}
                                           for i in range(5)] + ["{not json"])
    t = load_trace(f, limit=3)
    assert len(t.requests) == 3 and t.rows_read == 3 and t.limit == 3 and t.to_dict()["span_s"] == pytest.approx(0.2)
    with pytest.raises(DisaggError, match=r"big.jsonl:6: bad trace line"):
        load_trace(f)
    with pytest.raises(DisaggError, match="bad trace limit 0"):
        load_trace(f, limit=0)


def test_zero_lengths_are_skipped_and_disorder_sorted(tmp_path: Path) -> None:
    f = _azure(tmp_path / "z.csv", ["2023-11-16 18:17:05.0,100,0",
                                    "2023-11-16 18:17:03.0,100,5",
                                    "2023-11-16 18:17:04.0,0,5",
                                    "2023-11-16 18:17:02.5,50,5",
                                    "2023-11-16 18:17:06.0,70,5"])
    t = load_trace(f)
    assert t.rows_read == 5 and t.skipped == 2 and t.reordered == 1
    assert [(r.offset_s, r.input_len) for r in t.requests] == [(0.0, 50), (0.5, 100), (3.5, 70)]
    d = t.to_dict()
    assert d["skipped_zero_length"] == 2 and d["reordered"] == 1 and d["requests"] == 3


@pytest.mark.parametrize(("name", "content", "message"), [
    ("e.csv", "", "empty trace"),
    ("blank.jsonl", "\n  \n", "empty trace"),
    ("h.csv", AZURE_HEADER, "no usable request"),
    ("zeros.csv", AZURE_HEADER + "2023-11-16 18:17:03.0,0,5\n", r"no usable request .*1 rows read, 1 with a zero"),
    ("hdr.csv", "time,in,out\n1,2,3\n", r"hdr.csv:1: a CSV trace needs the header TIMESTAMP"),
    ("neg.csv", AZURE_HEADER + "2023-11-16 18:17:03.0,5,5\n2023-11-16 18:17:04.0,-3,5\n",
     r"neg.csv:3: bad trace row .*ContextTokens -3 is negative"),
    ("frac.csv", AZURE_HEADER + "2023-11-16 18:17:03.0,5.5,5\n",
     r"frac.csv:2: .*ContextTokens '5.5' is not an integer"),
    ("ts.csv", AZURE_HEADER + "\n2023-11-16 18:17:03.0,5,5\n16/11/2023,5,5\n", r"ts.csv:4: bad trace row"),
    ("cols.csv", AZURE_HEADER + "2023-11-16 18:17:03.0,5\n", r"cols.csv:2: .*2 fields, the header has 3"),
    ("key.jsonl", '{"timestamp": 1, "input_length": 5}\n', r"key.jsonl:1: .*missing output_length"),
    ("neg.jsonl", '{"timestamp": 1, "input_length": 5, "output_length": 1}\n'
                  '{"timestamp": 2, "input_length": 5, "output_length": -1}\n', r"neg.jsonl:2: .*is negative"),
    ("huge.jsonl", '{"timestamp": 1, "input_length": 1e30, "output_length": 1}\n', r"huge.jsonl:1: .*beyond"),
    ("ts.jsonl", '{"timestamp": "soon", "input_length": 5, "output_length": 1}\n', r"ts.jsonl:1: .*milliseconds"),
    ("nan.jsonl", '{"timestamp": NaN, "input_length": 5, "output_length": 1}\n', r"nan.jsonl:1: .*milliseconds"),
    ("bool.jsonl", '{"timestamp": 1, "input_length": true, "output_length": 1}\n', r"bool.jsonl:1: .*not an integer"),
    ("list.jsonl", '{"timestamp": 1, "input_length": 5, "output_length": 1}\n[1, 2]\n', r"list.jsonl:2: .*not a JSON"),
    ("cut.jsonl", '{"timestamp": 1, "input_length": 5, "output_length": 1}\n{"timestamp": 2, "inp\n',
     r"cut.jsonl:2: bad trace line"),
])
def test_hostile_input_names_file_and_line(tmp_path: Path, name: str, content: str, message: str) -> None:
    (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(DisaggError, match=message):
        load_trace(tmp_path / name)


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(DisaggError, match="cannot read the trace"):
        load_trace(tmp_path / "missing.csv")
    (tmp_path / "bin.csv").write_bytes(AZURE_HEADER.encode() + b"2023-11-16 18:17:03.0,5,5\n\xff\xfe,1,1\n")
    with pytest.raises(DisaggError, match=r"bin\.csv:3: not UTF-8"):
        load_trace(tmp_path / "bin.csv")
    (tmp_path / "long.jsonl").write_bytes(b'{"timestamp": 1, "input_length": 5, "output_length": 1}\n'
                                          + b" " * (MAX_LINE + 5) + b"\n")
    with pytest.raises(DisaggError, match=r"long\.jsonl:2: line longer than"):
        load_trace(tmp_path / "long.jsonl")


def test_cap_lengths() -> None:
    assert cap_lengths(100, 20, 1000) == (100, 20)
    assert cap_lengths(990, 20, 1000) == (990, 10)                  # the answer gets what is left
    assert cap_lengths(5000, 20, 1000) == (999, 1)                  # the prompt keeps what it can
    assert cap_lengths(1000, 1, 1000) == (999, 1)


def test_trace_workload_has_one_class_and_trace_arrivals(tmp_path: Path) -> None:
    t = load_trace(_mooncake(tmp_path / "t.jsonl", [{"timestamp": i, "input_length": 10 * (i + 1),
                                                     "output_length": 3} for i in range(5)]))
    w = _workload(t)
    assert [(c.name, c.input_len, c.output_len) for c in w.classes] == [("trace", 30, 3)]     # medians
    assert class_sequence(w) == ["trace"] * 5
    with pytest.raises(ValueError, match="arrival 'trace'"):
        Workload(parse_classes("a=1"), num_requests=5, trace=t)
    with pytest.raises(ValueError, match="one request per trace request"):
        Workload(w.classes, num_requests=4, arrival=TRACE_ARRIVAL, trace=t)


async def test_prompts_follow_the_trace_lengths_capped_to_max_model_len(standin, tmp_path: Path) -> None:
    # the stand-in's max_model_len is 10000 and it counts characters + BOS
    t = load_trace(_mooncake(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 30, "output_length": 4},
        {"timestamp": 10, "input_length": 20_000, "output_length": 50},
        {"timestamp": 20, "input_length": 9_990, "output_length": 30}]))
    w = _workload(t)
    async with aiohttp.ClientSession() as s:
        prompts = await build_prompts(s, [standin.url], standin.model, w, class_sequence(w))
        estimated = await build_prompts(s, [], standin.model, w, class_sequence(w), chars_per_token=1.0)
    assert [(p.input_len, p.output_len, p.capped) for p in prompts] == [(30, 4, False), (9_999, 1, True),
                                                                         (9_990, 10, True)]
    assert all(p.exact for p in prompts) and [len(p.text) + 1 for p in prompts] == [30, 9_999, 9_990]
    # no /tokenize: max_model_len unknown, lengths as the trace says, nothing checked
    assert [(p.input_len, p.capped) for p in estimated] == [(30, None), (20_000, None), (9_990, None)]


async def test_runner_sends_at_the_trace_offsets_divided_by_the_time_scale(standin, tmp_path: Path) -> None:
    standin.tpot = 0.001
    f = _azure(tmp_path / "azure.csv", ["2023-11-16 18:17:03.9799600,20,2",
                                        "2023-11-16 18:17:04.1799600,30,3",
                                        "2023-11-16 18:17:04.5799600,40,2",
                                        "2023-11-16 18:17:04.5799600,25,4",
                                        "2023-11-16 18:17:04.9799600,20,2"])
    w = _workload(load_trace(f))
    result = await run_sweep(Target(standin.url), w, [Step(time_scale=2.0), Step(time_scale=4.0, concurrency=8)],
                             progress=False)
    want = [0.0, 0.2, 0.6, 0.6, 1.0]
    for run, scale in zip(result.runs, (2.0, 4.0), strict=True):
        sends = [r.send for r in run.records]
        assert all(r.success for r in run.records) and run.capped == 0 and run.exact_prompts
        for got, offset in zip(sends, want, strict=True):
            assert offset / scale - 0.002 <= got < offset / scale + 0.15, (scale, sends)
        assert run.step.label == f"trace x{scale:g}"
        assert run.x == pytest.approx(run.metrics["all"].request_throughput)
        assert [r.prompt_tokens for r in run.records] == [20, 30, 40, 25, 20]
        assert [r.output_tokens for r in run.records] == [2, 3, 2, 4, 2]
    d = result.to_dict()
    assert d["workload"]["arrival"] == "trace" and d["workload"]["trace"]["file"] == str(f)
    assert d["workload"]["trace"]["requests"] == 5
    assert [r["time_scale"] for r in d["runs"]] == [2.0, 4.0] and [r["capped"] for r in d["runs"]] == [0, 0]
    doc = {"standin": d}
    table = text_table(doc)
    assert f"trace standin: trace {f} (azure-csv): 5 requests of 5 rows read" in table
    assert "time scale x2, x4; 0 capped to max_model_len" in table
    md = write_markdown(doc, tmp_path / "report.md").read_text()
    assert "Workload from a trace" in md and "0 capped to max_model_len" in md


async def test_duration_bounds_a_trace_replay(standin, tmp_path: Path) -> None:
    f = _mooncake(tmp_path / "t.jsonl", [{"timestamp": ms, "input_length": 10, "output_length": 1}
                                         for ms in (0, 50, 5_000, 10_000)])
    w = Workload(trace_workload_classes(load_trace(f)), num_requests=4, arrival=TRACE_ARRIVAL,
                 trace=load_trace(f), duration_s=1.0)
    result = await run_sweep(Target(standin.url, tokenize_urls=None), w, [Step(time_scale=1.0)], progress=False)
    run = result.runs[0]
    assert len(run.records) == 2 and run.capped is None and run.duration_s < 1.0


async def test_bench_serve_with_a_trace(standin, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    standin.tpot = 0.001
    f = _mooncake(tmp_path / "mc.jsonl", [{"timestamp": 100 * i, "input_length": [15, 12_000][i % 2],
                                           "output_length": 3, "hash_ids": [i]} for i in range(6)])
    argv = ["bench", "serve", standin.url, "--trace", str(f), "--time-scale", "5", "--trace-limit", "4",
            "--json", str(tmp_path / "r.json"), "--no-progress", "--label", "s"]
    assert await asyncio.to_thread(main, argv) == 0
    out = capsys.readouterr().out
    assert f"trace s: trace {f} (mooncake-jsonl): 4 requests of 4 rows read, --trace-limit 4" in out
    assert "time scale x5; 2 capped to max_model_len" in out
    run = json.loads((tmp_path / "r.json").read_text())["s"]["runs"][0]
    assert run["label"] == "trace x5" and run["capped"] == 2 and run["metrics"]["all"]["completed"] == 4
    assert set(run["metrics"]) == {"all", "trace"}
    assert [b["max_tokens"] for b in standin.bodies[1:]] == [3, 1, 3, 1]     # after the warm-up


@pytest.mark.parametrize(("extra", "message"), [
    (["--rates", "2"], "drop --rates"),
    (["--classes", "a=5", "-n", "3"], "drop --classes, --num-requests"),
    (["--arrival", "closed", "--concurrency", "2"], "drop --arrival"),
    (["--concurrency", "1,2"], "one cap"),
    (["--time-scale", "0"], "every value must be positive"),
    (["--time-scale", "inf"], "must be finite"),
    (["--trace-limit", "0"], "bad trace limit 0"),
])
def test_trace_option_errors(tmp_path: Path, extra: list[str], message: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    f = _azure(tmp_path / "a.csv", ["2023-11-16 18:17:03.9799600,20,2"])
    assert main(["bench", "serve", "http://x:1", "--trace", str(f), *extra]) == 2
    assert message in capsys.readouterr().err


def test_trace_options_need_a_trace_and_bad_files_fail_before_any_request(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "http://x:1", "--time-scale", "2"]) == 2
    assert "go with --trace FILE" in capsys.readouterr().err
    f = _azure(tmp_path / "bad.csv", ["2023-11-16 18:17:03.9799600,20,2", "2023-11-16 18:17:04,x,2"])
    assert main(["bench", "serve", "http://x:1", "--trace", str(f)]) == 2
    assert f"{f}:3: bad trace row" in capsys.readouterr().err


def test_bench_compare_passes_the_trace_workload(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: dict[str, object] = {}

    def fake_compare(files: list[Path], workload: Workload, steps: list[Step], out: Path,
                     **kwargs: object) -> dict[str, object]:
        seen.update(workload=workload, steps=steps)
        return {}

    monkeypatch.setattr(bench_command, "compare", fake_compare)
    monkeypatch.setenv(ENGINE_KEY_ENV, "test-key")
    f = _azure(tmp_path / "a.csv", ["2023-11-16 18:17:03.9799600,20,2", "2023-11-16 18:17:04.9799600,40,4"])
    assert main(["bench", "compare", "a.yaml", "--trace", str(f), "--time-scale", "1,2", "--concurrency", "3",
                 "--out", str(tmp_path / "o"), "--prefill-probe", "0"]) == 0
    w = seen["workload"]
    assert isinstance(w, Workload) and w.trace is not None and w.num_requests == 2 and w.arrival == "trace"
    assert w.trace.requests == (TraceRequest(0.0, 20, 2), TraceRequest(1.0, 40, 4))
    assert seen["steps"] == [Step(time_scale=1.0, concurrency=3), Step(time_scale=2.0, concurrency=3)]

"""disagg top's screen: what each line says, and the in-place redraw."""

from __future__ import annotations

from disagg.watch.render import CLEAR_BELOW, HOME, fmt_bytes_rate, redraw, render
from disagg.watch.snapshot import EngineRow, Latency, Snapshot


def snapshot(**changes: object) -> Snapshot:
    fields: dict[str, object] = dict(
        run="house", proxy_url="http://127.0.0.1:8000", proxy_error=None, rate_interval_s=1.0, window_s=60.0,
        active_requests=3.0, requests_per_s=2.5, decisions_per_s=3.0, handoff_bytes_per_s=1.25e9,
        ttft=Latency(0.12, 0.84, 37), tpot=Latency(0.021, 0.06, 30),
        routes={"split": 30.0, "local": 10.0}, route_reasons={"split/predicted": 30.0, "local/predicted": 10.0},
        fallbacks={}, errors={"upstream prefill/timeout": 2.0},
        engines=[EngineRow("prefill[0]", "prefill", "gaming-pc", "running", 0, True, 1.0, 0.0, 0.123, None),
                 EngineRow("decode[0]", "decode", "local", "backoff", 3, None, None, None, None, "refused")])
    fields.update(changes)
    return Snapshot(**fields)  # type: ignore[arg-type]


def test_the_screen_says_what_a_person_looks_for_first() -> None:
    lines = render(snapshot(), clock="12:00:00")
    text = "\n".join(lines)
    assert lines[0] == "disagg top - house   proxy http://127.0.0.1:8000   12:00:00"
    assert "requests 2.5/s   routing decisions 3.0/s   active 3   handoff 1.25 GB/s   (rates over 1.0 s)" in text
    assert "last 60 s:" in text
    assert "TTFT p50 120 ms  p99 840 ms  (37 requests)" in text
    assert "TPOT p50 21 ms  p99 60 ms  (30 requests)" in text
    assert "routes     split 30 (75%), local 10 (25%)" in text
    assert "fallbacks  none" in text and "errors     upstream prefill/timeout 2" in text
    prefill = next(line for line in lines if line.startswith("prefill[0]"))
    assert prefill.split() == ["prefill[0]", "prefill", "gaming-pc", "ok", "running", "1", "0", "12.3%", "0"]
    decode = next(line for line in lines if line.startswith("decode[0]"))
    assert decode.split()[3:] == ["down", "backoff", "-", "-", "-", "3", "(refused)"]


def test_without_the_proxy_or_samples() -> None:
    text = "\n".join(render(snapshot(proxy_error="HTTP 404", ttft=Latency(None, None, 0), requests_per_s=None,
                                     handoff_bytes_per_s=None, rate_interval_s=None, window_s=None)))
    assert "proxy metrics: unavailable (HTTP 404)" in text
    assert "TTFT -" in text and "requests -" in text and "handoff -" in text
    assert "since the proxy started:" in text and "rates over" not in text


def test_redraw_overwrites_in_place() -> None:
    out = redraw(["a", "bb"])
    assert out.startswith(HOME) and out.endswith(CLEAR_BELOW)
    assert out == HOME + "a\x1b[K\nbb\x1b[K\n" + CLEAR_BELOW


def test_byte_rates() -> None:
    rates = [fmt_bytes_rate(v) for v in (12.0, 4.5e3, 3.2e6, 1.25e9)]
    assert rates == ["12 B/s", "4.50 kB/s", "3.20 MB/s", "1.25 GB/s"]

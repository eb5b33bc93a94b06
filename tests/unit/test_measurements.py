"""The on-disk measurement files: prefill rates and probe-link results."""

from __future__ import annotations

import json

import pytest

from disagg.errors import StateError
from disagg.measurements import (
    LinkMeasurement,
    load_link,
    load_prefill,
    lookup_prefill,
    prefill_path,
    probe_path,
    store_link,
    store_prefill,
)


def test_prefill_round_trip_and_merge(tmp_path) -> None:
    assert load_prefill(tmp_path) == {}
    store_prefill(tmp_path, "tiny", "local", 1234.5, "disagg bench test", measured_at="2026-01-01T00:00:00+00:00")
    store_prefill(tmp_path, "tiny", "other", 99.0, "bench")
    found = lookup_prefill(tmp_path, "tiny", "local")
    assert found is not None and found.prompt_tokens_per_s == 1234.5
    assert found.measured_at == "2026-01-01T00:00:00+00:00" and found.source == "disagg bench test"
    assert set(load_prefill(tmp_path)["tiny"]) == {"local", "other"}
    assert lookup_prefill(tmp_path, "tiny", "nowhere") is None
    raw = json.loads(prefill_path(tmp_path).read_text())
    assert raw["tiny"]["local"]["prompt_tokens_per_s"] == 1234.5   # the documented schema


def test_a_prefill_rate_holds_for_the_dtype_it_was_measured_with(tmp_path) -> None:
    store_prefill(tmp_path, "tiny", "local", 222.9, "bf16 on a CPU without native bf16", dtype="bfloat16")
    assert lookup_prefill(tmp_path, "tiny", "local", "float32") is None
    assert lookup_prefill(tmp_path, "tiny", "local") is None                    # auto is another dtype too
    assert lookup_prefill(tmp_path, "tiny", "local", "bfloat16").prompt_tokens_per_s == 222.9  # type: ignore[union-attr]
    # an entry stored before the field existed counts as auto
    raw = json.loads(prefill_path(tmp_path).read_text())
    raw["tiny"]["old"] = {"prompt_tokens_per_s": 1000.0, "measured_at": "", "source": "old"}
    prefill_path(tmp_path).write_text(json.dumps(raw))
    assert lookup_prefill(tmp_path, "tiny", "old").prompt_tokens_per_s == 1000.0  # type: ignore[union-attr]
    assert lookup_prefill(tmp_path, "tiny", "old", "float32") is None


def test_prefill_store_replaces_an_entry(tmp_path) -> None:
    store_prefill(tmp_path, "m", "h", 10.0, "a")
    store_prefill(tmp_path, "m", "h", 20.0, "b")
    assert lookup_prefill(tmp_path, "m", "h").prompt_tokens_per_s == 20.0  # type: ignore[union-attr]


@pytest.mark.parametrize(("text", "error"), [
    ("{not json", "Invalid JSON"),
    ('{"m": {"h": {"prompt_tokens_per_s": -1}}}', r"m\.h\.prompt_tokens_per_s: Input should be greater than 0"),
    ('["x"]', "expected an object"),
    ('{"m": {"h": {"source": "no rate"}}}', r"m\.h\.prompt_tokens_per_s: Field required"),
    ('{"m": {"h": {"prompt_tokens_per_s": true}}}', r"m\.h\.prompt_tokens_per_s: Input should be a valid number"),
    ('{"m": {"h": {"prompt_tokens_per_s": "1e3"}}}', r"m\.h\.prompt_tokens_per_s: Input should be a valid number"),
    ('{"m": {"h": {"prompt_tokens_per_s": 1e3, "points": [[128, 0]]}}}', r"m\.h\.points\.0\.1: .*greater than 0"),
])
def test_corrupt_prefill_file_names_it_and_the_field(tmp_path, text: str, error: str) -> None:
    prefill_path(tmp_path).parent.mkdir(parents=True)
    prefill_path(tmp_path).write_text(text)
    with pytest.raises(StateError, match=r"prefill\.json: " + error):
        load_prefill(tmp_path)


def test_probe_round_trip(tmp_path) -> None:
    topo = tmp_path / "site.yaml"
    assert probe_path(topo) == tmp_path / "site.probe.json"
    assert load_link(topo) is None
    m = LinkMeasurement("p", "d", "10.0.0.1", "10.0.0.2", "ssh", "python", 3.0,
                        {1: 2.2e9, 2: 2.35e9, 4: 2.3e9}, 2e-4, "2026-01-01T00:00:00+00:00")
    store_link(topo, m)
    back = load_link(topo)
    assert back == m
    assert back.best_streams == 2 and back.best_bps == 2.35e9


def test_bad_probe_file(tmp_path) -> None:
    (tmp_path / "site.probe.json").write_text('{"prefill_host": "p"}')
    with pytest.raises(StateError, match=r"site.probe.json: decode_host: .*not a probe-link result.*probe-link"):
        load_link(tmp_path / "site.yaml")


def test_a_pair_s_handoff_is_kept_per_model_pair_and_connector(tmp_path) -> None:
    from disagg.measurements import handoff_path, lookup_handoff, store_handoff

    run = tmp_path / "run"
    assert lookup_handoff(run, "m", "gamer", "workstation", "nixl") is None
    store_handoff(run, "m", "gamer", "workstation", "nixl", False, 0.052, "probe",
                  measured_at="2026-12-04T10:00:00+00:00")
    store_handoff(run, "m", "gamer", "workstation", "socket", True, 0.041, "streamed probe")
    found = lookup_handoff(run, "m", "gamer", "workstation", "nixl")
    assert found is not None and found.fixed_s == 0.052 and found.date == "2026-12-04" and found.source == "probe"
    assert lookup_handoff(run, "m", "gamer", "workstation", "socket") is None         # only the streamed one
    streamed = lookup_handoff(run, "m", "gamer", "workstation", "socket", streaming=True)
    assert streamed is not None and streamed.fixed_s == 0.041
    assert lookup_handoff(run, "m", "workstation", "gamer", "nixl") is None           # the other way round
    assert lookup_handoff(run, "other", "gamer", "workstation", "nixl") is None
    data = json.loads(handoff_path(run).read_text())
    assert set(data["m"]["gamer -> workstation"]) == {"nixl", "socket streamed"}
    with pytest.raises(ValueError):
        store_handoff(run, "m", "a", "b", "nixl", False, -1.0, "x")
    handoff_path(run).write_text('{"m": {"gamer -> workstation": {"nixl": {"fixed_s": "fast"}}}}')
    with pytest.raises(StateError, match="fixed_s"):
        lookup_handoff(run, "m", "gamer", "workstation", "nixl")


def test_a_handoff_probed_at_two_lengths_keeps_its_line_and_points(tmp_path) -> None:
    from disagg.measurements import handoff_path, lookup_handoff, store_handoff

    run = tmp_path / "run"
    store_handoff(run, "m", "gamer", "workstation", "socket", True, 0.020, "probe",
                  exposed_per_byte_s=2e-9, points=[(1e6, 0.022), (8e6, 0.036)])
    found = lookup_handoff(run, "m", "gamer", "workstation", "socket", streaming=True)
    assert found is not None and found.fixed_s == 0.020 and found.exposed_per_byte_s == 2e-9
    assert found.points == ((1e6, 0.022), (8e6, 0.036))
    store_handoff(run, "m", "gamer", "workstation", "nixl", False, 0.050, "one length")
    one = lookup_handoff(run, "m", "gamer", "workstation", "nixl")
    assert one is not None and one.exposed_per_byte_s is None and one.points == ()
    with pytest.raises(ValueError, match="exposed_per_byte_s"):
        store_handoff(run, "m", "a", "b", "nixl", False, 0.01, "x", exposed_per_byte_s=-1e-9)
    for bad, field in (('{"fixed_s": 0.01, "exposed_per_byte_s": true}', "exposed_per_byte_s"),
                       ('{"fixed_s": 0.01, "exposed_per_byte_s": 1e-9, "points": [[1, "x"]]}', "points"),
                       ('{"exposed_per_byte_s": 1e-9}', "fixed_s"),
                       ('[0.01]', r"gamer -> workstation\.nixl: expected an object")):
        handoff_path(run).write_text(json.dumps({"m": {"gamer -> workstation": {"nixl": json.loads(bad)}}}))
        with pytest.raises(StateError, match=field):
            lookup_handoff(run, "m", "gamer", "workstation", "nixl")


@pytest.mark.parametrize(("points", "expected"), [
    ([(1e6, 0.022), (8e6, 0.036)], (0.020, 2e-9)),              # the line through two lengths
    ([(1e6, 0.022), (1e6, 0.024), (8e6, 0.036)], (0.02114, 1.857e-9)),
    ([(1e6, 0.030), (8e6, 0.028)], (0.029, 0.0)),                # shrinking with the KV: noise, the mean
    ([(1e6, 0.001), (8e6, 0.036)], (0.0, 0.0185 / 4.5e6)),       # a fixed cost below 0: none, through the mean
])
def test_a_handoff_line_is_fitted_to_its_points(points, expected) -> None:
    from disagg.measurements import fit_handoff

    fixed, per_byte = fit_handoff(points)
    assert fixed == pytest.approx(expected[0], abs=1e-4) and per_byte == pytest.approx(expected[1], rel=0.05)
    with pytest.raises(ValueError, match="two prompt lengths"):
        fit_handoff([(1e6, 0.02), (1e6, 0.03)])

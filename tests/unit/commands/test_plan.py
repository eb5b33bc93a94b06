"""`disagg plan` from the command line: the table a newcomer reads, and --json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg import topology
from disagg.cli import main


@pytest.fixture(autouse=True)
def _state_of_this_test_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The repo's topologies keep their state under the default run_dir (``.disagg`` in the
    working directory), where a developer's ``disagg bench`` and ``probe-link`` store what the
    plan reads: each test here reads a run_dir of its own, empty as in a fresh clone."""
    monkeypatch.setattr(topology, "DEFAULT_RUN_DIR", str(tmp_path / "default-run-dir"))


def test_house_table_reads_without_the_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "topologies/house-2g5.yaml", "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert "gamer -> workstation" in out
    assert "128 KiB per token" in out
    assert "ESTIMATE" in out and "RTX 4090" in out
    for prompt in ("256", "2,048", "8,192"):
        assert f"{prompt} tokens: DOES NOT PAY: moving" in out
    assert "Verdicts: PAYS when" in out


def test_json_has_one_entry_per_class(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "topologies/two-sparks-cx7.yaml", "--prompt-tokens", "1k,4096",
                 "--output-tokens", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [c["prompt_tokens"] for c in data["classes"]] == [1024, 4096]
    assert data["classes"][0]["kv_bytes"] == 1024 * 147456      # Qwen3-8B, 144 KiB/token
    # two alike Sparks: a split never answers sooner than the decode host prefilling itself
    assert data["classes"][0]["verdict"] == "marginal"
    assert data["classes"][0]["split_s"] > data["classes"][0]["local_prefill_s"]
    assert data["topology"] == "topologies/two-sparks-cx7.yaml"


def test_what_if_model_and_link(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "topologies/house-2g5.yaml", "--model", "deepseek-v3", "--link", "roce-200g",
                 "--kv-dtype", "fp8", "--prompt-tokens", "8192", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["attention"] == "MLA"
    assert data["classes"][0]["kv_bytes"] == 8192 * 61 * 576
    # the topology's kv_memory_gb: 90 holds
    assert data["classes"][0]["conversations_fit"] == int(90e9 // ((8192 + 256) * 61 * 576))
    # but 671B parameters fit no RTX 4090: no verdict
    assert data["classes"][0]["verdict"] == "does not fit"
    assert "do not fit the prefill host gamer" in data["does_not_fit"]


@pytest.mark.parametrize("model", ["qwen3-32b", "deepseek-v3"])
def test_weights_that_do_not_fit_the_prefill_host_get_no_verdict(capsys: pytest.CaptureFixture[str],
                                                                   model: str) -> None:
    assert main(["plan", "topologies/house-2g5.yaml", "--model", model, "--no-probe"]) == 0
    out = capsys.readouterr().out
    for prompt in ("256", "2,048", "8,192"):
        assert f"{prompt} tokens: DOES NOT FIT: {model}'s weights" in out
    assert "do not fit the prefill host gamer (1 x RTX 4090, 24 GB x 0.9 for vLLM: 21.6 GB)" in " ".join(out.split())
    for verdict in ("tokens: PAYS", "tokens: MARGINAL", "tokens: DOES NOT PAY", "Routing (auto)"):
        assert verdict not in out
    assert "No verdict: " in out


def test_weights_that_do_not_fit_leave_no_kv_room(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "topologies/two-sparks-cx7.yaml", "--model", "deepseek-ai/DeepSeek-V3"]) == 0
    out = capsys.readouterr().out
    assert "the weights do not fit" in out       # 671B params on a 128 GB Spark: estimate is 0
    assert " 0  DOES NOT FIT" in out
    assert "do not fit the prefill host" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--prompt-tokens", "12,abc"], "--prompt-tokens: expected positive integers"),
    (["--model", "acme/Unknown-1B"], "not in the built-in table"),
    (["--kv-dtype", "int3"], "unknown KV cache dtype"),
])
def test_bad_input_is_one_clear_line(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["plan", "topologies/house-2g5.yaml", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("disagg: error: ") and message in err


def test_streaming_what_if_names_the_mode_and_shows_the_transfer_beside_the_handoff(
        capsys: pytest.CaptureFixture[str]) -> None:
    socket = "topologies/local-cpu.yaml"
    assert main(["plan", socket, "--no-probe"]) == 0
    default = capsys.readouterr().out
    assert main(["plan", socket, "--no-probe", "--streaming", "off"]) == 0
    assert capsys.readouterr().out == default                 # the topology does not stream
    assert "streamed" not in default and "transfer" not in default
    assert main(["plan", socket, "--no-probe", "--streaming", "on"]) == 0
    out = capsys.readouterr().out
    assert "streamed layer by layer (2 layers): the KV moves while the prefill computes" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("prompt"))
    assert header.split()[:4] == ["prompt", "KV", "moved", "transfer"]
    assert "(alone)" in out and "(streamed)" in out
    assert "streamed handoff: each layer's KV leaves once the prefill has computed" in out
    assert main(["plan", socket, "--no-probe", "--streaming", "on", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["streaming"] is True and data["streaming_layers"] == 2
    for c in data["classes"]:
        assert c["handoff_s"] == pytest.approx(data["link"]["fixed_s"] + c["exposed_handoff_s"])
        assert c["exposed_handoff_s"] < c["transfer_s"]


def test_streaming_on_is_refused_for_another_connector(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "topologies/house-2g5.yaml", "--streaming", "on"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("disagg: error: --streaming on: only the socket connector streams the KV")
    assert "connector nixl" in err
    assert main(["plan", "topologies/house-2g5.yaml", "--streaming", "off", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["streaming"] is False


def test_rows_stay_within_max_model_len(capsys: pytest.CaptureFixture[str]) -> None:
    # local-cpu-nixl.yaml: max_model_len 4,096; the default 8,192-token row is left out, and said so
    assert main(["plan", "topologies/local-cpu-nixl.yaml", "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert "8,192 tokens:" not in out and "2,048 tokens:" in out
    assert "default prompt lengths of 8,192 tokens left out: longer than max_model_len 4,096" in out
    assert "up to 4,096 tokens" in out
    # asked for, a prompt beyond the context limit is an error
    assert main(["plan", "topologies/local-cpu-nixl.yaml", "--prompt-tokens", "2048,100000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("disagg: error: --prompt-tokens 100,000: longer than the topology's max_model_len "
                          "(4,096 tokens")


def test_link_what_if_takes_a_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "topologies/house-2g5.yaml", "--link", "5gbe", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["link"]["usable_bps"] == pytest.approx(4.7e9)
    assert main(["plan", "topologies/house-2g5.yaml", "--link", "10gbee"]) == 2
    assert "(did you mean '10gbe'?)" in capsys.readouterr().err


def test_the_fixed_handoff_cost_says_what_each_part_is(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "topologies/house-2g5.yaml", "--link", "10gbe", "--prompt-tokens", "2048"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "89.1 ms fixed per request: 30 ms the connector's own (nixl: measured 2026-11-30 on a 2-core CPU" in out
    assert "+ 58.8 ms decode's first step (15 GiB of weights: ESTIMATE, read at GB10 (DGX Spark)'s spec-sheet" in out
    assert "+ 300 µs for 3 round trips of the link (100 µs each)" in out
    assert "for the link's round trips" not in out


TWO_PREFILLS = """\
model: {path: meta-llama/Llama-3.1-8B-Instruct, max_model_len: 16384}
engine: vllm
connector: nixl
link: {type: ethernet, rate: 10gbit}
hosts:
  gamer: {address: 192.168.1.20, device: cuda, gpu: rtx-4090}
  old: {address: 192.168.1.21, device: cuda, gpu: a100-40gb}
  spark: {address: 192.168.1.30, device: cuda, gpu: gb10}
roles:
  prefill:
    - {host: gamer, port: 8100, gpus: [0]}
    - {host: old, port: 8100, gpus: [0]}
  decode:
    - {host: spark, port: 8200, gpus: [0]}
"""


def test_every_prefill_decode_pair_is_planned(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    topo = tmp_path / "2p1d.yaml"
    topo.write_text(TWO_PREFILLS)
    assert main(["plan", str(topo), "--prompt-tokens", "8192", "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert "pair 1 of 2: prefill[0] on gamer -> decode[0] on spark" in out
    assert "pair 2 of 2: prefill[1] on old -> decode[0] on spark" in out
    assert "gamer -> spark" in out and "old -> spark" in out
    assert "RTX 4090" in out and "A100 40GB" in out
    assert main(["plan", str(topo), "--prompt-tokens", "8192", "--no-probe", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(p["prefill_instance"], p["decode_instance"]) for p in data["pairs"]] == [
        ("prefill[0]", "decode[0]"), ("prefill[1]", "decode[0]")]
    assert data["pairs"][0]["classes"] == data["classes"]
    assert data["pairs"][1]["prefill"]["source"] != data["prefill"]["source"]


H100_TO_A100 = """\
model: {path: meta-llama/Llama-3.1-70B-Instruct, max_model_len: 32768}
engine: vllm
connector: nixl
link: {type: ethernet, rate: 100gbit}
hosts:
  p: {address: 10.0.0.1, device: cuda, gpu: h100}
  d: {address: 10.0.0.2, device: cuda, gpu: a100%s}
roles:
  prefill:
    - {host: p, port: 8100, gpus: [0, 1], args: [--tensor-parallel-size, "2"]}
  decode:
    - {host: d, port: 8200, gpus: [0, 1], args: [--tensor-parallel-size, "2"]}
"""


def test_summary_agrees_with_rows_when_the_decode_memory_limits(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    topo = tmp_path / "h.yaml"
    # 70B over two GPUs on each side: the weights fit two A100s, KV for ~8k tokens is left
    topo.write_text(H100_TO_A100 % "")
    assert main(["plan", str(topo), "--no-probe", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["decode_memory"]["kv_bytes"] == pytest.approx(2 * 80e9 * 0.9 - 70.6e9 * 2)
    assert [c["verdict"] for c in data["classes"]] == ["pays", "pays", "pays"]
    lo, hi = data["pays_span_prompt_tokens"]
    assert lo < 256 and 8192 < hi < 32768
    # a decode host with no room for one conversation: every row says so, and so does the summary
    topo.write_text(H100_TO_A100 % ", kv_memory_gb: 0.01")
    assert main(["plan", str(topo), "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert out.count("DOES NOT PAY: not one conversation of this length fits") == 3
    assert "No prompt pays: not one conversation fits in the decode host's KV memory" in out
    assert "The split pays" not in out and "Routing (auto)" not in out


def test_workload_plan_table_and_recommendation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "topologies/house-2g5.yaml", "--no-probe", "--classes",
                 "short=128:32@0.7,long=2048:256@0.3", "--rate", "4", "--slo", "ttft=1s,tpot=50ms"]) == 0
    out = capsys.readouterr().out
    for label in ("colocated on gamer", "colocated on workstation", "replicas (gamer, workstation)",
                  "split gamer -> workstation", "auto gamer -> workstation", "split workstation -> gamer"):
        assert label in out
    assert "TTFT p50" in out and "TPOT p50" in out and "goodput" in out
    assert "Recommendation: " in out and "Which host prefills: gamer" in out
    assert "KV binds: prefill[0] on gamer: at most" in out
    assert "Model: Poisson arrivals" in out


def test_workload_json_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "topologies/house-2g5.yaml", "--no-probe", "--classes", "short=128:32@0.7,long=2048:256@0.3",
            "--rate", "2", "--slo", "ttft=1s,tpot=50ms", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert json.loads(json.dumps(data)) == data
    assert data["workload"]["rate_rps"] == 2.0 and data["slo"] == {"ttft": 1.0, "tpot": 0.05}
    assert [c["name"] for c in data["workload"]["classes"]] == ["short", "long"]
    assert data["workload"]["classes"][1]["kv_bytes"] == (2048 + 256) * 131072
    configs = {c["label"]: c for c in data["configurations"]}
    assert len(configs) == 7
    for c in configs.values():
        assert [k["class"] for k in c["classes"]] == ["short", "long"]
        if c["saturated"] is None:
            assert all(k["ttft_p50_s"] > 0 and k["tpot_p50_s"] > 0 for k in c["classes"])
            assert 0 <= c["goodput_rps"] <= 2.0
        else:
            assert c["goodput_rps"] == 0
    rec = data["recommendation"]
    assert rec["label"] in configs and rec["goodput_rps"] == configs[rec["label"]]["goodput_rps"]
    # the same numbers again: the plan is deterministic
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out) == data


def test_workload_from_a_trace(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "mooncake.jsonl"
    lines = [json.dumps({"timestamp": i * 500, "input_length": n, "output_length": 64, "hash_ids": [1]})
             for i, n in enumerate([100, 120, 3000, 20000, 140])]
    trace.write_text("\n".join(lines) + "\n")
    assert main(["plan", "topologies/house-2g5.yaml", "--no-probe", "--trace", str(trace), "--time-scale", "2",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # 5 requests over 2 s, replayed twice as fast: 4 req/s; 20,000 tokens cut to max_model_len 16,384
    # (one answer token left)
    assert data["workload"]["rate_rps"] == pytest.approx(4.0)
    classes = data["workload"]["classes"]
    assert [(c["name"], c["prompt_tokens"], c["output_tokens"], c["share"]) for c in classes] == [
        ("<256", 120, 64, 0.6), ("1024-4095", 3000, 64, 0.2), ("4096-16383", 16383, 1, 0.2)]
    assert "trace" in data["workload"]["source"] and "x2 time scale" in data["workload"]["source"]


@pytest.mark.parametrize(("args", "match"), [
    (["--classes", "a=100:10"], "needs --rate"),
    (["--rate", "2"], "go with --classes or --trace"),
    (["--classes", "a=100:10", "--rate", "0"], "positive"),
    (["--classes", "bad", "--rate", "1"], "bad prompt class"),
    (["--classes", "a=100:10", "--rate", "1", "--slo", "ttft=fast"], "bad duration"),
])
def test_workload_options_are_checked(args: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "topologies/house-2g5.yaml", *args]) != 0
    assert match in capsys.readouterr().err

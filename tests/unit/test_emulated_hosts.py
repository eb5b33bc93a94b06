"""Emulated hardware per host (``emulate:``): parsing and its errors, what the vLLM adapter makes of
it, what ``check`` and ``bench`` say, and the CPU quota's cgroup on a fake tree (v1 and v2) and on
this machine's real one where it may be written.

The engines themselves (the prefill rate measured back, the KV cap, the quota holding every
process of an engine, the cgroup gone after ``down``) are checked in tests/e2e/test_emulated_link.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from disagg import cpushare
from disagg.bench.report import emulated_lines, text_table
from disagg.commands.basic import describe
from disagg.deployment import build_deployment
from disagg.emulation import cpu_share_for, emulation_lines
from disagg.errors import LaunchError, TopologyError
from disagg.launch.state import RunState
from disagg.topology import parse_size, parse_topology

TOPO = """\
model: {path: "disagg:tiny", max_model_len: 2048}
connector: nixl
hosts:
  gamer: {address: 127.0.0.1, emulate: {kv_memory: 192MiB}}
  workstation: {address: 127.0.0.1, emulate: {prefill_rate: 1500, kv_memory: 2GiB, cpu_share: 0.5}}
roles:
  prefill: [{host: gamer, port: 8100, kv_port: 5601}]
  decode: [{host: workstation, port: 8200, kv_port: 5602}]
"""


def parse(text: str = TOPO):
    return parse_topology(textwrap.dedent(text), "house.yaml", run_dir="/tmp/run")


def error_of(text: str) -> str:
    with pytest.raises(TopologyError) as info:
        parse(text)
    return str(info.value)


def test_emulate_is_parsed_per_host() -> None:
    topo = parse()
    gamer, ws = topo.hosts["gamer"].emulate, topo.hosts["workstation"].emulate
    assert gamer is not None and ws is not None
    assert (gamer.prefill_rate, gamer.kv_memory_bytes, gamer.cpu_share) == (None, 192 * 2**20, None)
    assert (ws.prefill_rate, ws.kv_memory_bytes, ws.cpu_share) == (1500.0, 2 * 2**30, 0.5)
    assert ws.describe() == ("emulated: prefill at most 1,500 tokens/s, KV cache 2 GiB per engine, "
                             "0.5 CPU cores (cgroup quota)")


@pytest.mark.parametrize("text,size", [("256MiB", 256 * 2**20), ("1.5GiB", int(1.5 * 2**30)), ("2GB", 2 * 10**9),
                                       ("4096", 4096), (" 64 M ", 64 * 2**20), ("1T", 2**40)])
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "0", "-1MiB", "12 parsecs", "MiB", "1.2.3GiB"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="expected a positive number of bytes"):
        parse_size(text)


@pytest.mark.parametrize("emulate,message", [
    ("{}", "hosts.gamer.emulate: emulate needs at least one of prefill_rate, kv_memory, cpu_share"),
    ("{prefil_rate: 5}", "hosts.gamer.emulate.prefil_rate: unknown field (did you mean 'prefill_rate'?)"),
    ("{prefill_rate: 0}", "hosts.gamer.emulate.prefill_rate: expected a number greater than 0, got 0"),
    ("{prefill_rate: fast}", "hosts.gamer.emulate.prefill_rate: expected a number, got the string 'fast'"),
    ("{kv_memory: lots}", "hosts.gamer.emulate.kv_memory: bad size 'lots'"),
    ("{kv_memory: 512KiB}", "hosts.gamer.emulate.kv_memory: 512KiB is under 1 MiB"),
    ("{cpu_share: 0}", "hosts.gamer.emulate.cpu_share: expected a number of CPU cores between 0.01 and 1024"),
    ("{cpu_share: true}", "hosts.gamer.emulate.cpu_share: expected a number of CPU cores"),
    ("3", "hosts.gamer.emulate: expected a mapping with prefill_rate"),
])
def test_emulate_errors(emulate: str, message: str) -> None:
    msg = error_of(TOPO.replace("emulate: {kv_memory: 192MiB}", f"emulate: {emulate}"))
    assert message in msg, msg
    assert msg.startswith("house.yaml:4: "), msg


def test_cpu_share_needs_a_local_host() -> None:
    msg = error_of(TOPO.replace("emulate: {kv_memory: 192MiB}", "ssh: me@gamer, emulate: {cpu_share: 1}"))
    assert "cpu_share is set with a local cgroup: it needs a local host (no ssh)" in msg


def test_an_instance_may_not_size_the_kv_cache_again() -> None:
    twice = TOPO.replace("kv_port: 5601}", "kv_port: 5601, args: [--kv-cache-memory-bytes, '1000000']}")
    assert ("roles.prefill[0].args: --kv-cache-memory-bytes is set by hosts.gamer.emulate.kv_memory; give it once"
            in error_of(twice))
    env = TOPO.replace("kv_port: 5601}", "kv_port: 5601, env: {VLLM_CPU_KVCACHE_SPACE: '2'}}")
    assert "VLLM_CPU_KVCACHE_SPACE would override hosts.gamer.emulate.kv_memory" in error_of(env)


def test_emulation_needs_vllm() -> None:
    sglang = TOPO.replace("connector: nixl", "engine: sglang\nconnector: mooncake")
    assert "emulated hardware works with engine vllm" in error_of(sglang)


def test_vllm_adapter_turns_emulate_into_a_flag_and_a_variable() -> None:
    dep = build_deployment(parse())
    engines = {e.name: e for e in dep.engines}
    p, d = engines["prefill[0]"], engines["decode[0]"]
    p_env, d_env = dict(p.env), dict(d.env)
    assert p.argv[p.argv.index("--kv-cache-memory-bytes") + 1] == str(192 * 2**20)
    assert d.argv[d.argv.index("--kv-cache-memory-bytes") + 1] == str(2 * 2**30)
    assert "VLLM_CPU_KVCACHE_SPACE" not in p_env and "VLLM_CPU_KVCACHE_SPACE" not in d_env   # it would win
    assert "DISAGG_EMULATED_PREFILL_RATE" not in p_env
    assert d_env["DISAGG_EMULATED_PREFILL_RATE"] == "1500.0"
    plain = build_deployment(parse(TOPO.replace("emulate: {kv_memory: 192MiB}", "device: cpu")))
    plain_p = next(e for e in plain.engines if e.name == "prefill[0]")
    assert dict(plain_p.env)["VLLM_CPU_KVCACHE_SPACE"] == "1" and "--kv-cache-memory-bytes" not in plain_p.argv


def test_check_and_bench_say_what_is_emulated() -> None:
    topo = parse()
    share = cpu_share_for(topo, topo.hosts["workstation"])
    assert share is not None and share.cores == 0.5 and share.name.startswith("disagg-e")
    assert cpu_share_for(topo, topo.hosts["gamer"]) is None
    text = describe(build_deployment(topo))
    assert "  emulated: KV cache 192 MiB per engine; plan and routing use the rates measured" in text
    assert f"`up` creates cgroup {share.name}, `down` removes it" in text
    lines = emulation_lines(topo)
    assert lines == ["gamer: emulated: KV cache 192 MiB per engine",
                     "workstation: emulated: prefill at most 1,500 tokens/s, KV cache 2 GiB per engine, "
                     f"0.5 CPU cores (cgroup quota) in cgroup {share.name}"]
    doc = {"house": {"emulated": lines, "runs": [], "workload": {}}}
    assert emulated_lines(doc) == [f"house: {line}" for line in lines]
    assert "EMULATED house: gamer: emulated: KV cache 192 MiB per engine" in text_table(doc)


def test_the_state_file_keeps_the_cgroups_to_remove() -> None:
    run = RunState(topology="t.yaml", name="t", run_dir="/r", proxy_url="http://x", started_at=1.0, up_pid=1,
                   cgroups=["/sys/fs/cgroup/cpu/disagg-x"])
    assert RunState.from_json(run.to_json()).cgroups == ["/sys/fs/cgroup/cpu/disagg-x"]
    assert RunState.from_json('{"topology": "t", "name": "t", "run_dir": "/r", "proxy_url": "u", '
                              '"started_at": 1, "up_pid": 1}').cgroups == []


def fake_tree(root: Path, version: int) -> Path:
    if version == 1:
        (root / "cpu").mkdir(parents=True)
        (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
        return root / "cpu"
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("memory\n")
    return root


def test_quota_on_a_fake_v1_tree(tmp_path: Path) -> None:
    fake_tree(tmp_path, 1)
    share = cpushare.CpuShare("disagg-t-host", 0.25, root=tmp_path)
    path = share.create()
    assert path == tmp_path / "cpu" / "disagg-t-host"
    assert (path / "cpu.cfs_period_us").read_text() == "100000"
    assert (path / "cpu.cfs_quota_us").read_text() == "25000"
    share.add(os.getpid())
    assert (path / "cgroup.procs").read_text() == str(os.getpid())


def test_quota_on_a_fake_v2_tree_enables_the_controller(tmp_path: Path) -> None:
    fake_tree(tmp_path, 2)
    path = cpushare.CpuShare("disagg-t-host", 1.5, root=tmp_path).create()
    assert (path / "cpu.max").read_text() == "150000 100000"
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu"
    assert cpushare.quota_text(0.001, 2) == {"cpu.max": "1000 100000"}    # the kernel's floor of 1 ms


def test_no_cpu_controller_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("memory pids\n")
    with pytest.raises(LaunchError, match="no cgroup cpu controller under"):
        cpushare.CpuShare("x", 1.0, root=tmp_path).create()


def test_an_unwritable_tree_is_a_clear_error(tmp_path: Path) -> None:
    path = fake_tree(tmp_path, 1)
    (path / "disagg-ro").mkdir()
    (path / "disagg-ro" / "cpu.cfs_quota_us").mkdir()       # writing it fails, as a read-only cgroupfs would
    with pytest.raises(LaunchError, match=r"cannot set a CPU quota in .*run as root, or remove cpu_share"):
        cpushare.CpuShare("disagg-ro", 1.0, root=tmp_path).create()


def _real_tree_writable() -> str | None:
    try:
        hierarchy = cpushare.find_hierarchy()
    except LaunchError as exc:
        return str(exc)
    return None if os.access(hierarchy.path, os.W_OK) else f"{hierarchy.path} is not writable by this user"


@pytest.mark.skipif(_real_tree_writable() is not None, reason=f"absent capability: {_real_tree_writable()}")
def test_a_real_cgroup_holds_a_process_and_is_removed(tmp_path: Path) -> None:
    share = cpushare.CpuShare(f"disagg-unit-{os.getpid()}", 0.5)
    path = share.create()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        share.add(child.pid)
        assert str(child.pid) in (path / "cgroup.procs").read_text().split()
        assert cpushare.remove(path)          # the member is moved to the parent first
        assert not path.exists()
    finally:
        child.kill()
        child.wait()
    assert cpushare.remove(path)              # already gone: removed

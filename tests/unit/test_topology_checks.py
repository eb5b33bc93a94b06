"""What a topology may not ask for (refused with file:line), what this machine cannot run (check
warns, up refuses), and what is probably not meant (warnings): disagg/topology_checks.py,
disagg/addresses.py, the args check of disagg/deployment.py and the error collection of
disagg/topology.py."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from disagg.addresses import address_problem, is_this_machine
from disagg.deployment import build_deployment
from disagg.errors import DeploymentError, TopologyError, TopologyErrors
from disagg.launch.frontend import router_argv
from disagg.topology import Topology, parse_topology
from disagg.topology_checks import advisories, host_findings, require_runnable_here

HERE = frozenset({"127.0.0.1", "10.1.2.3", "fd00::2"})


def topology(text: str, file: str = "t.yaml") -> Topology:
    return parse_topology(textwrap.dedent(text), file, run_dir="/tmp/run")


def two_hosts(a: str, b: str, extra_a: str = "", extra_b: str = "") -> str:
    return f"""\
        model: disagg:tiny
        hosts:
          a: {{address: {a}{extra_a}}}
          b: {{address: {b}{extra_b}}}
        roles:
          prefill: [{{host: a, port: 8100}}]
          decode: [{{host: b, port: 8200}}]
        link: ethernet
        """


# --- address syntax (refused wherever the file is read) ------------------------------------


@pytest.mark.parametrize("address", ["not an address!", "300.1.2.3", "-box", "a..b", "box_1", ""])
def test_an_address_that_is_not_one_is_refused_with_its_line(address: str) -> None:
    with pytest.raises(TopologyError) as err:
        topology(two_hosts("127.0.0.1", f'"{address}"'))
    assert (err.value.file, err.value.line, err.value.field) == ("t.yaml", 4, "hosts.b.address")


@pytest.mark.parametrize("address", ["127.0.0.1", "::1", "fd00::2", "box", "gpu-box.lan", "spark-a.local."])
def test_ip_addresses_and_host_names_are_addresses(address: str) -> None:
    assert address_problem(address) is None


def test_a_proxy_host_that_is_not_an_address_is_refused() -> None:
    with pytest.raises(TopologyError, match=r"t.yaml:9: proxy.host: 'every where' is not an address"):
        topology(two_hosts("127.0.0.1", "127.0.0.2") + "proxy: {host: every where}\n")


# --- every error of a file in one run ----------------------------------------------------------


def test_every_error_of_a_file_is_reported_at_once() -> None:
    text = """\
        model: disagg:tiny
        engine: vllmm
        hosts:
          a: {address: 127.0.0.1}
          b: {address: "not an address!"}
        roles:
          prefill: [{host: a, port: 70000}]
          decode: [{host: a, port: 0}]
        proxy: {port: 8000, fallback: nowhere}
        """
    with pytest.raises(TopologyErrors) as err:
        topology(text)
    found = [(e.line, e.field) for e in err.value.errors]
    assert found == [(2, "engine"), (5, "hosts.b.address"), (7, "roles.prefill[0].port"),
                     (8, "roles.decode[0].port"), (9, "proxy.fallback")]
    lines = str(err.value).splitlines()
    assert lines[0] == "t.yaml: 5 errors:"
    assert lines[3] == "  t.yaml:7: roles.prefill[0].port: expected an integer <= 65535, got 70000"
    assert lines[4] == "  t.yaml:8: roles.decode[0].port: expected an integer >= 1, got 0"
    # the first error is still the exception's own (code that reads one error keeps working)
    assert (err.value.line, err.value.field) == (2, "engine")


def test_one_error_is_raised_as_itself() -> None:
    with pytest.raises(TopologyError) as err:
        topology(two_hosts("127.0.0.1", "127.0.0.1").replace("port: 8200", "port: 99999"))
    assert type(err.value) is TopologyError and err.value.field == "roles.decode[0].port"


def test_every_port_clash_is_reported() -> None:
    text = """\
        model: disagg:tiny
        hosts: {a: {address: 127.0.0.1}}
        roles:
          prefill: [{port: 8100, kv_port: 5600}]
          decode: [{port: 8100, kv_port: 5600}]
        proxy: {port: 8100}
        """
    with pytest.raises(TopologyErrors) as err:
        topology(text)
    assert [e.field for e in err.value.errors] == ["roles.decode[0].port", "roles.decode[0].kv_port", "proxy.port"]


def test_each_bad_host_is_reported() -> None:
    with pytest.raises(TopologyErrors) as err:
        topology(two_hosts("127.0.0.1", "127.0.0.2", ", device: gpu", ", ssh_port: 22"))
    assert [(e.line, e.field) for e in err.value.errors] == [(3, "hosts.a.device"), (4, "hosts.b.ssh")]


# --- this machine's facts: check warns, up refuses ---------------------------------------------


def test_a_host_without_ssh_at_an_address_this_machine_lacks_cannot_run_here() -> None:
    topo = topology(two_hosts("192.168.1.20", "192.168.1.30"))
    found = host_findings(topo, local=HERE, cpus={0, 1}, hostname="here")
    assert [(f.line, f.field) for f in found] == [(3, "hosts.a.address"), (4, "hosts.b.address")]
    assert "192.168.1.20 is not an address of this machine, and the host has no ssh" in found[0].message


def test_addresses_of_this_machine_loopback_and_its_name_can_run_here() -> None:
    for a, b in (("127.0.0.1", "10.1.2.3"), ("localhost", "fd00::2"), ("here", "127.0.0.5")):
        assert host_findings(topology(two_hosts(a, b)), local=HERE, cpus={0, 1}, hostname="here") == []
    assert is_this_machine("0.0.0.0", HERE, "here") and is_this_machine("::", HERE, "here")


def test_a_remote_host_is_not_checked_here() -> None:
    topo = topology(two_hosts("127.0.0.1", "192.168.1.30", extra_b=", ssh: me@192.168.1.30"))
    assert host_findings(topo, local=HERE, cpus={0, 1}, hostname="here") == []


def test_emulated_link_addresses_are_created_by_up_so_they_pass() -> None:
    topo = topology(two_hosts("198.18.40.1", "198.18.40.2").replace("link: ethernet", "link: {type: emulated, "
                                                                     "rate: 1gbit}"))
    assert host_findings(topo, local=HERE, cpus={0, 1}, hostname="here") == []


def test_a_host_name_is_never_looked_up() -> None:
    assert not is_this_machine("example.com", HERE, "here")  # would resolve; not this machine's name
    assert is_this_machine("HERE", HERE, "here.lan") and is_this_machine("localhost", HERE, "x")


def test_cpus_beyond_this_machine_cannot_run_here() -> None:
    topo = topology(two_hosts("127.0.0.1", "127.0.0.1").replace("port: 8200", "port: 8200, cpus: [0, 64]"))
    found = host_findings(topo, local=HERE, cpus={0, 1}, hostname="here")
    assert [(f.line, f.field) for f in found] == [(7, "roles.decode[0].cpus")]
    assert found[0].message == "CPU 64 is not one this machine lets disagg use (CPUs 0-1)"
    assert host_findings(topo, local=HERE, cpus=set(range(65)), hostname="here") == []


def test_a_missing_local_model_path_cannot_run_here(tmp_path: Path) -> None:
    text = two_hosts("127.0.0.1", "127.0.0.1").replace("model: disagg:tiny", "model: {path: ./no-such-model}")
    topo = topology(text, str(tmp_path / "t.yaml"))
    found = host_findings(topo, local=HERE, cpus={0, 1}, hostname="here")
    assert [(f.line, f.field) for f in found] == [(1, "model.path")]
    assert found[0].message.startswith(f"{tmp_path / 'no-such-model'} does not exist on this machine")
    (tmp_path / "no-such-model").mkdir()
    assert host_findings(topo, local=HERE, cpus={0, 1}, hostname="here") == []


def test_a_local_hosts_own_missing_model_cannot_run_here(tmp_path: Path) -> None:
    text = two_hosts("127.0.0.1", "127.0.0.2", extra_b=f", model: {tmp_path / 'b-copy'}")
    found = host_findings(topology(text), local=HERE, cpus={0, 1}, hostname="here")
    assert [(f.line, f.field) for f in found] == [(4, "hosts.b.model")]
    (tmp_path / "b-copy").mkdir()
    assert host_findings(topology(text), local=HERE, cpus={0, 1}, hostname="here") == []


def test_embedded_models_hub_ids_and_remote_only_models_are_not_refused() -> None:
    for model in ("disagg:tiny", "Qwen/Qwen2.5-0.5B-Instruct"):
        topo = topology(two_hosts("127.0.0.1", "127.0.0.1").replace("disagg:tiny", model))
        assert host_findings(topo, local=HERE, cpus={0, 1}, hostname="here") == []
    remote = two_hosts("10.9.9.1", "10.9.9.2", ", ssh: me@10.9.9.1", ", ssh: me@10.9.9.2")
    topo = topology(remote.replace("model: disagg:tiny", "model: /data/models/qwen"))
    assert host_findings(topo, local=HERE, cpus={0, 1}, hostname="here") == []


def test_up_refuses_every_finding_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    topo = topology(two_hosts("192.0.2.200", "192.0.2.201"))  # TEST-NET-1: on no machine's interface
    with pytest.raises(TopologyErrors) as err:
        require_runnable_here(topo)
    assert [e.field for e in err.value.errors] == ["hosts.a.address", "hosts.b.address"]
    require_runnable_here(topology(two_hosts("127.0.0.1", "127.0.0.2")))
    assert capsys.readouterr().err == ""


# --- args that override what disagg sets --------------------------------------------------------


def test_args_that_override_what_disagg_sets_are_refused_each_with_its_line() -> None:
    text = two_hosts("127.0.0.1", "127.0.0.1").replace(
        "port: 8100}", 'port: 8100, args: [--port, "9100", "--kv_transfer_config={}"]}').replace(
        "port: 8200}", "port: 8200, args: [--served-model-name=x, -O0]}")
    with pytest.raises(TopologyErrors) as err:
        build_deployment(topology(text))
    assert [(e.line, e.field) for e in err.value.errors] == [(6, "roles.prefill[0].args"),
                                                             (7, "roles.decode[0].args")]
    assert err.value.errors[0].message.startswith("--port, --kv-transfer-config are set by disagg")
    assert err.value.errors[1].message.startswith("--served-model-name is set by disagg")


def test_args_disagg_does_not_set_and_additive_ones_pass() -> None:
    text = two_hosts("127.0.0.1", "127.0.0.1").replace(
        "port: 8100}", "port: 8100, args: [-O0, --max-num-seqs, '8', --middleware, my.Middleware]}")
    dep = build_deployment(topology(text))
    assert dep.engines[0].argv[-5:] == ("-O0", "--max-num-seqs", "8", "--middleware", "my.Middleware")


def test_a_flag_disagg_sets_only_when_the_topology_says_is_free_otherwise() -> None:
    base = two_hosts("127.0.0.1", "127.0.0.1").replace("port: 8100}", "port: 8100, args: [--dtype, float16]}")
    build_deployment(topology(base))  # no model.dtype: --dtype is the instance's to give
    with pytest.raises(TopologyError, match=r"roles.prefill\[0\].args: --dtype is set by disagg"):
        build_deployment(topology(base.replace("model: disagg:tiny", "model: {path: disagg:tiny, dtype: float32}")))


# --- warnings wherever the file is read ---------------------------------------------------------

GPU_PAIR = """\
    model: disagg:tiny
    hosts: {g: {address: 127.0.0.1, device: cuda}}
    roles:
      prefill: [{port: 8100, gpus: [0]PREFILL}]
      decode: [{port: 8200, gpus: [0]DECODE}]
    """


def test_two_engines_on_one_gpu_at_the_default_memory_share_are_warned_about() -> None:
    found = advisories(topology(GPU_PAIR.replace("PREFILL", "").replace("DECODE", "")))
    assert [(f.line, f.field) for f in found] == [(5, "roles.decode[0].gpus")]
    assert found[0].message.startswith("prefill[0], decode[0] share GPU 0 of host g and would take 1.80 of its memory")


def test_two_engines_on_one_gpu_with_shares_that_fit_pass() -> None:
    fits = GPU_PAIR.replace("PREFILL", ", args: [--gpu-memory-utilization, '0.45']").replace(
        "DECODE", ", args: ['--gpu-memory-utilization=0.45']")
    assert advisories(topology(fits)) == []
    apart = GPU_PAIR.replace("PREFILL", "").replace("DECODE", "").replace("8200, gpus: [0]", "8200, gpus: [1]")
    assert advisories(topology(apart)) == []


def test_a_proxy_on_every_address_without_an_api_key_is_warned_about() -> None:
    open_proxy = two_hosts("127.0.0.1", "127.0.0.1") + "proxy: {host: 0.0.0.0, port: 8000}\n"
    found = advisories(topology(open_proxy))
    assert [(f.line, f.field) for f in found] == [(9, "proxy.host")]
    assert advisories(topology(open_proxy.replace("port: 8000}", "port: 8000, api_key: sesame}"))) == []


def test_an_ssh_host_at_a_loopback_address_is_warned_about() -> None:
    found = advisories(topology(two_hosts("127.0.0.1", "127.0.0.1", extra_b=", ssh: me@far")))
    assert [(f.line, f.field) for f in found] == [(4, "hosts.b.address")]
    assert advisories(topology(two_hosts("127.0.0.1", "10.0.0.2", extra_b=", ssh: me@10.0.0.2"))) == []


# --- compatibility errors name the field's line -------------------------------------------------

COMPAT = """\
    model: disagg:tiny
    FIELDS
    hosts: {a: {address: 127.0.0.1}}
    roles:
      prefill: [{port: 8100}]
      decode: [{port: 8200}]
    """


@pytest.mark.parametrize(("fields", "where"), [
    ("connector: mooncake", "t.yaml:2: connector: connector (with engine vllm) 'mooncake' is not supported"),
    ("engine: sglang\n    connector: lmcache", "t.yaml:3: connector: connector 'lmcache' does not work with engine"),
])
def test_an_engine_and_connector_that_do_not_go_together_name_the_connectors_line(fields: str, where: str) -> None:
    with pytest.raises(DeploymentError) as err:
        build_deployment(topology(COMPAT.replace("FIELDS", fields)))
    assert str(err.value).startswith(where)


def test_a_router_for_another_engine_names_the_proxy_kinds_line() -> None:
    dep = build_deployment(topology(COMPAT.replace("FIELDS", "proxy: {kind: sglang-router}")))
    with pytest.raises(DeploymentError, match=r"^t\.yaml:2: proxy\.kind: proxy\.kind sglang-router routes engine"):
        router_argv(dep)

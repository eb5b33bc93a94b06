"""The LMCache connector: kv-transfer-config, per-instance YAML, env, ports;
with LMCache installed, the YAML also goes through LMCache's own loader."""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest
import yaml

from disagg.deployment import EngineLaunch, build_deployment
from disagg.errors import DeploymentError
from disagg.kv.lmcache import proxy_options
from disagg.launch.frontend import builtin_argv
from disagg.topology import parse_topology

BASE = """\
model: {path: /models/qwen}
engine: vllm
connector: lmcache
link: {type: ethernet, rate: 25gbit}
proxy: {host: PROXY, port: 8000}
hosts:
  p: {address: 10.0.0.1, device: cuda}
  d: {address: 10.0.0.2, device: cuda, ssh: me@d, workdir: /srv/disagg}
roles:
  prefill:
    - {host: p, port: 8100, gpus: [0]}
  decode:
    - {host: d, port: 8200, kv_port: 7300, gpus: [0], args: [--tensor-parallel-size, "2"]}
"""


#: the proxy's receivers option for BASE's decode instance (TP 2: two init, two alloc ports)
RECEIVERS = '[{"host":"10.0.0.2","init":[7300,7301],"alloc":[7302,7303]}]'


def topo(proxy: str = "10.0.0.9", text: str = BASE):
    return parse_topology(textwrap.dedent(text).replace("PROXY", proxy), "t.yaml", run_dir="/tmp/run")


def engines(proxy: str = "10.0.0.9", text: str = BASE) -> dict[str, EngineLaunch]:
    return {e.name: e for e in build_deployment(topo(proxy, text)).engines}


def kv_config(eng: EngineLaunch) -> dict:
    argv = list(eng.argv)
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_transfer_config_per_role() -> None:
    e = engines()
    assert kv_config(e["prefill[0]"]) == {
        "kv_connector": "LMCacheConnectorV1", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"discard_partial_chunks": False, "lmcache_rpc_port": "disagg-t-prefill0"}}
    dec = kv_config(e["decode[0]"])
    assert dec["kv_role"] == "kv_consumer" and dec["kv_connector_extra_config"]["skip_last_n_tokens"] == 1


def test_yaml_sender_and_receiver() -> None:
    e = engines()
    (pname, ptext), = e["prefill[0]"].files
    (dname, dtext), = e["decode[0]"].files
    assert (pname, dname) == ("prefill-0.lmcache.yaml", "decode-0.lmcache.yaml")
    sender, receiver = yaml.safe_load(ptext), yaml.safe_load(dtext)
    assert sender == {"local_cpu": False, "save_unfull_chunk": True, "enable_pd": True, "transfer_channel": "nixl",
                      "pd_buffer_size": 1 << 30, "pd_buffer_device": "cuda", "nixl_backends": ["UCX"],
                      "pd_role": "sender",
                      "pd_proxy_host": "10.0.0.9", "pd_proxy_port": 8001}
    assert receiver["pd_role"] == "receiver" and receiver["pd_peer_host"] == "10.0.0.2"
    assert (receiver["pd_peer_init_port"], receiver["pd_peer_alloc_port"]) == ([7300, 7301], [7302, 7303])


def test_env_points_at_the_file_on_each_host_with_one_hash_seed() -> None:
    e = engines()
    penv, denv = dict(e["prefill[0]"].env), dict(e["decode[0]"].env)
    assert penv["LMCACHE_CONFIG_FILE"] == "/tmp/run/runs/t/prefill-0.lmcache.yaml"
    assert denv["LMCACHE_CONFIG_FILE"] == "/srv/disagg/runs/t/decode-0.lmcache.yaml"   # remote: its workdir
    assert penv["PYTHONHASHSEED"] == denv["PYTHONHASHSEED"] == "0"
    assert penv["UCX_TLS"] == "cuda_copy,tcp,self"


def test_one_seed_set_on_one_instance_goes_to_both() -> None:
    e = engines(text=BASE.replace("gpus: [0]}", "gpus: [0], env: {PYTHONHASHSEED: '7'}}", 1))
    assert dict(e["prefill[0]"].env)["PYTHONHASHSEED"] == dict(e["decode[0]"].env)["PYTHONHASHSEED"] == "7"


def test_different_hash_seeds_are_refused() -> None:
    text = BASE.replace("gpus: [0]}", "gpus: [0], env: {PYTHONHASHSEED: '1'}}", 1)
    text = text.replace('args: [--tensor', "env: {PYTHONHASHSEED: '2'}, args: [--tensor")
    with pytest.raises(DeploymentError, match="different PYTHONHASHSEED"):
        engines(text=text)


def test_receiver_port_clash_is_refused() -> None:
    text = BASE.replace("port: 8200, kv_port: 7300", "port: 7302, kv_port: 7300")
    with pytest.raises(DeploymentError, match=r"LMCache receiver port 10\.0\.0\.2:7302 clashes with roles\.decode"):
        engines(text=text)


def test_notification_port_clash_is_refused() -> None:
    text = BASE.replace("{host: p, port: 8100,", "{host: p, port: 8001,")
    with pytest.raises(DeploymentError, match="proxy notification port"):
        engines(proxy="0.0.0.0", text=text.replace("ssh: me@d, workdir: /srv/disagg", "ssh: me@d"))


def test_wildcard_proxy_with_remote_hosts_needs_an_address() -> None:
    with pytest.raises(DeploymentError, match=r"set proxy\.host to this machine's address"):
        engines(proxy="0.0.0.0")


def test_proxy_gets_receivers_and_notify_options() -> None:
    t = topo()
    assert proxy_options(t) == (("receivers", RECEIVERS), ("notify", "10.0.0.9:8001"))
    argv = builtin_argv(build_deployment(t))
    assert argv[argv.index("--handoff") + 1] == "vllm-lmcache"
    assert f"receivers={RECEIVERS}" in argv and "notify=10.0.0.9:8001" in argv


@pytest.mark.skipif(importlib.util.find_spec("lmcache") is None,
                    reason="package lmcache is not in this interpreter; `make test` runs this test with lmcache "
                           "via scripts/engine-package-checks.sh (docs/engines.md)")
def test_yaml_loads_with_lmcaches_own_loader() -> None:
    from disagg.enginecheck import check_lmcache

    e = engines()
    assert check_lmcache(e["prefill[0]"])["pd_role"] == "sender"
    assert check_lmcache(e["decode[0]"])["pd_peer_alloc_port"] == [7302, 7303]


@pytest.mark.parametrize("tp", ["two", "0", "-1"])
def test_a_bad_tensor_parallel_size_is_a_plan_error_not_a_traceback(tp: str) -> None:
    with pytest.raises(DeploymentError, match=rf"roles\.decode\[0\]\.args: --tensor-parallel-size must be a positive "
                                        rf"integer, got '{tp}'"):
        engines(text=BASE.replace('[--tensor-parallel-size, "2"]', f'["--tensor-parallel-size={tp}"]'))


def test_tensor_parallel_size_in_either_spelling() -> None:
    for args in ('[-tp, "2"]', '["--tensor-parallel-size=2"]'):
        receivers = dict(proxy_options(topo(text=BASE.replace('[--tensor-parallel-size, "2"]', args))))
        assert receivers["receivers"] == RECEIVERS

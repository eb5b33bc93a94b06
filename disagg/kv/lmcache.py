"""LMCache as vLLM's KV connector (``LMCacheConnectorV1``) in P/D mode.

Follows LMCache's own disaggregated-prefill examples
(``examples/disagg_prefill``, LMCache 0.5.x key names, checked with LMCache's
config loader by ``scripts/check_engine_configs.py``):

- every instance gets ``--kv-transfer-config`` with ``LMCacheConnectorV1``,
  ``kv_producer``/``kv_consumer``, ``discard_partial_chunks: false``, a
  per-instance ``lmcache_rpc_port`` name, and on decode
  ``skip_last_n_tokens: 1`` (as in LMCache's launcher script);
- every instance gets its own LMCache YAML, written by ``disagg up`` to
  ``<run_dir>/runs/<topology>/<role>-<index>.lmcache.yaml`` (remote hosts:
  under the host's ``workdir``) and named by ``LMCACHE_CONFIG_FILE``:
  prefill is the ``sender`` (it pushes KV over NIXL into decode's buffer and
  tells the proxy when a request's KV is there), decode the ``receiver``
  (it listens on ``pd_peer_init_port``/``pd_peer_alloc_port``);
- ``PYTHONHASHSEED`` is the same on both sides (LMCache's chunk keys hash
  token ids; different seeds never match).

Ports: decode instance ``kv_port`` .. ``kv_port + 2*TP - 1`` (init ports,
then alloc ports, one per TP rank); the proxy receives the prefill's
notifications on ``proxy.port + 1`` (:func:`notify_port`) at the address the
prefill hosts reach it on (:func:`notify_host`), and listens there only. All
are checked against every other port of the topology (:func:`check_ports`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import yaml

from disagg.emulation import decode_host
from disagg.errors import DeploymentError
from disagg.kv.base import VllmKVAdapter, kv_role
from disagg.kv.ucx import ucx_env
from disagg.paths import host_run_dir
from disagg.serving import LMCACHE_HANDOFF
from disagg.topology import WILDCARD_ADDRESSES, HostSpec, InstanceSpec, Topology, iter_ports, same_place

#: the one hash seed of every LMCache instance, unless the topology sets its own
DEFAULT_HASH_SEED = "0"
#: LMCache's P/D staging buffer per instance, bytes
BUFFER_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}
CONFIG_SUFFIX = ".lmcache.yaml"


def tp_size(inst: InstanceSpec, file: str = "") -> int:
    """The instance's tensor-parallel width, from its vLLM args (default 1)."""
    given = inst.arg("--tensor-parallel-size", "-tp")
    if given is None:
        return 1
    if not given.isdigit() or int(given) < 1:
        raise DeploymentError(f"{file or 'topology'}: roles.{inst.name}.args: --tensor-parallel-size must be a "
                        f"positive integer, got {given!r}")
    return int(given)


@dataclass(frozen=True)
class ReceiverPorts:
    """Where one decode instance's LMCache receiver listens."""

    host: str
    init: tuple[int, ...]
    alloc: tuple[int, ...]

    def option(self) -> dict[str, Any]:
        """This receiver as one item of the proxy's ``receivers`` handoff option (a JSON list)."""
        return {"host": self.host, "init": list(self.init), "alloc": list(self.alloc)}


def receiver_ports(topo: Topology, inst: InstanceSpec) -> ReceiverPorts:
    """The receiver ports of a decode instance (from its ``kv_port``)."""
    if inst.kv_port is None:
        raise DeploymentError(f"{topo.file}: {inst.name} has no kv_port for its LMCache receiver")
    tp = tp_size(inst, topo.file)
    return ReceiverPorts(host=topo.hosts[inst.host].address,
                         init=tuple(inst.kv_port + r for r in range(tp)),
                         alloc=tuple(inst.kv_port + tp + r for r in range(tp)))


def notify_port(topo: Topology) -> int:
    """The port the proxy binds for LMCache's "KV sent" notifications."""
    return topo.proxy.port + 1


def notify_host(topo: Topology) -> str:
    """The proxy's address as the prefill instances reach it: where their LMCache senders send
    notifications (``pd_proxy_host``) and the one address the proxy's notice socket binds
    (:func:`proxy_options`), whatever address the proxy serves clients on.

    ``proxy.host`` when it names one address; with a wildcard ``proxy.host`` on a topology of
    local hosts, 127.0.0.1. Behind an emulated link the prefill engine runs in a network
    namespace of its own and reaches the proxy, in the root namespace, only at the decode
    host's end of the link, so that address (the root namespace holds it)."""
    if topo.link.type == "emulated":
        return decode_host(topo).address
    host = topo.proxy.host
    if host not in WILDCARD_ADDRESSES:
        return host
    if all(not h.is_remote for h in topo.hosts.values()):
        return "127.0.0.1"
    raise DeploymentError(f"{topo.located('proxy.host')}: proxy.host is {host!r}, but with connector lmcache the "
                    f"prefill hosts send 'KV sent' notices to the proxy at proxy.host:{notify_port(topo)}; "
                    "set proxy.host to this machine's address on the link")


def check_ports(topo: Topology) -> None:
    """Raise :class:`DeploymentError` if an LMCache port clashes with any other port of the topology."""
    taken = {(address, port): where for address, port, where in iter_ports(topo)}
    # the notice socket binds notify_host(topo), which a wildcard proxy.host (what is checked then) covers
    notify_at = decode_host(topo).address if topo.link.type == "emulated" else topo.proxy.host
    extra: list[tuple[str, int, str]] = [(notify_at, notify_port(topo), "proxy notification port")]
    for inst in topo.role("decode"):
        rp = receiver_ports(topo, inst)
        extra += [(rp.host, p, f"roles.{inst.name} LMCache receiver port") for p in rp.init[1:] + rp.alloc]
    for address, port, what in extra:
        for (other_addr, other_port), where in taken.items():
            if port == other_port and same_place(address, other_addr):
                raise DeploymentError(f"{topo.file}: {what} {address}:{port} clashes with {where}; "
                                "change the ports (connector lmcache uses kv_port..kv_port+2*TP-1 on decode "
                                "and proxy.port+1 on the proxy)")
        taken[(address, port)] = what
        if not 0 < port < 65536:
            raise DeploymentError(f"{topo.file}: {what} {port} is out of range")


def hash_seed(topo: Topology) -> str:
    """The one ``PYTHONHASHSEED`` of all instances; an error if the topology sets different ones."""
    seeds: set[str] = set()
    for inst in topo.instances:
        if inst.role != "both" and (seed := dict(inst.env).get("PYTHONHASHSEED")) is not None:
            seeds.add(seed)
    if len(seeds) > 1:
        raise DeploymentError(f"{topo.file}: instances set different PYTHONHASHSEED values ({', '.join(sorted(seeds))}"
                        "); LMCache needs one seed on prefill and decode")
    return seeds.pop() if seeds else DEFAULT_HASH_SEED


def config_name(inst: InstanceSpec) -> str:
    """File name of the instance's LMCache YAML inside the run directory."""
    return f"{inst.role}-{inst.index}{CONFIG_SUFFIX}"


def lmcache_config(topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, Any]:
    """The LMCache settings of one instance (what its YAML holds)."""
    device = "cuda" if host.device == "cuda" else "cpu"
    cfg: dict[str, Any] = {
        "local_cpu": False,
        "save_unfull_chunk": True,     # P/D must move partial chunks too (LMCache forces it)
        "enable_pd": True,
        "transfer_channel": "nixl",
        "pd_buffer_size": BUFFER_BYTES[device],
        "pd_buffer_device": device,
        "nixl_backends": ["UCX"],
    }
    if inst.role == "prefill":
        cfg.update(pd_role="sender",
                   pd_proxy_host=notify_host(topo), pd_proxy_port=notify_port(topo))
    else:
        rp = receiver_ports(topo, inst)
        cfg.update(max_local_cpu_size=0, pd_role="receiver", pd_peer_host=rp.host,
                   pd_peer_init_port=list(rp.init), pd_peer_alloc_port=list(rp.alloc))
    return cfg


def to_yaml(cfg: dict[str, Any]) -> str:
    """LMCache settings as the YAML file LMCache reads (PyYAML's emitter; keys in the given order)."""
    header = "# written by disagg (connector lmcache); LMCache reads it via LMCACHE_CONFIG_FILE\n"
    return header + yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None)


class LmcacheVllmAdapter(VllmKVAdapter):
    """vLLM ``LMCacheConnectorV1`` configuration plus each instance's LMCache YAML."""

    name = "lmcache"
    handoff_kind = LMCACHE_HANDOFF

    def handoff_options(self, topo: Topology) -> tuple[tuple[str, str], ...]:
        return proxy_options(topo)

    def transfer_config(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, Any]:
        check_ports(topo)
        extra: dict[str, Any] = {"discard_partial_chunks": False,
                                 "lmcache_rpc_port": f"disagg-{topo.name}-{inst.role}{inst.index}"}
        if inst.role == "decode":
            extra["skip_last_n_tokens"] = 1
        return {"kv_connector": "LMCacheConnectorV1", "kv_role": kv_role(inst),
                "kv_connector_extra_config": extra}

    def env(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, str]:
        env = {"LMCACHE_CONFIG_FILE": str(PurePosixPath(host_run_dir(topo, host)) / config_name(inst)),
               "PYTHONHASHSEED": hash_seed(topo)}
        env.update(ucx_env(topo, host))
        return env

    def files(self, topo: Topology, inst: InstanceSpec, host: HostSpec) -> dict[str, str]:
        return {config_name(inst): to_yaml(lmcache_config(topo, inst, host))}


def proxy_options(topo: Topology) -> tuple[tuple[str, str], ...]:
    """The proxy's ``--handoff-option`` values for an LMCache topology
    (:meth:`LmcacheVllmAdapter.handoff_options`): the receivers, and ``notify``, the notice
    socket's bind address, which is where the prefill instances send (:func:`notify_host`),
    never a wildcard."""
    receivers = json.dumps([receiver_ports(topo, i).option() for i in topo.role("decode")], separators=(",", ":"))
    return (("receivers", receivers), ("notify", f"{notify_host(topo)}:{notify_port(topo)}"))

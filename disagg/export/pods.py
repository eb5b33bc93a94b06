"""The containers of a topology in a cluster: each role's engine and the proxy, as ``disagg up``
would start them, with the addresses a cluster gives.

An engine's command and environment are the plan's (:class:`disagg.deployment.EngineLaunch`,
what ``disagg check`` prints) with these substitutions, and no others:

- the interpreter: ``python3`` (the image's);
- ``--host ADDRESS`` and ``VLLM_NIXL_SIDE_CHANNEL_HOST``: the pod's own IP, ``$(POD_IP)`` (the
  downward API's ``status.podIP``, which the kubelet expands in ``args`` and later ``env``);
- the socket connector: the prefill listener's ``host`` is the pod's DNS name
  (``$(POD_NAME).<role's LeaderWorkerSet>.<namespace>``, from the headless Service the
  LeaderWorkerSet controller creates), the decode engines' ``peers`` are those names (a decode
  engine compares the ``remote_host`` a prefill engine advertises with them, as strings);
  ``allowed_peers`` is left out (decode pods' addresses are not known beforehand; the
  NetworkPolicy admits only engines to the KV ports);
- left out: ``CUDA_VISIBLE_DEVICES`` (the device plugin picks the GPUs), and, unless the
  instance's own ``env`` sets them, the CPU pinning variables (``VLLM_CPU_OMP_THREADS_BIND``,
  ``OMP_NUM_THREADS``, ``DISAGG_NIXL_CPU_AFFINITY``) and, on TCP links, ``UCX_NET_DEVICES``
  (a pod's interface is its own);
- the engine guard (``--middleware disagg_connectors.engine_guard.EngineGuard``) only where the
  engine image carries ``disagg_connectors`` (:func:`needs_connectors_image`: the socket
  connector); on the upstream image vLLM's own ``VLLM_API_KEY`` guards ``/v1`` and the
  NetworkPolicy admits only the proxy to the HTTP port;
- added: ``UCX_TCP_PORT_RANGE`` for NIXL where the plan sets none (so that the NetworkPolicy
  can name UCX's ports; :func:`ucx_ports`), the engine key and the connector's secret from the
  Secret, ``HF_TOKEN`` from an optional Secret.

:mod:`disagg.export.k8s` calls :func:`engine_argv`, :func:`engine_env`, :func:`proxy_argv` and
:func:`proxy_env`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from disagg.deployment import Deployment, EngineLaunch
from disagg.engines.vllm import GUARD_MIDDLEWARE
from disagg.errors import DeploymentError
from disagg.launch.frontend import proxy_config
from disagg.proxy.config import API_KEY_ENV, ENGINE_KEY_ENV
from disagg.registry import engine_adapter
from disagg.serving import KV_PEERS
from disagg.topology import InstanceSpec, Topology

#: the interpreter in the images (upstream vLLM's and the proxy's)
PYTHON = "python3"
POD_IP_ENV = "POD_IP"
POD_NAME_ENV = "POD_NAME"
POD_IP = f"$({POD_IP_ENV})"
#: the engine's variable for its Hugging Face token (gated models), from an optional Secret
HF_TOKEN_ENV = "HF_TOKEN"
#: UCX's TCP transport listens on a port of this range (``UCX_TCP_PORT_RANGE``) ...
UCX_PORT_RANGE_ENV = "UCX_TCP_PORT_RANGE"
#: ... which the export sets to this where the plan sets none
DEFAULT_UCX_PORT_RANGE = (52000, 52999)
#: keys of the export's Secret
ENGINE_KEY = "engine-key"
KV_SECRET_KEY = "kv-secret"
PROXY_API_KEY = "proxy-api-key"
#: variables set from the instance's CPU pinning (left out unless the instance's env sets them)
CPU_PINNING_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "DISAGG_NIXL_CPU_AFFINITY")
NIXL_CONNECTORS = ("nixl", "nixl-push")

_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
#: room in a 63-character name for "-prefill-<index>" after the base
MAX_BASE_CHARS = 40


def dns_label(text: str) -> str:
    """``text`` as a Kubernetes name that may also name a Service: lower case letters, digits and
    ``-``, starting with a letter, at most :data:`MAX_BASE_CHARS` characters."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:MAX_BASE_CHARS].strip("-")
    if not name:
        return "disagg"
    return name if name[0].isalpha() else f"d-{name}"[:MAX_BASE_CHARS].rstrip("-")


def check_namespace(namespace: str) -> str:
    """``namespace`` if it is a Kubernetes namespace name (RFC 1123 label); else DeploymentError."""
    if len(namespace) > 63 or not _LABEL.fullmatch(namespace):
        raise DeploymentError(f"--namespace {namespace!r}: expected lower case letters, digits and '-', "
                              "starting and ending with a letter or digit, at most 63 characters")
    return namespace


@dataclass(frozen=True)
class Names:
    """Every object's name for one topology in one namespace."""

    base: str
    namespace: str

    def role(self, role: str) -> str:
        """The role's LeaderWorkerSet, and the headless Service its controller creates."""
        return f"{self.base}-{role}"

    def engine_host(self, role: str, index: int) -> str:
        """Instance ``index``'s DNS name: its pod ``<lws>-<index>`` in the Service ``<lws>``."""
        lws = self.role(role)
        return f"{lws}-{index}.{lws}.{self.namespace}"

    def engine_own_host(self, role: str) -> str:
        """An engine pod's own DNS name in ``role``, as its kubelet expands it (``$(POD_NAME)``)."""
        lws = self.role(role)
        return f"$({POD_NAME_ENV}).{lws}.{self.namespace}"

    @property
    def proxy(self) -> str:
        return f"{self.base}-proxy"

    @property
    def secret(self) -> str:
        return f"{self.base}-keys"

    @property
    def hf_secret(self) -> str:
        """The optional Secret with the Hugging Face token (key ``token``; the operator creates it)."""
        return f"{self.base}-hf"


def needs_connectors_image(topo: Topology) -> bool:
    """Whether the engines need ``disagg_connectors`` in their image (the socket connector is vLLM's
    KV connector through it); NIXL runs on the upstream vLLM image."""
    return not topo.colocated and topo.connector == "socket"


def tensor_parallel(inst: InstanceSpec) -> int:
    """The instance's ``--tensor-parallel-size`` (1 when not given)."""
    value = inst.arg("--tensor-parallel-size", "-tp") or "1"
    try:
        return max(1, int(value))
    except ValueError:
        raise DeploymentError(f"{inst.name} (line {inst.line}): --tensor-parallel-size {value!r} is not a number") \
            from None


def gpu_count(topo: Topology, inst: InstanceSpec) -> int:
    """GPUs the pod requests: the instance's ``gpus``, else its tensor-parallel size; 0 on a CPU host."""
    if topo.hosts[inst.host].device != "cuda":
        return 0
    return len(inst.gpus) or tensor_parallel(inst)


def kv_port_range(inst: InstanceSpec) -> tuple[int, int] | None:
    """The instance's KV ports: ``kv_port`` for TP rank 0 up to rank r's ``kv_port + r``."""
    if inst.kv_port is None:
        return None
    return inst.kv_port, inst.kv_port + tensor_parallel(inst) - 1


def _kv_config(config: dict[str, Any], topo: Topology, inst: InstanceSpec, names: Names) -> dict[str, Any]:
    """``--kv-transfer-config`` with the cluster's names (the socket connector's host, peers)."""
    extra = config.get("kv_connector_extra_config")
    if topo.connector != "socket" or not isinstance(extra, dict):
        return config
    extra = dict(extra)
    extra.pop("allowed_peers", None)
    if "host" in extra:
        extra["host"] = names.engine_own_host(inst.role)
    if "peers" in extra:
        extra["peers"] = socket_peers(topo, names)
    return {**config, "kv_connector_extra_config": extra}


def socket_peers(topo: Topology, names: Names) -> list[str]:
    """Every prefill instance's KV listener by its DNS name, ``name:kv_port``, in ``--prefill`` order."""
    return [f"{names.engine_host('prefill', p.index)}:{p.kv_port}" for p in topo.role("prefill")]


def engine_argv(eng: EngineLaunch, topo: Topology, names: Names) -> list[str]:
    """The plan's argv for ``eng`` with the substitutions of the module's docstring."""
    argv = list(eng.argv)
    out = [PYTHON]
    guard = needs_connectors_image(topo)
    i = 1
    while i < len(argv):
        word = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) else None
        if word == "--host" and value is not None:
            out += [word, POD_IP]
        elif word == "--kv-transfer-config" and value is not None:
            config = _kv_config(json.loads(value), topo, eng.instance, names)
            out += [word, json.dumps(config, separators=(",", ":"))]
        elif word == "--middleware" and value == GUARD_MIDDLEWARE and not guard:
            pass
        else:
            out.append(word)
            i += 1
            continue
        i += 2
    return out


def ucx_ports(eng: EngineLaunch, topo: Topology) -> tuple[int, int] | None:
    """The TCP ports ``eng``'s UCX listens on with NIXL: the plan's ``UCX_TCP_PORT_RANGE`` when it
    sets one, else :data:`DEFAULT_UCX_PORT_RANGE` (which :func:`engine_env` then sets); None
    without NIXL."""
    if topo.colocated or topo.connector not in NIXL_CONNECTORS:
        return None
    text = dict(eng.env).get(UCX_PORT_RANGE_ENV)
    if text is None:
        return DEFAULT_UCX_PORT_RANGE
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text)
    if match is None or not 1 <= int(match.group(1)) <= int(match.group(2)) <= 65535:
        raise DeploymentError(f"{eng.name}: {UCX_PORT_RANGE_ENV}={text!r} is not a port range LO-HI")
    return int(match.group(1)), int(match.group(2))


def _secret_env(name: str, secret: str, key: str, *, optional: bool = False) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": secret, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


def engine_env(eng: EngineLaunch, topo: Topology, names: Names) -> list[dict[str, Any]]:
    """The container's ``env``: the pod's IP and name first (later values refer to them), the plan's
    variables with the substitutions of the module's docstring, then the secrets."""
    own = dict(eng.instance.env)
    env: list[dict[str, Any]] = [
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    dropped = {"CUDA_VISIBLE_DEVICES"} | {k for k in CPU_PINNING_ENV if k not in own}
    if topo.link.type != "roce" and "UCX_NET_DEVICES" not in own:
        dropped.add("UCX_NET_DEVICES")
    for key, value in eng.env:
        if key in dropped:
            continue
        if key == "VLLM_NIXL_SIDE_CHANNEL_HOST":
            value = POD_IP
        env.append({"name": key, "value": value})
    ports = ucx_ports(eng, topo)
    if ports is not None and UCX_PORT_RANGE_ENV not in dict(eng.env):
        env.append({"name": UCX_PORT_RANGE_ENV, "value": f"{ports[0]}-{ports[1]}"})
    adapter = engine_adapter(topo.engine)
    key_env = adapter.key_env(topo)
    if key_env:
        env.append(_secret_env(key_env, names.secret, ENGINE_KEY))
    for name in secret_envs(topo):
        env.append(_secret_env(name, names.secret, KV_SECRET_KEY))
    env.append(_secret_env(HF_TOKEN_ENV, names.hf_secret, "token", optional=True))
    return env


def secret_envs(topo: Topology) -> tuple[str, ...]:
    """The connector's per-run secrets' variables (the socket connector's ``DISAGG_KV_SECRET``); the
    values drawn here are dropped: the Secret holds the export's."""
    return () if topo.colocated else tuple(sorted(engine_adapter(topo.engine).run_env(topo)))


def proxy_argv(dep: Deployment, names: Names) -> list[str]:
    """``python3 -m disagg proxy ...`` as ``disagg up`` starts it (routing policy and seed figures
    included), with the engines' DNS names for their addresses, every address of the pod to
    listen on, and no tokenizer file (this machine's path; the proxy then estimates prompt lengths
    from characters, calibrated live)."""
    topo = dep.topology
    config = proxy_config(dep)

    def urls(role: str) -> tuple[str, ...]:
        return tuple(f"http://{names.engine_host(role, e.instance.index)}:{e.instance.port}" for e in dep.role(role))

    options = tuple((k, ",".join(socket_peers(topo, names)) if k == KV_PEERS else v) for k, v in config.handoff_options)
    config = replace(config, decode=urls("decode") + urls("both"), prefill=urls("prefill"), host="0.0.0.0",
                     handoff_options=options, routing=replace(config.routing, tokenizer=None))
    return [PYTHON, "-m", "disagg", *config.to_argv(with_api_key=False)]


def proxy_env(topo: Topology, names: Names) -> list[dict[str, Any]]:
    """The proxy's keys from the Secret: the engine key it sends, the API key clients must send."""
    env = []
    if engine_adapter(topo.engine).key_env(topo):
        env.append(_secret_env(ENGINE_KEY_ENV, names.secret, ENGINE_KEY))
    if topo.proxy.api_key:
        env.append(_secret_env(API_KEY_ENV, names.secret, PROXY_API_KEY))
    return env

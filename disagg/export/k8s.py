"""A planned topology as Kubernetes objects, plain dicts (no client library, no cluster).

Per role a LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``): one group of size 1 per instance
(``replicas``: the role's instances; the topology has no field for spreading one engine over
nodes), its pod running the engine as :mod:`disagg.export.pods` says, with probes, GPUs from the
host's device and node selection by the label ``disagg/host=<topology host name>``. The proxy as
a Deployment and a Service; a Secret with the keys; a NetworkPolicy: only the proxy reaches the
engines' HTTP ports, only engines reach each other's KV ports (and, with NIXL, UCX's TCP port
range); a Namespace unless it is ``default``.

:func:`build_manifests` is called by ``disagg.commands.export`` (and the tests) after
:func:`disagg.export.cluster.review` accepted the topology; :mod:`disagg.export.files` writes
what it returns.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from disagg import __version__
from disagg.deployment import Deployment, EngineLaunch
from disagg.engines.vllm import GUARD_MIDDLEWARE
from disagg.errors import DeploymentError
from disagg.export.pods import (
    ENGINE_KEY,
    KV_SECRET_KEY,
    PROXY_API_KEY,
    Names,
    engine_argv,
    engine_env,
    gpu_count,
    kv_port_range,
    needs_connectors_image,
    proxy_argv,
    proxy_env,
    secret_envs,
    ucx_ports,
)
from disagg.topology import Topology

#: the Kubernetes version whose schemas the tests validate every core object against
KUBERNETES_VERSION = "1.32"
#: the upstream vLLM image (CUDA), at the version disagg is built against
DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
#: images built from the export's Dockerfile (targets ``engine`` and ``proxy``)
CONNECTORS_IMAGE = f"disagg-vllm:{__version__}"
PROXY_IMAGE = f"disagg-proxy:{__version__}"
#: the node label the engines' pods select their nodes by: ``kubectl label node NODE disagg/host=HOST``
NODE_LABEL = "disagg/host"
ROLE_LABEL = "disagg/role"
LWS_API = "leaderworkerset.x-k8s.io/v1"
#: the resource a GPU node's device plugin offers
GPU_RESOURCE = "nvidia.com/gpu"
#: a startup probe's period; its failure threshold covers ``timeouts.startup``
STARTUP_PERIOD_S = 10
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


@dataclass(frozen=True)
class ExportOptions:
    """What the command line adds to the topology."""

    namespace: str = "disagg"
    engine_image: str | None = None     # default: upstream vLLM, or the Dockerfile's engine target
    proxy_image: str = PROXY_IMAGE


@dataclass(frozen=True)
class Manifest:
    """One object and the file it goes in."""

    file: str
    obj: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.obj["kind"])

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])


@dataclass
class Manifests:
    """Everything :func:`build_manifests` made: the objects, the images, what to tell the operator."""

    names: Names
    objects: list[Manifest]
    engine_image: str
    proxy_image: str
    #: the engines need the Dockerfile's ``engine`` target (``disagg_connectors`` on upstream vLLM)
    connectors_image: bool
    notes: list[str] = field(default_factory=list)

    def find(self, kind: str, name: str | None = None) -> list[Manifest]:
        return [m for m in self.objects if m.kind == kind and (name is None or m.name == name)]


def engine_image(topo: Topology, options: ExportOptions) -> str:
    """The engines' image: ``--image``, else the Dockerfile's engine target where the connectors
    are needed, else upstream vLLM."""
    if options.engine_image:
        return options.engine_image
    return CONNECTORS_IMAGE if needs_connectors_image(topo) else DEFAULT_VLLM_IMAGE


def build_manifests(dep: Deployment, names: Names, secrets: dict[str, str],
                    options: ExportOptions | None = None) -> Manifests:
    """The objects for ``dep``; ``secrets``: the Secret's keys and values (:mod:`disagg.export.files`)."""
    options = options or ExportOptions(namespace=names.namespace)
    topo = dep.topology
    image = engine_image(topo, options)
    out = Manifests(names=names, objects=[], engine_image=image, proxy_image=options.proxy_image,
                    connectors_image=needs_connectors_image(topo))
    if names.namespace != "default":
        out.objects.append(Manifest("namespace.yaml", {"apiVersion": "v1", "kind": "Namespace",
                                                       "metadata": {"name": names.namespace}}))
    out.objects.append(Manifest("secret.yaml", _secret(topo, names, secrets)))
    roles = [r for r in ("prefill", "decode", "both") if topo.role(r)]
    for role in roles:
        out.objects.append(Manifest(f"{role}-leaderworkerset.yaml",
                                    _leader_worker_set(dep, role, names, image, options)))
    out.objects.append(Manifest("proxy-deployment.yaml", _proxy_deployment(dep, names, options.proxy_image)))
    out.objects.append(Manifest("proxy-service.yaml", _proxy_service(topo, names)))
    out.objects.append(Manifest("networkpolicy.yaml", _network_policy(dep, names)))
    out.notes += _notes(dep, out)
    return out


def kustomization(manifests: Manifests) -> dict[str, Any]:
    """``kustomization.yaml``: every object's file."""
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [m.file for m in manifests.objects]}


def _labels(names: Names, component: str, role: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "disagg", "app.kubernetes.io/instance": names.base,
              "app.kubernetes.io/component": component}
    if role is not None:
        labels[ROLE_LABEL] = role
    return labels


def _selector(names: Names, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": names.base, "app.kubernetes.io/component": component}


def _meta(name: str, names: Names, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": names.namespace, "labels": labels}


def _secret(topo: Topology, names: Names, secrets: dict[str, str]) -> dict[str, Any]:
    wanted = [ENGINE_KEY] + ([KV_SECRET_KEY] if secret_envs(topo) else []) \
        + ([PROXY_API_KEY] if topo.proxy.api_key else [])
    missing = [k for k in wanted if not secrets.get(k)]
    if missing:
        raise DeploymentError(f"the Secret needs {', '.join(missing)}")
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(names.secret, names, _labels(names, "keys")),
            "stringData": {k: secrets[k] for k in wanted}}


def _seconds(value: float) -> int:
    """A probe's or grace period's whole seconds (at least 1)."""
    return max(1, math.ceil(value))


def _engine_probes(topo: Topology, path: str) -> dict[str, Any]:
    t = topo.timeouts
    get = {"httpGet": {"path": path, "port": "http"}}
    period = _seconds(t.health_interval)
    return {
        # holds liveness off while the engine loads its weights: up to timeouts.startup
        "startupProbe": {**get, "periodSeconds": STARTUP_PERIOD_S, "timeoutSeconds": _seconds(t.health_timeout),
                         "failureThreshold": _seconds(t.startup / STARTUP_PERIOD_S)},
        "readinessProbe": {**get, "periodSeconds": period, "timeoutSeconds": _seconds(t.health_timeout)},
        # as `disagg up`'s supervision: unhealthy for timeouts.liveness, at least 2 probes in a row
        "livenessProbe": {**get, "periodSeconds": period, "timeoutSeconds": _seconds(t.health_timeout),
                          "failureThreshold": max(2, math.ceil(t.liveness / period))},
    }


def _placement(topo: Topology, role: str) -> dict[str, Any]:
    """The pod spec's node selection: the role's topology hosts as values of :data:`NODE_LABEL`."""
    hosts = sorted({i.host for i in topo.role(role)})
    for host in hosts:
        if len(host) > 63 or not _LABEL_VALUE.fullmatch(host):
            raise DeploymentError(f"{topo.file}: hosts.{host}: the name is a node label's value "
                                  f"({NODE_LABEL}={host}): at most 63 letters, digits, '-', '_', '.'")
    if len(hosts) == 1:
        return {"nodeSelector": {NODE_LABEL: hosts[0]}}
    term = {"matchExpressions": [{"key": NODE_LABEL, "operator": "In", "values": hosts}]}
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [term]}}}}


def _engine_ports(eng: EngineLaunch) -> list[dict[str, Any]]:
    ports: list[dict[str, Any]] = [{"name": "http", "containerPort": eng.instance.port, "protocol": "TCP"}]
    kv = kv_port_range(eng.instance)
    if kv is not None:
        for rank, port in enumerate(range(kv[0], kv[1] + 1)):
            ports.append({"name": "kv" if kv[0] == kv[1] else f"kv-{rank}", "containerPort": port,
                          "protocol": "TCP"})
    return ports


def _leader_worker_set(dep: Deployment, role: str, names: Names, image: str,
                       options: ExportOptions) -> dict[str, Any]:
    topo = dep.topology
    engines = dep.role(role)
    eng = engines[0]   # cluster.review refused roles whose instances differ in what the template fixes
    container: dict[str, Any] = {
        "name": "engine", "image": image, "imagePullPolicy": "IfNotPresent",
        "command": engine_argv(eng, topo, names),
        "env": engine_env(eng, topo, names),
        "ports": _engine_ports(eng),
        **_engine_probes(topo, eng.health_path),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    gpus = gpu_count(topo, eng.instance)
    if gpus:
        container["resources"] = {"requests": {GPU_RESOURCE: str(gpus)}, "limits": {GPU_RESOURCE: str(gpus)}}
    pod_spec: dict[str, Any] = {
        **_placement(topo, role),
        "terminationGracePeriodSeconds": _seconds(topo.timeouts.shutdown_grace),
        "containers": [container],
        # vLLM's processes share tensors through /dev/shm, which a container's default 64 MiB starves
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }
    labels = _labels(names, "engine", role)
    return {
        "apiVersion": LWS_API, "kind": "LeaderWorkerSet",
        "metadata": _meta(names.role(role), names, labels),
        "spec": {
            "replicas": len(engines),
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": 1,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": {"metadata": {"labels": labels}, "spec": pod_spec},
            },
        },
    }


def _proxy_deployment(dep: Deployment, names: Names, image: str) -> dict[str, Any]:
    topo = dep.topology
    t = topo.timeouts
    port = topo.proxy.port
    labels = _labels(names, "proxy")
    container = {
        "name": "proxy", "image": image, "imagePullPolicy": "IfNotPresent",
        "command": proxy_argv(dep, names),
        "env": proxy_env(topo, names),
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        # ready while it has a healthy engine of each role; alive while it answers at all
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"},
                           "periodSeconds": _seconds(t.health_interval), "timeoutSeconds": _seconds(t.health_timeout)},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": _seconds(t.health_interval),
                          "failureThreshold": max(2, math.ceil(t.liveness / _seconds(t.health_interval)))},
    }
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _meta(names.proxy, names, labels),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": _selector(names, "proxy")},
            "template": {
                "metadata": {"labels": labels, "annotations": {
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                    "prometheus.io/path": "/metrics"}},
                "spec": {"terminationGracePeriodSeconds": _seconds(t.drain) + 5, "containers": [container]},
            },
        },
    }


def _proxy_service(topo: Topology, names: Names) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(names.proxy, names, _labels(names, "proxy")),
        "spec": {"type": "ClusterIP", "selector": _selector(names, "proxy"),
                 "ports": [{"name": "http", "port": topo.proxy.port, "targetPort": "http", "protocol": "TCP"}]},
    }


def _port_rule(first: int, last: int) -> dict[str, Any]:
    rule: dict[str, Any] = {"protocol": "TCP", "port": first}
    if last > first:
        rule["endPort"] = last
    return rule


def _network_policy(dep: Deployment, names: Names) -> dict[str, Any]:
    topo = dep.topology
    http = sorted({e.instance.port for e in dep.engines})
    ingress: list[dict[str, Any]] = [{
        "from": [{"podSelector": {"matchLabels": _selector(names, "proxy")}}],
        "ports": [_port_rule(p, p) for p in http],
    }]
    kv = sorted({r for e in dep.engines if (r := kv_port_range(e.instance)) is not None})
    ucx = sorted({r for e in dep.engines if (r := ucx_ports(e, topo)) is not None})
    if not topo.colocated:
        ports = [_port_rule(*r) for r in kv + [r for r in ucx if r not in kv]]
        ingress.append({"from": [{"podSelector": {"matchLabels": _selector(names, "engine")}}], "ports": ports})
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(f"{names.base}-engines", names, _labels(names, "engine")),
        "spec": {"podSelector": {"matchLabels": _selector(names, "engine")}, "policyTypes": ["Ingress"],
                 "ingress": ingress},
    }


def _notes(dep: Deployment, out: Manifests) -> list[str]:
    """What the operator must know about these objects."""
    topo = dep.topology
    notes = []
    if topo.link.type == "roce":
        notes.append("link roce: RDMA traffic bypasses the kernel's network stack and is outside NetworkPolicy; "
                     "the engine pods need the RDMA device (UCX_NET_DEVICES " + (topo.link.interface or "unset")
                     + ") from your cluster's RDMA device plugin, which these objects do not request")
    if out.connectors_image:
        notes.append(f"engine image {out.engine_image}: upstream vLLM with disagg's connectors, built from the "
                     "Dockerfile's engine target (not built here: no container engine)")
    elif any(GUARD_MIDDLEWARE in e.argv for e in dep.engines):
        notes.append(f"engine image {out.engine_image}: upstream vLLM; the engine guard middleware (in "
                     "disagg_connectors) is left out: vLLM's VLLM_API_KEY guards /v1 and the NetworkPolicy "
                     "admits only the proxy to the engines' HTTP ports")
    notes.append(f"proxy image {out.proxy_image}: built from the Dockerfile's proxy target (not built here: "
                 "no container engine)")
    return notes

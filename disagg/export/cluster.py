"""Whether a topology can run in a Kubernetes cluster, and which of its fields mean nothing there.

:func:`review` reads the validated topology beside its YAML tree (``disagg.yamlsrc`` keeps the
lines) and returns two lists of :class:`Finding` (``file:line: field: why``):

- ``refused``: what the export cannot express (another engine or connector, a Rust router, an
  embedded or local model, link or hardware emulation, CPU hosts without an image, a role whose
  instances differ); any one refuses the whole export (``disagg export k8s`` exits 2 naming each);
- ``ignored``: what has no meaning in a cluster (SSH, interpreters, run directories, CPU pinning,
  GPU indices, the KV link's interface, the proxy's bind address, restart policy); reported, and
  the export goes on.

``disagg.commands.export`` calls it before building anything (``disagg.export.k8s``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from disagg.topology import InstanceSpec, Topology
from disagg.topology_checks import Finding
from disagg.yamlsrc import Node

#: the engines, connectors and front doors the export writes
ENGINES = ("vllm",)
CONNECTORS = ("nixl", "nixl-push", "socket")
PROXY_KINDS = ("builtin",)


@dataclass
class Review:
    """What :func:`review` found: refusals (any one stops the export) and fields ignored."""

    refused: list[Finding] = field(default_factory=list)
    ignored: list[Finding] = field(default_factory=list)


def node_at(root: Node, path: str) -> Node | None:
    """The node at a dotted path such as ``roles.decode[0].cpus`` (None where it is not written)."""
    node: Node | None = root
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if node is None:
            return None
        if part.startswith("["):
            index = int(part[1:-1])
            node = node.items[index] if index < len(node.items) else None
        else:
            node = node.children.get(part)
    return node


class _Reviewer:
    """Collects findings against one topology file."""

    def __init__(self, topo: Topology, root: Node) -> None:
        self.topo = topo
        self.root = root
        self.result = Review()

    def _finding(self, path: str, message: str, line: int | None = None) -> Finding:
        node = node_at(self.root, path)
        if line is None:
            line = node.line if node is not None else self.root.line
        return Finding(self.topo.file, line, path, message)

    def refuse(self, path: str, message: str, line: int | None = None) -> None:
        self.result.refused.append(self._finding(path, message, line))

    def ignore(self, path: str, message: str) -> None:
        """Report ``path`` as ignored when the file writes it."""
        if node_at(self.root, path) is not None:
            self.result.ignored.append(self._finding(path, message))


def review(topo: Topology, root: Node, *, engine_image_given: bool) -> Review:
    """Check ``topo`` (built from ``root``) for the export; ``engine_image_given``: ``--image`` was
    passed (CPU hosts need one: the upstream vLLM image is a CUDA build)."""
    r = _Reviewer(topo, root)
    _refusals(r, engine_image_given)
    _uniform_roles(r)
    _ignored(r)
    return r.result


def _refusals(r: _Reviewer, engine_image_given: bool) -> None:
    topo = r.topo
    if topo.engine not in ENGINES:
        r.refuse("engine", f"engine {topo.engine}: the export writes vLLM engines only")
    if not topo.colocated and topo.connector not in CONNECTORS:
        why = ("its per-instance config files and the proxy's notification port are not exported"
               if topo.connector == "lmcache" else "it is SGLang's")
        r.refuse("connector", f"connector {topo.connector}: {why}; exportable: {', '.join(CONNECTORS)}")
    if topo.proxy.kind not in PROXY_KINDS:
        r.refuse("proxy.kind", f"proxy.kind {topo.proxy.kind}: the export runs the builtin proxy only")
    model_path = "model.path" if node_at(r.root, "model.path") is not None else "model"
    if topo.model.embedded is not None:
        r.refuse(model_path, f"{topo.model.source} is built on this machine (`disagg make-model`); pods download "
                             "their weights: give a Hugging Face id")
    elif topo.model.path != topo.model.source:
        r.refuse(model_path, f"{topo.model.source} is a directory on this machine; pods download their weights: "
                             "give a Hugging Face id")
    if topo.link.type == "emulated":
        r.refuse("link.type", "an emulated link is network namespaces and tc on this machine; a cluster's links "
                              "are its own")
    for name, host in topo.hosts.items():
        if host.emulate is not None:
            r.refuse(f"hosts.{name}.emulate", "emulated hardware (held prefill rates, CPU quotas, sized KV caches) "
                                              "is for one machine playing several; a cluster has real ones")
        if node_at(r.root, f"hosts.{name}.model") is not None:
            r.refuse(f"hosts.{name}.model", "a copy of the model on that host; pods download their weights: "
                                            "remove it")
        if host.device == "cpu" and not engine_image_given:
            r.refuse(f"hosts.{name}.device", "cpu: the upstream vLLM image is a CUDA build; pass --image with a "
                                             "CPU build of vLLM")


def _template_key(topo: Topology, inst: InstanceSpec) -> dict[str, object]:
    """What one pod template fixes for every instance of a role."""
    return {"port": inst.port, "kv_port": inst.kv_port, "args": inst.args, "env": dict(inst.env),
            "number of gpus": len(inst.gpus), "device": topo.hosts[inst.host].device}


def _uniform_roles(r: _Reviewer) -> None:
    """A role is one LeaderWorkerSet: its instances must agree on everything its pod template fixes."""
    for role in ("prefill", "decode", "both"):
        instances = r.topo.role(role)
        if len(instances) < 2:
            continue
        first = _template_key(r.topo, instances[0])
        for inst in instances[1:]:
            other = _template_key(r.topo, inst)
            differ = [k for k in first if first[k] != other[k]]
            if differ:
                r.refuse(f"roles.{inst.name}",
                         f"differs from roles.{role}[0] in {', '.join(differ)}: a role is one LeaderWorkerSet, "
                         "whose instances share one pod template (each pod has an address of its own, so the "
                         "same port and kv_port do)", line=inst.line or None)


def _ignored(r: _Reviewer) -> None:
    topo = r.topo
    for name in topo.hosts:
        for key in ("ssh", "ssh_port", "ssh_key", "ssh_options"):
            r.ignore(f"hosts.{name}.{key}", "no meaning in a cluster: Kubernetes starts the pods")
        for key in ("python", "venv"):
            r.ignore(f"hosts.{name}.{key}", "the engine runs the image's python3")
        r.ignore(f"hosts.{name}.workdir", "logs are the pods' (kubectl logs)")
    r.ignore("run_dir", "logs are the pods' (kubectl logs); there is no run state")
    for inst in topo.instances:
        where = f"roles.{inst.name}"
        r.ignore(f"{where}.cpus", "pinning to a host's cores has no meaning in a pod; the pod requests no CPUs "
                                  "(set resources in the LeaderWorkerSet if the node needs them)")
        if inst.gpus and inst.gpus != tuple(range(len(inst.gpus))):
            r.ignore(f"{where}.gpus", f"the device plugin picks the node's GPUs; the pod requests {len(inst.gpus)}")
    if topo.link.type != "roce":
        for name in topo.hosts:
            r.ignore(f"hosts.{name}.interface", "a pod's traffic leaves through its own interface; "
                                                "UCX_NET_DEVICES is left out")
        r.ignore("link.interface", "a pod's traffic leaves through its own interface; UCX_NET_DEVICES is left out")
    if topo.proxy.host not in ("0.0.0.0", "::", ""):
        r.ignore("proxy.host", f"{topo.proxy.host}: the proxy listens on every address of its pod, behind its "
                               "Service")
    r.ignore("restart", "Kubernetes restarts containers (restartPolicy and the liveness probes)")
    for key in ("ssh_command", "ssh_check", "proxy_startup"):
        r.ignore(f"timeouts.{key}", "no meaning in a cluster (no SSH; the proxy's readiness probe waits)")

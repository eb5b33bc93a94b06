"""``disagg export k8s``: a topology as Kubernetes manifests (docs/kubernetes.md).

Reads and validates the topology, asks :func:`disagg.export.cluster.review` whether a cluster can
run it (refusals exit 2 naming each field with file:line; fields with no meaning there are
listed as ignored), plans it as ``disagg check`` does, and writes the objects
(:mod:`disagg.export.k8s`), their Secret and the Dockerfile (:mod:`disagg.export.files`).
Prints what it wrote and where each secret came from, never a secret.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from disagg.deployment import build_deployment
from disagg.errors import DeploymentError
from disagg.export.cluster import review
from disagg.export.files import resolve_secrets, write_export
from disagg.export.k8s import (
    GPU_RESOURCE,
    LWS_API,
    NODE_LABEL,
    PROXY_IMAGE,
    ExportOptions,
    Manifest,
    Manifests,
    build_manifests,
)
from disagg.export.pods import Names, check_namespace, dns_label
from disagg.topology import build_topology
from disagg.yamlsrc import load_yaml


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``export`` and its one kind, ``k8s``."""
    p = sub.add_parser("export", help="write a topology as another system's configuration")
    kinds = p.add_subparsers(dest="export_kind", metavar="KIND", required=True)
    k = kinds.add_parser(
        "k8s", help="Kubernetes manifests: a LeaderWorkerSet per role, the proxy, a Secret, a NetworkPolicy",
        description="Write plain YAML, one file per object, and a kustomization.yaml listing them "
                    "(`kubectl apply -k DIR`), plus a Dockerfile for the images upstream does not publish. "
                    "Secrets come from $DISAGG_ENGINE_KEY / $DISAGG_KV_SECRET when set, else from a previous "
                    "export's secret.yaml in DIR, else are generated; they are written to secret.yaml only.")
    k.add_argument("topology", metavar="TOPOLOGY.yaml")
    k.add_argument("--out", metavar="DIR", help="where to write (default: k8s/<topology name>)")
    k.add_argument("--namespace", metavar="NS", default="disagg", help="the objects' namespace (default: disagg)")
    k.add_argument("--image", metavar="IMAGE",
                   help="the engines' image (default: upstream vLLM; with the socket connector, the Dockerfile's "
                        "engine target)")
    k.add_argument("--proxy-image", metavar="IMAGE", default=PROXY_IMAGE,
                   help="the proxy's image (default: %(default)s, the Dockerfile's proxy target)")
    k.set_defaults(handler=cmd_export_k8s)


def cmd_export_k8s(args: argparse.Namespace) -> int:
    """Export one topology; exit 2 (DeploymentError) when it cannot run in a cluster."""
    root = load_yaml(args.topology)
    topo = build_topology(root, Path(args.topology))
    found = review(topo, root, engine_image_given=bool(args.image))
    if found.refused:
        raise DeploymentError(f"{args.topology} cannot be exported to Kubernetes:\n"
                              + "\n".join(f"  {f}" for f in found.refused))
    dep = build_deployment(topo)
    names = Names(dns_label(topo.name), check_namespace(args.namespace))
    out = Path(args.out or Path("k8s") / names.base)
    values, origins = resolve_secrets(topo, out)
    options = ExportOptions(namespace=names.namespace, engine_image=args.image, proxy_image=args.proxy_image)
    manifests = build_manifests(dep, names, values, options)
    write_export(out, manifests, args.topology)
    print(report(manifests, out, args.topology, origins))
    if found.ignored:
        print("ignored (no meaning in a cluster):")
        print("\n".join(f"  {f}" for f in found.ignored))
    return 0


def _describe(m: Manifest, origins: dict[str, str]) -> str:
    """One object in a line: what it runs or holds (a Secret: its keys' origins, never values)."""
    if m.kind == "Secret":
        return ", ".join(f"{k} {origins[k]}" for k in m.obj["stringData"]) + " (mode 0600; values not printed)"
    if m.kind == "LeaderWorkerSet":
        spec = m.obj["spec"]
        pod = spec["leaderWorkerTemplate"]["workerTemplate"]["spec"]
        container = pod["containers"][0]
        gpus = container.get("resources", {}).get("limits", {}).get(GPU_RESOURCE)
        hosts = ",".join(_hosts(m))
        return (f"{spec['replicas']} x size 1, {container['image']}"
                + (f", {gpus} {GPU_RESOURCE}" if gpus else "") + f", nodes {NODE_LABEL}={hosts}")
    if m.kind == "Deployment":
        return str(m.obj["spec"]["template"]["spec"]["containers"][0]["image"])
    if m.kind == "Service":
        return ", ".join(f"port {p['port']}" for p in m.obj["spec"]["ports"])
    if m.kind == "NetworkPolicy":
        rules = []
        for rule in m.obj["spec"]["ingress"]:
            source = rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
            ports = ", ".join(f"{p['port']}" + (f"-{p['endPort']}" if "endPort" in p else "") for p in rule["ports"])
            rules.append(f"{source} -> {ports}")
        return "engines admit " + "; ".join(rules)
    return ""


def report(manifests: Manifests, out: Path, source: str, origins: dict[str, str]) -> str:
    """What ``export k8s`` prints: the files, the nodes to label, the notes."""
    names = manifests.names
    width = max(len(m.file) for m in manifests.objects)
    lines = [f"exported {source} to {out}/ (namespace {names.namespace}):"]
    for m in manifests.objects:
        detail = _describe(m, origins)
        lines.append(f"  {m.file:<{width}}  {m.kind} {m.name}" + (f": {detail}" if detail else ""))
    lines.append(f"  {'kustomization.yaml':<{width}}  lists them: kubectl apply -k {out}")
    lines.append(f"  {'Dockerfile':<{width}}  the images upstream does not publish")
    hosts = sorted({h for lws in manifests.find("LeaderWorkerSet") for h in _hosts(lws)})
    lines.append("label the nodes: " + "; ".join(f"kubectl label node <node> {NODE_LABEL}={h}" for h in hosts))
    lines.append(f"needs: the LeaderWorkerSet controller ({LWS_API}), a GPU device plugin for {GPU_RESOURCE}, "
                 "a CNI that enforces NetworkPolicy")
    lines += [f"note: {n}" for n in manifests.notes]
    return "\n".join(lines)


def _hosts(m: Manifest) -> list[str]:
    pod = m.obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    if "nodeSelector" in pod:
        return [pod["nodeSelector"][NODE_LABEL]]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return list(terms[0]["matchExpressions"][0]["values"])

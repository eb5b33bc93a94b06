"""`disagg export k8s`: every topology of topologies/ exports or is refused with its reason; the
objects validate offline (Kubernetes' OpenAPI schemas through kubernetes-validate, the
LeaderWorkerSet against its CRD's fields transcribed in data/); each engine's command is what
`disagg check` prints, but for the cluster's addresses; secrets stay in secret.yaml.

What only a cluster can show (the LeaderWorkerSet controller's pods, DNS, NetworkPolicy
enforcement, vLLM starting from these commands) is not tested here (docs/kubernetes.md).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from disagg.cli import main

ROOT = Path(__file__).resolve().parents[3]
TOPOLOGIES = ROOT / "topologies"
DATA = Path(__file__).parent / "data"
#: the Kubernetes version every core object is validated against (kubectl here is 1.32)
K8S_VERSION = "1.32"
LWS_SCHEMA = yaml.safe_load((DATA / "leaderworkerset-v0.10.0.yaml").read_text())
NAMESPACE = "serving"

#: the topologies of topologies/ that export, and each refused one's first reason (field, words)
EXPORTABLE = ("house-2g5.yaml", "two-sparks-cx7.yaml")
REFUSED = {
    "colocated.yaml": ("model.path", "disagg:tiny is built on this machine"),
    "house-emulated.yaml": ("model.path", "disagg:tiny-kvheavy is built on this machine"),
    "house-emulated-f32.yaml": ("model.path", "disagg:tiny-kvheavy is built on this machine"),
    "lmcache-1p1d.yaml": ("connector", "connector lmcache"),
    "local-cpu-nixl-push.yaml": ("model.path", "disagg:tiny is built on this machine"),
    "local-cpu-nixl.yaml": ("model.path", "disagg:tiny is built on this machine"),
    "local-cpu.yaml": ("model.path", "disagg:tiny is built on this machine"),
    "local-emulated-1g.yaml": ("link.type", "an emulated link"),
    "replicas.yaml": ("roles.both[1]", "differs from roles.both[0] in port"),
    "sglang-1p1d.yaml": ("engine", "engine sglang"),
    "two-machines.yaml": ("hosts.workstation.model", "a copy of the model on that host"),
}

#: a streaming socket pair over three GPU hosts (two prefill instances on two hosts): what no
#: topology of topologies/ covers (the connectors image, DNS peers, node affinity, replicas 2)
SOCKET = """\
name: Pair.Socket
model: {path: Qwen/Qwen2.5-0.5B-Instruct, dtype: bfloat16, max_model_len: 4096}
engine: vllm
connector: {type: socket, streaming: true}
link: {type: ethernet, rate: 10gbit, interface: eth1}
proxy: {host: 127.0.0.1, port: 8000}
hosts:
  a: {address: 10.0.0.1, device: cuda, ssh: me@a}
  b: {address: 10.0.0.2, device: cuda, ssh: me@b}
  c: {address: 10.0.0.3, device: cuda}
roles:
  prefill:
    - {host: a, port: 8100, kv_port: 5601, gpus: [1], cpus: [0, 1]}
    - {host: b, port: 8100, kv_port: 5601, gpus: [0]}
  decode:
    - {host: c, port: 8200, kv_port: 5602, gpus: [0], args: [--gpu-memory-utilization, "0.8"]}
"""
#: one colocated server (role both): no KV ports, no connector
COLOCATED = """\
model: Qwen/Qwen2.5-0.5B-Instruct
engine: vllm
link: {type: loopback}
hosts:
  gpu: {address: 127.0.0.1, device: cuda}
roles:
  both:
    - {host: gpu, port: 8300, gpus: [0]}
"""


def _export(topology: Path, out: Path, *extra: str) -> int:
    return main(["export", "k8s", str(topology), "--out", str(out), "--namespace", NAMESPACE, *extra])


def _objects(out: Path) -> dict[str, dict[str, Any]]:
    """Every file kustomization.yaml lists, by file name, as written."""
    listed = yaml.safe_load((out / "kustomization.yaml").read_text())["resources"]
    return {name: yaml.safe_load((out / name).read_text()) for name in listed}


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each exportable topology (those of topologies/ and the two above) -> (its file, its export)."""
    base = tmp_path_factory.mktemp("k8s")
    files = {name: TOPOLOGIES / name for name in EXPORTABLE}
    for name, text in (("socket.yaml", SOCKET), ("colocated-gpu.yaml", COLOCATED)):
        files[name] = base / name
        files[name].write_text(text)
    out = {}
    for name, path in files.items():
        target = base / "out" / name.removesuffix(".yaml")
        assert _export(path, target) == 0, name
        out[name] = (path, target)
    return out


def test_topologies_are_all_classified() -> None:
    assert sorted(EXPORTABLE + tuple(REFUSED)) == sorted(p.name for p in TOPOLOGIES.glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_topology_names_its_reason_with_file_and_line(name: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert _export(TOPOLOGIES / name, tmp_path / "out") == 2
    err = capsys.readouterr().err
    field, words = REFUSED[name]
    path = f"{TOPOLOGIES / name}"
    assert re.search(rf"^  {re.escape(path)}:\d+: {re.escape(field)}: .*{re.escape(words)}", err, re.M), err
    assert not (tmp_path / "out").exists()


def test_ignored_fields_are_reported_with_their_lines(exports: dict[str, tuple[Path, Path]], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = TOPOLOGIES / "house-2g5.yaml"
    assert _export(path, tmp_path / "out") == 0
    out = capsys.readouterr().out
    lines = path.read_text().splitlines()
    for field, text in (("hosts.workstation.ssh", "ssh: me@workstation.lan"),
                        ("hosts.workstation.venv", "venv: /opt/disagg/.venv"), ("link.interface", "interface: enp5s0")):
        line = next(n for n, s in enumerate(lines, 1) if text in s)
        assert f"{path}:{line}: {field}: " in out


def test_core_objects_validate_against_the_kubernetes_schemas(exports: dict[str, tuple[Path, Path]]) -> None:
    kinds = set()
    for name, (_, out) in exports.items():
        for file, obj in _objects(out).items():
            if obj["kind"] == "LeaderWorkerSet":
                continue
            # strict: a field the schema does not have is an error
            assert kubernetes_validate.validate(obj, K8S_VERSION, strict=True) == K8S_VERSION, (name, file)
            kinds.add(obj["kind"])
    assert kinds == {"Namespace", "Secret", "Deployment", "Service", "NetworkPolicy"}


def test_leaderworkersets_validate_against_the_crd_and_their_pods_against_kubernetes(
        exports: dict[str, tuple[Path, Path]]) -> None:
    count = 0
    for _, out in exports.values():
        for obj in _objects(out).values():
            if obj["kind"] != "LeaderWorkerSet":
                continue
            jsonschema.validate(obj, LWS_SCHEMA)
            template = obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]
            pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": obj["metadata"]["name"]},
                   "template": template}
            kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
            count += 1
    assert count == 7   # prefill and decode of three, both of one


def test_the_transcribed_crd_schema_refuses_what_the_crd_does_not_have(
        exports: dict[str, tuple[Path, Path]]) -> None:
    lws = _objects(exports["house-2g5.yaml"][1])["prefill-leaderworkerset.yaml"]
    for bad in ({"startupPolicy": "LeaderFirst"}, {"leaderWorkerTemplate": {"size": "1", "workerTemplate": {}}},
                {"replica": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**lws, "spec": {**lws["spec"], **bad}}, LWS_SCHEMA)


def _check_plan(topology: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """What `disagg check` prints, per engine: url, env, argv; and the proxy's argv."""
    assert main(["check", str(topology)]) == 0
    text = capsys.readouterr().out
    plan: dict[str, Any] = {}
    current = None
    for line in text.splitlines():
        if m := re.match(r"  (\w+\[\d+\]): (http://\S+) ", line):
            current = plan[m.group(1)] = {"url": m.group(2)}
        elif line.startswith("    env:  ") and current is not None:
            words = shlex.split(line[len("    env:  "):])
            current["env"] = dict(w.split("=", 1) for w in words if "=" in w)
        elif line.startswith("    argv: ") and current is not None:
            current["argv"] = shlex.split(line[len("    argv: "):])
        elif line.startswith("proxy (builtin): "):
            plan["proxy"] = shlex.split(line[len("proxy (builtin): "):])
    return plan


def _dns(role: str, index: int) -> str:
    return f"{{base}}-{role}-{index}.{{base}}-{role}.{NAMESPACE}"


def _without_pair(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for i, word in enumerate(argv):
        if skip:
            skip = False
            continue
        if word == flag and i + 1 < len(argv):
            skip = True
            continue
        out.append(word)
    return out


@pytest.mark.parametrize("name", ["house-2g5.yaml", "two-sparks-cx7.yaml", "socket.yaml", "colocated-gpu.yaml"])
def test_engine_commands_are_checks_but_for_the_clusters_addresses(
        name: str, exports: dict[str, tuple[Path, Path]], capsys: pytest.CaptureFixture[str]) -> None:
    topology, out = exports[name]
    plan = _check_plan(topology, capsys)
    objects = _objects(out)
    topo = yaml.safe_load(topology.read_text())
    base = objects["secret.yaml"]["metadata"]["name"].removesuffix("-keys")
    socket = topo.get("connector", {}) == {"type": "socket", "streaming": True}
    for role in ("prefill", "decode", "both"):
        instances = [k for k in plan if k.startswith(f"{role}[")]
        if not instances:
            continue
        lws = objects[f"{role}-leaderworkerset.yaml"]
        assert lws["spec"]["replicas"] == len(instances)
        container = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
        for inst in instances:   # one pod template for every instance of the role
            theirs, ours = plan[inst]["argv"], container["command"]
            address = topo["hosts"][topo["roles"][role][int(inst[len(role) + 1:-1])]["host"]]["address"]
            if not socket:   # the upstream image has no disagg_connectors: no engine guard
                assert "--middleware" in theirs
                theirs = _without_pair(theirs, "--middleware")
            assert len(ours) == len(theirs), (ours, theirs)
            assert ours[0] == "python3"
            for i in range(1, len(ours)):
                if theirs[i - 1] == "--host":
                    assert (ours[i], theirs[i]) == ("$(POD_IP)", address)
                elif theirs[i - 1] == "--kv-transfer-config" and socket:
                    mine, check = json.loads(ours[i]), json.loads(theirs[i])
                    extra, check_extra = mine.pop("kv_connector_extra_config"), check.pop("kv_connector_extra_config")
                    assert mine == check
                    if role == "prefill":
                        assert check_extra.pop("host") == address
                        assert extra.pop("host") == f"$(POD_NAME).{base}-prefill.{NAMESPACE}"
                        assert "allowed_peers" not in extra
                        check_extra.pop("allowed_peers", None)
                    else:
                        assert check_extra.pop("peers") == ["10.0.0.1:5601", "10.0.0.2:5601"]
                        assert extra.pop("peers") == [_dns("prefill", 0).format(base=base) + ":5601",
                                                      _dns("prefill", 1).format(base=base) + ":5601"]
                    assert extra == check_extra
                else:
                    assert ours[i] == theirs[i], (i, ours[i], theirs[i])
            env = {e["name"]: e for e in container["env"]}
            for key, value in plan[inst]["env"].items():
                if key == "CUDA_VISIBLE_DEVICES" or (key == "UCX_NET_DEVICES" and topo["link"]["type"] != "roce"):
                    assert key not in env
                elif key == "VLLM_NIXL_SIDE_CHANNEL_HOST":
                    assert env[key]["value"] == "$(POD_IP)"
                else:
                    assert env[key]["value"] == value, key
            added = set(env) - set(plan[inst]["env"])
            want = {"POD_IP", "POD_NAME", "VLLM_API_KEY", "HF_TOKEN"} | ({"DISAGG_KV_SECRET"} if socket else set())
            if role != "both" and not socket and "UCX_TCP_PORT_RANGE" not in plan[inst]["env"]:
                want.add("UCX_TCP_PORT_RANGE")
            assert added == want
            assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
            assert list(env)[:2] == ["POD_IP", "POD_NAME"]   # before the values that refer to them


@pytest.mark.parametrize("name", ["house-2g5.yaml", "socket.yaml", "colocated-gpu.yaml"])
def test_proxy_command_is_ups_but_for_the_engines_names(
        name: str, exports: dict[str, tuple[Path, Path]], capsys: pytest.CaptureFixture[str]) -> None:
    topology, out = exports[name]
    plan = _check_plan(topology, capsys)
    objects = _objects(out)
    base = objects["secret.yaml"]["metadata"]["name"].removesuffix("-keys")
    ours = objects["proxy-deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert ours[:4] == ["python3", "-m", "disagg", "proxy"]
    assert ours[ours.index("--host") + 1] == "0.0.0.0"
    names = {}
    for inst, engine in plan.items():
        if inst != "proxy":
            role, index = re.fullmatch(r"(\w+)\[(\d+)\]", inst).groups()   # type: ignore[union-attr]
            port = engine["url"].rsplit(":", 1)[1]
            names[engine["url"]] = "http://" + _dns(role, int(index)).format(base=base) + f":{port}"
    theirs = [names.get(w, w) for w in _without_pair(plan["proxy"], "--host")[3:]]
    if "--handoff-option" in theirs:   # the streaming socket handoff: prefill listeners by name
        i = theirs.index("--handoff-option") + 1
        assert theirs[i] == "kv_peers=10.0.0.1:5601,10.0.0.2:5601"
        theirs[i] = "kv_peers=" + ",".join(_dns("prefill", n).format(base=base) + ":5601" for n in (0, 1))
    assert _without_pair(ours, "--host")[3:] == theirs


def test_objects_and_what_they_allow(exports: dict[str, tuple[Path, Path]]) -> None:
    objects = _objects(exports["socket.yaml"][1])
    prefill = objects["prefill-leaderworkerset.yaml"]
    pod = prefill["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    assert prefill["metadata"] == {"name": "pair-socket-prefill", "namespace": NAMESPACE,
                                   "labels": {"app.kubernetes.io/name": "disagg",
                                              "app.kubernetes.io/instance": "pair-socket",
                                              "app.kubernetes.io/component": "engine", "disagg/role": "prefill"}}
    assert prefill["spec"]["replicas"] == 2 and prefill["spec"]["leaderWorkerTemplate"]["size"] == 1
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term == {"matchExpressions": [{"key": "disagg/host", "operator": "In", "values": ["a", "b"]}]}
    container = pod["containers"][0]
    assert container["image"] == "disagg-vllm:0.1.0"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8100, "kv": 5601}
    assert {k: container[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")} == \
        {k: {"path": "/health", "port": "http"} for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    policy = objects["networkpolicy.yaml"]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/instance": "pair-socket",
                                                     "app.kubernetes.io/component": "engine"}
    (http, kv) = policy["ingress"]
    assert http["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "proxy"
    assert [p["port"] for p in http["ports"]] == [8100, 8200]
    assert kv["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "engine"
    assert [p["port"] for p in kv["ports"]] == [5601, 5602]   # no UCX: the socket connector is plain TCP
    # NIXL: UCX's TCP ports too, those the plan fixes
    house = _objects(exports["house-2g5.yaml"][1])
    env = {e["name"]: e.get("value") for e in house["decode-leaderworkerset.yaml"]["spec"]["leaderWorkerTemplate"]
           ["workerTemplate"]["spec"]["containers"][0]["env"]}
    low, high = map(int, env["UCX_TCP_PORT_RANGE"].split("-"))
    rules = house["networkpolicy.yaml"]["spec"]["ingress"]
    assert {"protocol": "TCP", "port": low, "endPort": high} in rules[1]["ports"]
    # colocated: no engine-to-engine rule
    assert len(_objects(exports["colocated-gpu.yaml"][1])["networkpolicy.yaml"]["spec"]["ingress"]) == 1


def test_dockerfile_has_the_engine_target_only_for_the_socket_connector(
        exports: dict[str, tuple[Path, Path]]) -> None:
    socket = (exports["socket.yaml"][1] / "Dockerfile").read_text()
    assert "FROM ${VLLM_IMAGE} AS engine" in socket and "COPY connectors /opt/disagg/disagg_connectors" in socket
    house = (exports["house-2g5.yaml"][1] / "Dockerfile").read_text()
    assert "AS engine" not in house and "FROM python:3.11-slim AS proxy" in house


def test_secrets_are_written_to_the_secret_only(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    topology = tmp_path / "socket.yaml"
    topology.write_text(SOCKET)
    out = tmp_path / "out"
    monkeypatch.delenv("DISAGG_ENGINE_KEY", raising=False)
    monkeypatch.delenv("DISAGG_KV_SECRET", raising=False)
    assert _export(topology, out) == 0
    printed = capsys.readouterr()
    secret = yaml.safe_load((out / "secret.yaml").read_text())["stringData"]
    assert set(secret) == {"engine-key", "kv-secret"}
    assert len(secret["engine-key"]) >= 32 and len(secret["kv-secret"]) == 64
    for value in secret.values():
        assert value not in printed.out + printed.err
        for path in out.iterdir():
            assert path.name == "secret.yaml" or value not in path.read_text()
    assert stat.S_IMODE((out / "secret.yaml").stat().st_mode) == 0o600
    assert "engine-key generated, kv-secret generated" in printed.out
    # exporting again keeps them (no rotation); the environment's win
    assert _export(topology, out) == 0
    assert yaml.safe_load((out / "secret.yaml").read_text())["stringData"] == secret
    assert "kept from" in capsys.readouterr().out
    monkeypatch.setenv("DISAGG_ENGINE_KEY", "k" * 40)
    assert _export(topology, out) == 0
    again = yaml.safe_load((out / "secret.yaml").read_text())["stringData"]
    assert again == {**secret, "engine-key": "k" * 40}
    assert "k" * 40 not in capsys.readouterr().out
    monkeypatch.setenv("DISAGG_KV_SECRET", "short")
    assert _export(topology, out) == 2
    assert "must be at least 16 printable characters" in capsys.readouterr().err


def test_cpu_hosts_export_with_an_image_of_their_own(tmp_path: Path) -> None:
    topology = tmp_path / "cpu.yaml"
    topology.write_text(COLOCATED.replace("device: cuda", "device: cpu").replace(", gpus: [0]", ""))
    assert _export(topology, tmp_path / "refused") == 2
    assert _export(topology, tmp_path / "out", "--image", "example.org/vllm-cpu:1") == 0
    lws = _objects(tmp_path / "out")["both-leaderworkerset.yaml"]
    container = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert container["image"] == "example.org/vllm-cpu:1" and "resources" not in container


def test_bad_namespace_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "k8s", str(TOPOLOGIES / "house-2g5.yaml"), "--out", str(tmp_path),
                 "--namespace", "Not_A_Name"]) == 2
    assert "--namespace 'Not_A_Name'" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("name", ["house-2g5.yaml", "socket.yaml"])
def test_kubectl_kustomize_renders_the_directory(name: str, exports: dict[str, tuple[Path, Path]]) -> None:
    out = exports[name][1]
    rendered = subprocess.run(["kubectl", "kustomize", str(out)], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == \
        sorted((o["kind"], o["metadata"]["name"]) for o in _objects(out).values())

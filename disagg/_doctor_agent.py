"""The ``disagg doctor`` agent: one Python process per host that looks at that host and reports JSON.

Standard library only, and it imports nothing of disagg: :mod:`disagg.doctor.run` sends this
file's source to each host (``python -c SOURCE REQUEST``, over SSH or locally), so a host needs a
Python but not disagg. The request (JSON, one argument) says what to look at; the agent answers
on stdout, one line per phase:

``DOCTOR-READY {json}``
    After the host's own checks: the interpreter and package versions, the model's
    ``config.json`` and fingerprint, the devices, whether the address is this host's, the
    interfaces, free disk, which ports bind (each free port then holds a temporary listener, so
    that other hosts can connect to it), and where the listeners are.
``DOCTOR-CLOCK <seconds since the epoch>``
    On ``GO <json>`` from stdin (interactive requests only): this host's clock, read at once.
``DOCTOR-DONE {json}``
    Then: a TCP connect to each ``[address, port, label]`` of the GO line, from this host.

The listeners stay open until stdin closes. Commands the checks run (``nvidia-smi``, ``date``)
come from the request's ``commands``, so tests can name a stand-in for hardware a namespace lacks.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

READY, CLOCK, DONE = "DOCTOR-READY", "DOCTOR-CLOCK", "DOCTOR-DONE"
#: files up to this size are hashed whole for the model's fingerprint; larger ones count by size
HASH_LIMIT = 1 << 20
CONNECT_TIMEOUT_S = 2.0
_REVISION = re.compile(r"/snapshots/([0-9a-f]{40})(/|$)")


def _versions(names: list[str]) -> dict[str, str | None]:
    from importlib import metadata
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _hf_snapshot(model_id: str) -> str | None:
    """The cached snapshot directory of a Hugging Face id on this host (refs/main), or None."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub")
    repo = os.path.join(hub, "models--" + model_id.replace("/", "--"))
    try:
        with open(os.path.join(repo, "refs", "main")) as f:
            revision = f.read().strip()
    except OSError:
        return None
    return os.path.join(repo, "snapshots", revision)


def _model(spec: dict[str, Any]) -> dict[str, Any]:
    """Read ``config.json`` and fingerprint the directory: the Hugging Face revision when the path
    is a cache snapshot, else a hash over every file's name and size and the bytes of the small ones."""
    path = spec["path"]
    if spec.get("hf_id"):
        snapshot = _hf_snapshot(path)
        if snapshot is None:
            return {"ok": False, "missing": True, "error": f"{path} is not in this host's Hugging Face cache"}
        path = snapshot
    path = os.path.expanduser(path)
    config = os.path.join(path, "config.json")
    try:
        with open(config, "rb") as f:
            parsed = json.loads(f.read())
    except FileNotFoundError:
        return {"ok": False, "missing": not os.path.exists(path), "error": f"{config}: no such file"}
    except (OSError, ValueError) as exc:
        return {"ok": False, "missing": False, "error": f"{config}: {exc}"}
    model_type = parsed.get("model_type") if isinstance(parsed, dict) else None
    match = _REVISION.search(os.path.realpath(path) + "/") or _REVISION.search(path + "/")
    if match:
        return {"ok": True, "model_type": model_type, "fingerprint": "revision " + match.group(1)[:12],
                "files": None}
    digest = hashlib.sha256()
    count = total = 0
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            if rel.startswith(".cache"):
                continue
            try:
                size = os.stat(full).st_size
                digest.update(f"{rel}\0{size}\0".encode())
                if size <= HASH_LIMIT:
                    with open(full, "rb") as f:
                        digest.update(f.read())
            except OSError as exc:
                return {"ok": False, "missing": False, "error": f"{full}: {exc.strerror or exc}"}
            count += 1
            total += size
    return {"ok": True, "model_type": model_type, "fingerprint": "files " + digest.hexdigest()[:12],
            "files": count, "bytes": total}


def _gpus(command: str) -> dict[str, Any]:
    try:
        done = subprocess.run([command, "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"ok": False, "error": f"{command}: {exc}"}
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()[-300:]
        return {"ok": False, "error": f"{command} exited {done.returncode}: {said}"}
    gpus = []
    for line in done.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if parts and parts[0].isdigit():
            gpus.append({"index": int(parts[0]), "name": parts[1] if len(parts) > 1 else "?"})
    return {"ok": True, "gpus": gpus}


def _cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _address(address: str) -> dict[str, Any]:
    """Whether ``address`` is one of this host's (a bind to it succeeds)."""
    if address in ("", "0.0.0.0", "::"):
        return {"ok": True, "resolved": address}
    try:
        infos = socket.getaddrinfo(address, None, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        return {"ok": False, "error": f"does not resolve here: {exc}"}
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((sockaddr[0], 0))
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                return {"ok": False, "resolved": sockaddr[0], "error": "not an address of this host"}
            return {"ok": False, "resolved": sockaddr[0], "error": str(exc)}
    return {"ok": True, "resolved": sockaddr[0]}


def _interfaces(names: list[str]) -> dict[str, Any]:
    have = sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []
    rdma = sorted(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else []
    out: dict[str, bool | None] = {}
    for name in names:
        try:
            if ":" in name:  # an RDMA device and port as UCX names them (mlx5_0:1)
                device, port = name.split(":", 1)
                with open(f"/sys/class/infiniband/{device}/ports/{port}/state") as f:
                    up = "ACTIVE" in f.read()
            else:
                with open(f"/sys/class/net/{name}/flags") as f:
                    up = bool(int(f.read().strip(), 16) & 1)
        except (OSError, ValueError):
            up = None
        out[name] = up
    return {"have": have + rdma, "state": out}


def _disk(path: str) -> dict[str, Any]:
    probe = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    usage = shutil.disk_usage(probe)
    return {"path": probe, "free": usage.free}


def _local_port_range() -> list[int] | None:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = f.read().split()
        return [int(lo), int(hi)]
    except (OSError, ValueError):
        return None


def _listener(address: str, port: int) -> socket.socket | str:
    """A socket listening on ``address:port``, or why not."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(16)
    except OSError as exc:
        sock.close()
        return "in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return sock


def _ports(binds: list[dict[str, Any]], held: list[socket.socket]) -> list[dict[str, Any]]:
    """Bind each port (or each port of a range); a free one keeps a listener for the reach checks."""
    out = []
    for item in binds:
        address, label = item["address"], item["label"]
        if "range" in item:
            lo, hi = item["range"]
            free, listening = 0, None
            for port in range(lo, hi + 1):
                got = _listener(address, port)
                if isinstance(got, socket.socket):
                    free += 1
                    if listening is None:
                        listening = port
                        held.append(got)
                    else:
                        got.close()
            out.append({"label": label, "range": [lo, hi], "free": free, "listening": listening,
                        "aliases": item.get("aliases") or []})
        else:
            got = _listener(address, item["port"])
            if isinstance(got, socket.socket):
                held.append(got)
                out.append({"label": label, "port": item["port"], "free": True, "listening": item["port"]})
            else:
                out.append({"label": label, "port": item["port"], "free": False, "error": got})
    return out


def _connect(targets: list[list[Any]]) -> list[dict[str, Any]]:
    out = []
    for address, port, label in targets:
        start = time.monotonic()
        try:
            socket.create_connection((address, int(port)), timeout=CONNECT_TIMEOUT_S).close()
            out.append({"label": label, "address": address, "port": port, "ok": True,
                        "ms": round((time.monotonic() - start) * 1000, 2)})
        except TimeoutError:
            out.append({"label": label, "address": address, "port": port, "ok": False,
                        "error": f"no answer in {CONNECT_TIMEOUT_S:g} s (filtered?)"})
        except OSError as exc:
            out.append({"label": label, "address": address, "port": port, "ok": False,
                        "error": exc.strerror or str(exc)})
    return out


def _clock(command: str) -> float:
    done = subprocess.run([command, "+%s.%N"], capture_output=True, text=True, timeout=10, check=True)
    return float(done.stdout.strip())


def inspect(request: dict[str, Any], held: list[socket.socket]) -> dict[str, Any]:
    """Every check of this host that needs no other host."""
    commands = request.get("commands") or {}
    report: dict[str, Any] = {
        "python": {"executable": sys.executable, "version": platform.python_version(),
                   "fallback": bool(request.get("fallback"))},
        "platform": {"system": platform.system(), "machine": platform.machine(),
                     "libc": "-".join(platform.libc_ver())},
        "versions": _versions(request.get("packages") or []),
        "tools": {name: shutil.which(name) is not None for name in ("rsync", "tar")},
    }
    if request.get("base_python"):
        report["base_python"] = os.path.exists(request["base_python"])
    if request.get("model"):
        report["model"] = _model(request["model"])
    if request.get("device") == "cuda":
        report["gpus"] = _gpus(commands.get("nvidia-smi", "nvidia-smi"))
    report["cpus"] = _cpus()
    if request.get("address") is not None:
        report["address"] = _address(request["address"])
    if request.get("interfaces"):
        report["interfaces"] = _interfaces(request["interfaces"])
    if request.get("disk"):
        report["disk"] = _disk(request["disk"])
    report["local_port_range"] = _local_port_range()
    report["ports"] = _ports(request.get("bind") or [], held)
    return report


def main(argv: list[str]) -> int:
    request = json.loads(argv[0])
    if len(argv) > 1 and argv[1] == "fallback":
        request["fallback"] = True
    held: list[socket.socket] = []
    try:
        print(READY, json.dumps(inspect(request, held)), flush=True)
        if not request.get("interactive"):
            return 0
        line = sys.stdin.readline()
        if not line.startswith("GO"):
            return 0
        print(CLOCK, repr(_clock((request.get("commands") or {}).get("date", "date"))), flush=True)
        targets = json.loads(line[2:].strip() or "[]")
        print(DONE, json.dumps({"connect": _connect(targets)}), flush=True)
        sys.stdin.read()  # hold the listeners until the caller is done with every host
    finally:
        for sock in held:
            sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

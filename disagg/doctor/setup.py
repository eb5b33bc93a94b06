"""``disagg setup``: bring each remote host of a topology to what ``disagg doctor`` wants.

For every remote host, after one agent run to see it (:mod:`disagg.doctor.agents`):

- the venv: when the host's Python is missing or its packages differ from this machine's, this
  machine's venv is copied to the host's ``venv`` path, provided the host has this machine's OS
  and architecture and the base interpreter the venv links to; otherwise the exact install
  command is printed instead. Scripts in the venv's ``bin/`` that name its old path are rewritten
  for the new one.
- the model: unless the host's copy has this machine's fingerprint, this machine's model
  directory is copied to the host's model path.

Copies go with rsync over the host's ssh line when both ends have rsync, else as a tar stream over
the same ssh (said once). Both resume: rsync by itself, tar by sending only the files whose size
or mtime differ from the host's. Progress lines come every :data:`PROGRESS_EVERY_S` seconds.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from disagg.deployment import Deployment
from disagg.doctor.agents import AgentRun, run_agents
from disagg.doctor.plan import Participant, hf_id, packages, participants
from disagg.errors import LaunchError
from disagg.ssh import ssh_prefix
from disagg.topology import HostSpec
from disagg.units import fmt_bytes

PROGRESS_EVERY_S = 2.0
#: a venv's bin/ files up to this size are searched for the venv's old path
SCRIPT_LIMIT = 1 << 20

Say = Callable[[str], None]


class SetupError(LaunchError):
    """A copy to a host failed (ssh, tar or rsync said why)."""


@dataclass(frozen=True)
class LocalVenv:
    """This machine's venv: its directory, base interpreter and platform."""

    path: Path
    base_python: str | None       # what bin/python links to (must exist on the host too)
    editable: list[str]           # editable installs (their sources stay on this machine)


def local_venv(path: str | None) -> LocalVenv:
    """The venv to copy: ``path``, else the one running disagg (``sys.prefix``)."""
    root = Path(path or sys.prefix).resolve()
    if not (root / "pyvenv.cfg").is_file():
        raise LaunchError(f"{root} is not a virtual environment (no pyvenv.cfg); give one with --venv")
    python = root / "bin" / "python"
    base = os.path.realpath(python) if python.is_symlink() else None
    editable = sorted(p.name for p in root.glob("lib/python*/site-packages/__editable__*.pth"))
    return LocalVenv(path=root, base_python=base, editable=editable)


def _source_venv(dep: Deployment, given: str | None) -> str | None:
    """``--venv``, else the venv of a local topology host, else None (``sys.prefix``)."""
    if given:
        return given
    return next((h.venv for h in dep.topology.hosts.values() if not h.is_remote and h.venv), None)


def install_command(host: HostSpec, versions: dict[str, str | None]) -> str:
    """The exact command that installs the same packages on ``host`` (when the venv cannot be copied)."""
    venv = host.venv or "~/.venv-disagg"
    pins = [f"{name}=={version}" for name, version in versions.items() if version and name != "disagg"]
    install = f"{shlex.quote(venv)}/bin/pip install {' '.join(shlex.quote(p) for p in pins)}".rstrip()
    remote = f"python3 -m venv {shlex.quote(venv)} && {install} && {shlex.quote(venv)}/bin/pip install disagg"
    return " ".join(shlex.quote(a) for a in ssh_prefix(host)) + " " + shlex.quote(remote)


# -- copying ---------------------------------------------------------------------


def _manifest(run: AgentRun, dest: str) -> dict[str, list[int]]:
    """relative path -> [size, mtime] of every file and link under ``dest`` on the host."""
    assert run.part.host is not None and run.ready is not None
    python = run.ready["python"]["executable"]
    script = ("import json,os,sys\nd=os.path.expanduser(sys.argv[1]);out={}\n"
              "for r,ds,fs in os.walk(d):\n"
              " for n in fs+[x for x in ds if os.path.islink(os.path.join(r,x))]:\n"
              "  p=os.path.join(r,n);s=os.lstat(p);out[os.path.relpath(p,d)]=[s.st_size,int(s.st_mtime)]\n"
              "print(json.dumps(out))\n")
    done = subprocess.run([*ssh_prefix(run.part.host), f"{shlex.quote(python)} -c {shlex.quote(script)} "
                           f"{shlex.quote(dest)}"], capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise SetupError(f"{run.part.name}: could not list {dest}: {done.stderr.strip()[-300:]}")
    result: dict[str, list[int]] = json.loads(done.stdout)
    return result


def _walk(src: Path) -> Iterator[Path]:
    for root, dirs, files in os.walk(src):
        dirs.sort()
        base = Path(root)
        for name in sorted(files):
            yield base / name
        for name in dirs:
            if (base / name).is_symlink():
                yield base / name


class _Counting(io.RawIOBase):
    """A write-only stream that counts bytes into the ssh process and reports progress."""

    def __init__(self, out: IO[bytes], total: int, what: str, say: Say) -> None:
        self.out, self.total, self.what, self.say = out, total, what, say
        self.sent, self.started, self.last = 0, time.monotonic(), time.monotonic()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.out.write(data)
        self.sent += len(data)
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            rate = self.sent / max(now - self.started, 1e-6)
            self.say(f"  {self.what}: {fmt_bytes(self.sent)} of {fmt_bytes(self.total)} "
                     f"({min(100.0, 100 * self.sent / max(self.total, 1)):.0f}%, {fmt_bytes(rate)}/s)")
        return len(data)


def _rewrite(rel: str, data: bytes, rewrite: tuple[str, str] | None) -> bytes:
    if rewrite is None or not rel.startswith("bin/") or len(data) > SCRIPT_LIMIT:
        return data
    old, new = rewrite
    return data.replace(old.encode(), new.encode())


def copy_tar(run: AgentRun, src: Path, dest: str, what: str, say: Say, *,
             rewrite: tuple[str, str] | None = None) -> int:
    """Send the files of ``src`` that ``dest`` on the host lacks (or has at another size or mtime) as
    one tar stream over ssh; returns how many were sent."""
    assert run.part.host is not None
    have = _manifest(run, dest)
    todo: list[tuple[Path, str, bytes | None]] = []
    total = count = 0
    for path in _walk(src):
        rel = str(path.relative_to(src))
        st = path.lstat()
        data = None
        size = st.st_size
        if path.is_symlink():
            size = len(os.readlink(path))
        elif rewrite is not None and rel.startswith("bin/") and size <= SCRIPT_LIMIT:
            data = _rewrite(rel, path.read_bytes(), rewrite)
            size = len(data)
        count += 1
        got = have.get(rel)
        if got is not None and (path.is_symlink() or (got[0] == size and got[1] == int(st.st_mtime))):
            continue
        todo.append((path, rel, data))
        total += size
    if not todo:
        say(f"  {what}: all {count} files already in {run.part.name}:{dest}")
        return 0
    say(f"  {what}: sending {len(todo)} of {count} files ({fmt_bytes(total)}) to {run.part.name}:{dest}")
    remote = f"mkdir -p {shlex.quote(dest)} && tar -x -f - -C {shlex.quote(dest)}"
    proc = subprocess.Popen([*ssh_prefix(run.part.host), remote], stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdin is not None
    try:
        with tarfile.open(fileobj=_Counting(proc.stdin, total, what, say), mode="w|") as tar:
            for path, rel, data in todo:
                info = tar.gettarinfo(str(path), arcname=rel)
                if data is not None:
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                elif info.isreg():
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    err = ""
    if proc.stderr is not None:
        err = proc.stderr.read().decode(errors="replace")
        proc.stderr.close()
    if proc.wait() != 0:
        raise SetupError(f"{run.part.name}: copying {what} to {dest} failed: {err.strip()[-400:]}")
    return len(todo)


def copy_rsync(host: HostSpec, src: Path, dest: str, what: str, say: Say) -> None:
    """``rsync -a --partial`` over the host's ssh line (rsync resumes by itself)."""
    prefix = ssh_prefix(host)
    argv = ["rsync", "-a", "--partial", "--info=progress2", "-e", shlex.join(prefix[:-1]),
            f"{src}/", f"{host.ssh}:{dest}/"]
    say(f"  {what}: rsync to {host.name}:{dest}")
    mkdir = subprocess.run([*prefix, f"mkdir -p {shlex.quote(dest)}"], capture_output=True, text=True, check=False)
    if mkdir.returncode != 0:
        raise SetupError(f"{host.name}: mkdir {dest} failed: {mkdir.stderr.strip()[-300:]}")
    if subprocess.run(argv, check=False).returncode != 0:
        raise SetupError(f"{host.name}: rsync of {what} to {dest} failed (run `disagg setup` again to resume)")


def copy_tree(run: AgentRun, src: Path, dest: str, what: str, say: Say, *,
              rewrite: tuple[str, str] | None = None) -> None:
    """rsync when this machine and the host both have it (and nothing needs rewriting), else tar."""
    assert run.part.host is not None and run.ready is not None
    if rewrite is None and shutil.which("rsync") and run.ready["tools"].get("rsync"):
        copy_rsync(run.part.host, src, dest, what, say)
        return
    where = "this machine" if not shutil.which("rsync") else run.part.name
    why = "the venv's scripts are rewritten on the way" if rewrite is not None else f"no rsync on {where}"
    say(f"  {what}: tar over ssh ({why}; resumes file by file)")
    copy_tar(run, src, dest, what, say, rewrite=rewrite)


# -- the steps ---------------------------------------------------------------------


def _setup_venv(run: AgentRun, venv: LocalVenv, mine: dict[str, str | None], say: Say) -> bool:
    """The host's venv: in place, copied, or the install command printed (returns False then)."""
    host = run.part.host
    assert host is not None and run.ready is not None
    theirs = run.ready["versions"]
    if not run.ready["python"]["fallback"] and all(theirs.get(k) == v for k, v in mine.items()):
        say(f"  venv: in place ({run.part.python}; same versions as this machine)")
        return True
    if not host.venv:
        say(f"  venv: the host gives python ({run.part.python}), not venv: nothing to copy to; install there:")
        say("    " + install_command(host, mine))
        return False
    here = (os.uname().sysname, os.uname().machine)
    there = (run.ready["platform"]["system"], run.ready["platform"]["machine"])
    if here != there or not run.ready.get("base_python"):
        why = (f"it runs {there[0]} {there[1]}, this machine {here[0]} {here[1]}" if here != there
               else f"it lacks the venv's base interpreter {venv.base_python}")
        say(f"  venv: cannot copy this machine's venv ({why}); install there:")
        say("    " + install_command(host, mine))
        return False
    if venv.editable:
        say(f"  venv: note: {', '.join(venv.editable)} are editable installs; the copy finds their "
            "sources only where this machine keeps them")
    copy_tree(run, venv.path, host.venv, "venv", say, rewrite=(str(venv.path), host.venv))
    return True


def _setup_model(run: AgentRun, dep: Deployment, fingerprint: str | None, say: Say) -> None:
    host = run.part.host
    assert host is not None and run.ready is not None
    topo = dep.topology
    if hf_id(topo, host):
        say(f"  model: {topo.model.path} is a Hugging Face id; the engine downloads it on first start")
        return
    dest = topo.model_path(host)
    got = run.ready.get("model") or {}
    if got.get("ok") and fingerprint is not None and got.get("fingerprint") == fingerprint:
        say(f"  model: in place at {dest} ({fingerprint})")
        return
    source = Path(topo.model.path)
    if not source.is_dir():     # a Hugging Face id here, a directory of its own on that host
        say(f"  model: {topo.model.path} is no directory on this machine to copy; on {host.name} run: "
            f"hf download {topo.model.path} --local-dir {dest}")
        return
    copy_tree(run, source, dest, "model", say)


def run_setup(dep: Deployment, *, venv: str | None = None, say: Say = print,
              timeout: float | None = None) -> bool:
    """Set up every remote host; True when each has what it needs (False: a command to run was printed)."""
    topo = dep.topology
    if topo.model.embedded:
        from disagg.modelgen import ensure_model
        ensure_model(topo.model.embedded, topo.model.path)
    source = local_venv(_source_venv(dep, venv))
    local = Participant(name="this machine", host=None, python=str(source.path / "bin" / "python"),
                        runs_engines=True, runs_proxy=False)
    parts = [p for p in participants(dep, cheap=True) if p.is_remote and p.runs_engines]
    if not parts:
        say("no remote engine host: nothing to set up")
        return True
    local.request = {"packages": packages(topo),
                     "model": {"path": topo.model.path,
                               "hf_id": topo.model.embedded is None and not topo.model.path.startswith("/")}}
    for part in parts:
        part.request["base_python"] = source.base_python
    runs = run_agents([local, *parts], [], timeout=timeout if timeout is not None else topo.timeouts.ssh_command)
    here = runs.pop(local.name)
    if here.ready is None:
        raise SetupError(f"cannot read this machine's venv {source.path}: {here.error}")
    mine = here.ready["versions"]
    fingerprint = (here.ready.get("model") or {}).get("fingerprint")
    complete = True
    for run in runs.values():
        say(f"{run.part.name} ({run.part.host.ssh if run.part.host else ''}):")
        if run.ready is None:
            say(f"  cannot reach it: {run.error}")
            complete = False
            continue
        complete = _setup_venv(run, source, mine, say) and complete
        _setup_model(run, dep, fingerprint, say)
    return complete

"""Starting and stopping engine processes, locally or over SSH.

A process is started in a new session (its own process group), so stopping it
stops every worker it spawned: SIGTERM to the group, a grace period, then
SIGKILL. Remote processes are started with ``setsid`` through OpenSSH in
BatchMode (keys only, never a password) and stopped the same way on the
remote host.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import psutil

from disagg.errors import RemoteCommandError
from disagg.launch.state import ProcessRecord
from disagg.topology import HostSpec

LOG_TAIL_LINES = 30


def ssh_prefix(host: HostSpec) -> list[str]:
    """The ``ssh ...`` argv that runs a command on ``host``."""
    assert host.ssh is not None
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
            "-o", "StrictHostKeyChecking=accept-new", "-o", "LogLevel=ERROR"]
    if host.ssh_port:
        argv += ["-p", str(host.ssh_port)]
    if host.ssh_key:
        argv += ["-i", os.path.expanduser(host.ssh_key)]
    for option in host.ssh_options:
        argv += ["-o", option]
    return [*argv, host.ssh]


def run_remote(prefix: list[str], command: str, *, timeout: float = 60.0, stdin_text: str | None = None) -> str:
    """Run a shell command over SSH (``stdin_text`` on its stdin); return stdout or raise RemoteCommandError."""
    try:
        stdin = {"input": stdin_text} if stdin_text is not None else {"stdin": subprocess.DEVNULL}
        done = subprocess.run([*prefix, command], capture_output=True, text=True, timeout=timeout, **stdin)
    except subprocess.TimeoutExpired as exc:
        raise RemoteCommandError(f"{prefix[-1]}: command timed out after {timeout:.0f} s: {command}") from exc
    except OSError as exc:
        raise RemoteCommandError(f"cannot run ssh: {exc.strerror or exc}") from exc
    if done.returncode != 0:
        raise RemoteCommandError(f"{prefix[-1]}: `{command}` failed (exit {done.returncode}): "
                                 f"{done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def start_local(argv: list[str] | tuple[str, ...], env: dict[str, str], log: Path) -> tuple[int, float]:
    """Start ``argv`` in its own session with output to ``log``; return (pid, create_time)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **env}
    with open(log, "ab") as out:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=full_env, start_new_session=True, close_fds=True)
    try:
        created = psutil.Process(proc.pid).create_time()
    except psutil.Error:
        created = 0.0
    return proc.pid, created


def start_remote(host: HostSpec, command: str, log: str, secret_env: Mapping[str, str] | None = None) -> int:
    """Start a shell ``command`` on ``host`` under setsid, output to ``log``; return its pid (= pgid).

    ``secret_env`` variables reach the command's environment through ssh's
    stdin (one ``read`` per variable), never through a command line that the
    remote ``ps`` or shell history could show.
    """
    log_dir = os.path.dirname(log) or "."
    secrets = sorted((secret_env or {}).items())
    for name, value in secrets:
        if not name.isidentifier() or "\n" in value:
            raise ValueError(f"secret variable {name!r}: needs an identifier name and a one-line value")
    reads = "".join(f"IFS= read -r {name} || exit 1; export {name}; " for name, _ in secrets)
    # `mkdir ... || exit` first: a list before `&` would be backgrounded whole and keep the ssh channel open.
    script = (f"mkdir -p {shlex.quote(log_dir)} || exit 1; {reads}"
              f"setsid sh -c {shlex.quote(f'exec {command}')} >>{shlex.quote(log)} 2>&1 </dev/null & echo $!")
    stdin_text = "".join(f"{value}\n" for _, value in secrets) if secrets else None
    out = run_remote(ssh_prefix(host), script, stdin_text=stdin_text).strip()
    try:
        return int(out.splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise RemoteCommandError(f"{host.ssh}: could not read the pid of the started engine: {out!r}") from exc


def _local_process(rec: ProcessRecord) -> psutil.Process | None:
    try:
        proc = psutil.Process(rec.pid)
        if rec.create_time and abs(proc.create_time() - rec.create_time) > 1.0:
            return None  # the pid was reused by an unrelated process
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def is_alive(rec: ProcessRecord) -> bool:
    """True while the recorded process (local or remote) still runs."""
    if rec.ssh:
        try:
            run_remote(rec.ssh, f"kill -0 {rec.pid}", timeout=20)
            return True
        except RemoteCommandError:
            return False
    return _local_process(rec) is not None


def exit_status(pid: int) -> int | None:
    """Reap a local child if it has exited; its exit status, else None."""
    try:
        waited, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    if waited == 0:
        return None
    return os.waitstatus_to_exitcode(status)


def _group_members(rec: ProcessRecord) -> list[psutil.Process]:
    """The process, its descendants and everything else in its process group."""
    root = _local_process(rec)
    members: dict[int, psutil.Process] = {}
    if root is not None:
        members[root.pid] = root
        for child in root.children(recursive=True):
            members[child.pid] = child
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == rec.pid:
                members[proc.pid] = proc
        except (OSError, psutil.Error):
            continue
    return list(members.values())


def stop_local(rec: ProcessRecord, grace: float) -> None:
    """SIGTERM the process group, wait up to ``grace`` s, then SIGKILL what is left."""
    members = _group_members(rec)
    if not members:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(rec.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for proc in members:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(members, timeout=grace if sig == signal.SIGTERM else 10)
        for proc in members:
            exit_status(proc.pid)  # reap our own children
        if not alive:
            return
        members = alive


def stop_remote(rec: ProcessRecord, grace: float) -> None:
    """Stop a remote process group: TERM, wait, KILL (all on the remote host)."""
    assert rec.ssh is not None
    pgid = rec.pid
    script = (f"kill -TERM -- -{pgid} 2>/dev/null; "
              f"for i in $(seq {max(1, int(grace * 2))}); do kill -0 -- -{pgid} 2>/dev/null || exit 0; "
              f"sleep 0.5; done; kill -KILL -- -{pgid} 2>/dev/null; exit 0")
    run_remote(rec.ssh, script, timeout=grace + 30)


def stop_process(rec: ProcessRecord, grace: float) -> None:
    """Stop a recorded process wherever it runs."""
    if rec.ssh:
        stop_remote(rec, grace)
    else:
        stop_local(rec, grace)


def log_tail(rec: ProcessRecord, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of the process's log (fetched over SSH for remote ones)."""
    if rec.ssh:
        try:
            return run_remote(rec.ssh, f"tail -n {lines} {shlex.quote(rec.log)}", timeout=20)
        except RemoteCommandError as exc:
            return f"(could not fetch the remote log {rec.log}: {exc})"
    try:
        with open(rec.log, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"(no log at {rec.log}: {exc.strerror})"
    return "\n".join(text.splitlines()[-lines:])


def wait_gone(recs: list[ProcessRecord], timeout: float) -> list[ProcessRecord]:
    """Wait until the records' processes are gone; return those still alive."""
    deadline = time.monotonic() + timeout
    alive = [r for r in recs if is_alive(r)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [r for r in alive if is_alive(r)]
    return alive

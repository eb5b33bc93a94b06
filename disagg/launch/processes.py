"""Starting and stopping engine processes, locally or over SSH.

A process is started in a new session (its own process group), so stopping it
stops every worker it spawned: SIGTERM to the group, a grace period, then
SIGKILL. Remote processes are started with ``setsid`` through OpenSSH in
BatchMode (keys only, never a password) and stopped the same way on the
remote host.

What belongs to an engine is its leader (the recorded pid, paired with its
create time locally), the leader's descendants, and every process whose
process group or session id is the leader's pid, whether the leader still runs
or not: a SIGKILLed vLLM API server leaves its ``EngineCore`` and workers
running in its group. A dead leader's id is safe to use: the kernel does not
hand out a pid again while a process group or session with that id has a
member. Only when the pid is taken by a new process (another create time) is
nothing swept, because by then nothing of the engine's group can be left.

An engine's leader that is the last of its group still running
(:data:`LONE_LEADER_S`) is sent SIGTERM again: vLLM's API server loses a
SIGTERM that arrives while it waits for its EngineCore's handshake (vLLM's
``zmq_socket_ctx`` swallows the ``KeyboardInterrupt`` its start-up handler
raises) and then waits ``VLLM_ENGINE_READY_TIMEOUT_S`` (600 s) for an
EngineCore the same SIGTERM stopped. Once serving, its handler ignores a
repeat. The rest of the group gets one SIGTERM (a second would cut an
EngineCore's teardown short, vLLM restores the default action for it), and so
does the proxy (a second stops its drain).

An SSH failure (ssh's own exit status 255, or no answer in time) is not
evidence that a remote process exited: :func:`liveness` says
``UNREACHABLE`` and stopping raises :class:`HostUnreachableError`.
"""

from __future__ import annotations

import enum
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from disagg.errors import HostUnreachableError, LaunchError, RemoteCommandError
from disagg.launch.state import ProcessRecord
from disagg.ssh import ssh_prefix
from disagg.topology import HostSpec, Timeouts

LOG_TAIL_LINES = 30
#: ssh's own exit status when it fails (connection, authentication), as opposed to the command's
SSH_FAILED = 255
#: how long the last SIGKILL may take to clear a group before stopping reports a failure
KILL_WAIT_S = 10.0
#: SIGTERM -> SIGKILL where nothing is served, so there is nothing to drain: start-up abandoned
#: (Ctrl-C, an engine failed), or a group whose leader has exited (an engine's API server gone:
#: its engine core and workers serve nobody)
ABORT_GRACE_S = 2.0
#: an engine's leader still running this long after every other process of its group that does
#: not ignore SIGTERM has exited gets SIGTERM again (and again each as long): see the module
#: docstring; a process that ignores SIGTERM (multiprocessing's resource tracker) waits for the
#: leader, not the other way round
LONE_LEADER_S = 1.0


class Liveness(enum.Enum):
    """What is left of a recorded process."""

    RUNNING = "running"            # the recorded leader runs
    LEFTOVERS = "leftovers"        # the leader exited; processes of its group or session remain
    GONE = "gone"                  # nothing of it is left
    UNREACHABLE = "unreachable"    # its host did not answer over SSH: unknown


@dataclass(frozen=True)
class StopOutcome:
    """What stopping one recorded process found."""

    leader_running: bool   # the recorded leader itself was still running
    others: int            # further processes of its group, session or descendants that were signalled


def run_remote(prefix: list[str], command: str, *, timeout: float, stdin_text: str | None = None) -> str:
    """Run a shell command over SSH (``stdin_text`` on its stdin); return stdout or raise RemoteCommandError.

    ``timeout``: the topology's ``timeouts.ssh_command`` or ``timeouts.ssh_check``; past it the host
    counts as unreachable (HostUnreachableError)."""
    try:
        stdin = {"input": stdin_text} if stdin_text is not None else {"stdin": subprocess.DEVNULL}
        done = subprocess.run([*prefix, command], capture_output=True, text=True, timeout=timeout, **stdin)
    except subprocess.TimeoutExpired as exc:
        raise HostUnreachableError(f"{prefix[-1]}: no answer within {timeout:g} s") from exc
    except OSError as exc:
        raise RemoteCommandError(f"cannot run ssh: {exc.strerror or exc}") from exc
    if done.returncode == SSH_FAILED:
        raise HostUnreachableError(f"{prefix[-1]}: ssh failed: {done.stderr.strip() or 'exit status 255'}")
    if done.returncode != 0:
        raise RemoteCommandError(f"{prefix[-1]}: `{command}` failed (exit {done.returncode}): "
                                 f"{done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def start_local(argv: list[str] | tuple[str, ...], env: dict[str, str], log: Path) -> tuple[int, float]:
    """Start ``argv`` in its own session with output to ``log``; return (pid, create_time).
    The caller records :func:`start_ticks` of the pid too (what tells it from a recycled pid)."""
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


def start_remote(host: HostSpec, command: str, log: str, secret_env: Mapping[str, str] | None = None, *,
                 ssh_timeout: float = Timeouts.ssh_command) -> int:
    """Start a shell ``command`` on ``host`` under setsid, output to ``log``; return its pid (= pgid).

    ``secret_env`` variables reach the command's environment through ssh's
    stdin (one ``read`` per variable), never through a command line that the
    remote ``ps`` or shell history could show.
    """
    log_dir = os.path.dirname(log) or "."
    secrets = sorted((secret_env or {}).items())
    for name, value in secrets:
        if not name.isidentifier() or "\n" in value:
            raise LaunchError(f"secret variable {name!r}: needs an identifier name and a one-line value")
    reads = "".join(f"IFS= read -r {name} || exit 1; export {name}; " for name, _ in secrets)
    # `mkdir ... || exit` first: a list before `&` would be backgrounded whole and keep the ssh channel open.
    script = (f"mkdir -p {shlex.quote(log_dir)} || exit 1; {reads}"
              f"setsid sh -c {shlex.quote(f'exec {command}')} >>{shlex.quote(log)} 2>&1 </dev/null & echo $!")
    stdin_text = "".join(f"{value}\n" for _, value in secrets) if secrets else None
    out = run_remote(ssh_prefix(host), script, timeout=ssh_timeout, stdin_text=stdin_text).strip()
    try:
        return int(out.splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise RemoteCommandError(f"{host.ssh}: could not read the pid of the started engine: {out!r}") from exc


def start_ticks(pid: int) -> int:
    """When local process ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22);
    0 when it cannot be read (no such process, not Linux).

    Unlike psutil's ``create_time`` (those ticks plus the boot time as the wall clock puts it
    *now*), it never changes during a process's life: a step of the wall clock (NTP, a resumed
    VM) between recording a process and checking it made a live engine look like a recycled
    pid, so ``disagg up`` took it for exited, dropped its record and left it running.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
        return int(text[text.rindex(b")") + 2:].split()[19])   # fields after "pid (comm) ": 3, 4, ...
    except (OSError, ValueError, IndexError):
        return 0


def _same_process(rec: ProcessRecord, proc: psutil.Process) -> bool:
    """Whether ``proc`` (at the recorded pid) is the recorded process, not a recycled pid: by its
    start in ticks since boot when recorded (exact), else by ``create_time`` within 1 s (records
    written before ``start_ticks`` existed)."""
    if rec.start_ticks:
        ticks = start_ticks(proc.pid)
        return ticks in (0, rec.start_ticks)   # 0: gone meanwhile (the caller sees that), not recycled
    return not rec.create_time or abs(proc.create_time() - rec.create_time) <= 1.0


def _local_process(rec: ProcessRecord) -> psutil.Process | None:
    """The recorded leader while it runs (not a zombie, not a recycled pid), else None."""
    try:
        proc = psutil.Process(rec.pid)
        if not _same_process(rec, proc):
            return None  # the pid was reused by an unrelated process
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def _pid_recycled(rec: ProcessRecord) -> bool:
    """True when the recorded pid now belongs to a process started at another time."""
    if not (rec.start_ticks or rec.create_time):
        return False
    try:
        return not _same_process(rec, psutil.Process(rec.pid))
    except psutil.Error:
        return False


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _ourselves() -> set[int]:
    """This process and its ancestors: never signalled, whatever a state file says."""
    own = {os.getpid()}
    try:
        own.update(p.pid for p in psutil.Process().parents())
    except psutil.Error:
        pass
    return own


def local_members(rec: ProcessRecord) -> tuple[bool, list[psutil.Process]]:
    """(leader running, every live process of the recorded engine).

    The members are the leader while it runs, its descendants, and every
    process whose process group or session id is the recorded pid, plus their
    descendants: that is what a SIGKILLed leader leaves behind. Empty when the
    pid was recycled (see the module docstring) or names this very process.
    """
    own = _ourselves()
    if _pid_recycled(rec) or rec.pid in own or rec.pid in (os.getpgrp(), os.getsid(0)):
        return False, []
    members: dict[int, psutil.Process] = {}

    def add(proc: psutil.Process) -> None:
        if proc.pid in own or proc.pid in members or not _running(proc):
            return
        members[proc.pid] = proc
        try:
            for child in proc.children(recursive=True):
                if child.pid not in own and _running(child):
                    members.setdefault(child.pid, child)
        except psutil.Error:
            pass

    leader = _local_process(rec)
    if leader is not None:
        add(leader)
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == rec.pid or os.getsid(proc.pid) == rec.pid:
                add(proc)
        except (OSError, psutil.Error):
            continue
    return leader is not None, list(members.values())


def _remote_members(pid: int) -> str:
    """Shell functions: ``m`` prints the live (not zombie) pids whose process group or session is
    ``pid``; ``l`` succeeds while ``pid`` itself runs (procps ``ps``)."""
    return (f"m() {{ ps -e -o pid= -o pgid= -o sid= -o stat= 2>/dev/null | "
            f"awk -v p={pid} '($2==p||$3==p) && $4 !~ /^Z/ {{print $1}}'; }}; "
            f"l() {{ if command -v ps >/dev/null 2>&1; then s=$(ps -o stat= -p {pid} 2>/dev/null); "
            f"[ -n \"$s\" ] && [ \"${{s#Z}}\" = \"$s\" ]; else kill -0 {pid} 2>/dev/null; fi; }}; ")


def _remote_liveness(pid: int) -> str:
    return (_remote_members(pid) + "if l; then echo disagg-liveness running; "
            "elif [ -n \"$(m)\" ]; then echo disagg-liveness leftovers; else echo disagg-liveness gone; fi")


def liveness(rec: ProcessRecord, *, ssh_timeout: float = Timeouts.ssh_check) -> Liveness:
    """What is left of a recorded process, locally or over SSH (one ssh call)."""
    if rec.ssh:
        try:
            out = run_remote(rec.ssh, _remote_liveness(int(rec.pid)), timeout=ssh_timeout)
        except RemoteCommandError:
            return Liveness.UNREACHABLE
        words = [line.split()[-1] for line in out.splitlines() if line.startswith("disagg-liveness ")]
        return Liveness(words[-1]) if words else Liveness.UNREACHABLE
    leader_running, members = local_members(rec)
    if leader_running:
        return Liveness.RUNNING
    return Liveness.LEFTOVERS if members else Liveness.GONE


def is_alive(rec: ProcessRecord, *, ssh_timeout: float = Timeouts.ssh_check) -> bool:
    """False only once the recorded leader is known to have exited.

    Local: the leader runs (cheap: no sweep). Remote: the same over SSH (a
    zombie is not running); a host that does not answer counts as alive, since
    an outage is no proof that the engine exited (:func:`liveness` tells the
    two apart).
    """
    if rec.ssh:
        try:
            run_remote(rec.ssh, _remote_members(int(rec.pid)) + "l", timeout=ssh_timeout)
            return True
        except HostUnreachableError:
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


def _in_group(pid: int, pgid: int) -> bool:
    try:
        return os.getpgid(pid) == pgid
    except OSError:
        return False


def _signal_members(rec: ProcessRecord, members: list[psutil.Process], sig: signal.Signals) -> None:
    """``sig`` once to each member: to the group, then to each member outside it. A second SIGTERM
    means more than the first (the proxy stops draining), so none gets two."""
    grouped = False
    if rec.pid not in _ourselves() and rec.pid not in (os.getpgrp(), os.getsid(0)):
        try:
            os.killpg(rec.pid, sig)  # works while the group has members, leader or not
            grouped = True
        except (ProcessLookupError, PermissionError):
            pass
    for proc in members:
        if grouped and _in_group(proc.pid, rec.pid):
            continue
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass


def ignores_sigterm(pid: int) -> bool:
    """Whether local process ``pid`` ignores SIGTERM (``SigIgn`` in ``/proc/PID/status``); False
    when that cannot be read."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            mask = next((line.split(":", 1)[1] for line in status if line.startswith("SigIgn:")), "0")
        return bool(int(mask.strip(), 16) & (1 << (signal.SIGTERM - 1)))
    except (OSError, ValueError):
        return False


class _LoneLeader:
    """Sends an engine's leader SIGTERM again while it outlives the rest of its group (see
    :data:`LONE_LEADER_S`); ``_wait_members`` calls it with what is still alive."""

    def __init__(self, rec: ProcessRecord) -> None:
        self.rec = rec
        self.since: float | None = None   # when the leader was first seen alone, since the last SIGTERM

    def __call__(self, alive: list[psutil.Process]) -> None:
        leader = next((p for p in alive if p.pid == self.rec.pid), None)
        if leader is None or any(p.pid != self.rec.pid and not ignores_sigterm(p.pid) for p in alive):
            self.since = None
            return
        now = time.monotonic()
        if self.since is None:
            self.since = now
        elif now - self.since >= LONE_LEADER_S:
            try:
                leader.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
            self.since = now


def _wait_members(members: list[psutil.Process], timeout: float,
                  hurry: Callable[[], bool] | None = None,
                  each: Callable[[list[psutil.Process]], None] | None = None) -> list[psutil.Process]:
    """Wait until the members are gone (reaping our own children); those still alive.
    ``each`` is shown what is alive at every look (20 a second)."""
    deadline = time.monotonic() + timeout
    while True:
        for proc in members:
            exit_status(proc.pid)
        alive = [p for p in members if _running(p)]
        if not alive or time.monotonic() >= deadline or (hurry is not None and hurry()):
            return alive
        if each is not None:
            each(alive)
        time.sleep(0.05)


def terminate_local(rec: ProcessRecord) -> tuple[StopOutcome, list[psutil.Process]]:
    """SIGTERM everything of a local engine (see :func:`local_members`); what was found and signalled."""
    leader_running, members = local_members(rec)
    if members:
        _signal_members(rec, members, signal.SIGTERM)
    return StopOutcome(leader_running, len(members) - int(leader_running)), members


def kill_local(rec: ProcessRecord, members: list[psutil.Process]) -> None:
    """SIGKILL what is left of a local engine (a fresh sweep plus ``members``); LaunchError if it stays."""
    _, fresh = local_members(rec)
    left = {p.pid: p for p in [*members, *fresh] if _running(p)}
    if not left:
        return
    _signal_members(rec, list(left.values()), signal.SIGKILL)
    alive = _wait_members(list(left.values()), KILL_WAIT_S)
    if alive:
        raise LaunchError(f"{rec.name}: still running {KILL_WAIT_S:.0f} s after SIGKILL: pids "
                          + ", ".join(str(p.pid) for p in alive))


def stop_local(rec: ProcessRecord, grace: float, hurry: Callable[[], bool] | None = None) -> StopOutcome:
    """SIGTERM the engine's group, session and descendants, wait up to ``grace`` s (at most
    :data:`ABORT_GRACE_S` when its leader has exited already; less once ``hurry()`` is true),
    then SIGKILL what is left. An engine's leader left alone gets SIGTERM again
    (:data:`LONE_LEADER_S`)."""
    outcome, members = terminate_local(rec)
    if members:
        wait = grace if outcome.leader_running else min(grace, ABORT_GRACE_S)
        nudge = _LoneLeader(rec) if outcome.leader_running and rec.kind == "engine" else None
        kill_local(rec, _wait_members(members, wait, hurry, nudge))
    return outcome


def _remote_signal(pid: int, sig: str) -> str:
    """``sig`` to the group, then to each member outside it, or to each member when the group
    signal failed (see :func:`_signal_members`). ``kill -s SIG -- -PGID``: dash's ``kill`` takes
    ``--`` only after ``-s``."""
    return (f"if kill -s {sig} -- -{pid} 2>/dev/null; then g={pid}; else g=; fi; for q in $(m); do "
            f"[ \"$(ps -o pgid= -p $q 2>/dev/null | tr -d ' ')\" = \"$g\" ] || kill -s {sig} $q 2>/dev/null; done; ")


def _remote_others(pid: int) -> str:
    """Shell function ``o``: how many members other than ``pid`` do not ignore SIGTERM (``SigIgn``
    in ``/proc/PID/status``, its last 4 hex digits; one that cannot be read counts)."""
    return (f"o() {{ n=0; for q in $(m); do [ \"$q\" = {pid} ] && continue; "
            "z=$(sed -n 's/^SigIgn:[[:space:]]*//p' /proc/$q/status 2>/dev/null); y=${z#\"${z%????}\"}; "
            "if [ -n \"$y\" ] && [ $((0x$y & 16384)) -ne 0 ]; then continue; fi; n=$((n+1)); done; echo $n; }; ")


def _remote_stop(pid: int, grace: float, lone: bool = False) -> str:
    """TERM the group and session, wait up to ``grace``, KILL, wait; print ``disagg-stop LEADER FOUND LEFT``.
    ``lone``: a leader left alone for :data:`LONE_LEADER_S` gets TERM again, as locally."""
    ticks = max(1, int(grace * 5))
    wait = 'i=0; while [ -n "$(m)" ] && [ $i -lt {n} ]; do sleep 0.2; i=$((i+1)); {each}done; '
    nudge = (f'if l && [ "$(o)" = 0 ]; then a=$((a+1)); '
             f'if [ $a -ge {max(1, round(LONE_LEADER_S * 5))} ]; then kill -s TERM {pid} 2>/dev/null; a=0; fi; '
             'else a=0; fi; ')
    return (_remote_members(pid) + (_remote_others(pid) + "a=0; " if lone else "")
            + "if l; then L=1; else L=0; fi; C=$(m | wc -l); "
            + _remote_signal(pid, "TERM") + wait.format(n=ticks, each=nudge if lone else "")
            + _remote_signal(pid, "KILL") + wait.format(n=50, each="") + "echo disagg-stop $L $C $(m | wc -l)")


def _remote_kill(pid: int) -> str:
    return _remote_members(pid) + _remote_signal(pid, "KILL") + "echo disagg-killed"


def stop_remote(rec: ProcessRecord, grace: float, hurry: Callable[[], bool] | None = None, *,
                ssh_timeout: float = Timeouts.ssh_check) -> StopOutcome:
    """Stop a remote engine on its host: TERM its group and session, wait (TERM again to a leader
    left alone, see :data:`LONE_LEADER_S`), KILL (one ssh call).

    Once ``hurry()`` is true a second ssh call (limit ``ssh_timeout``) SIGKILLs at once. Raises
    :class:`HostUnreachableError` when ssh cannot reach the host, and
    LaunchError when something is still running there after SIGKILL.
    """
    assert rec.ssh is not None
    script = _remote_stop(int(rec.pid), grace, lone=rec.kind == "engine")
    timeout = grace + 40
    try:
        proc = subprocess.Popen([*rec.ssh, script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        raise RemoteCommandError(f"cannot run ssh: {exc.strerror or exc}") from exc
    deadline, hurried = time.monotonic() + timeout, False
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise HostUnreachableError(f"{rec.ssh[-1]}: no answer within {timeout:.0f} s")
        if hurry is not None and not hurried and hurry():
            hurried = True
            try:
                run_remote(rec.ssh, _remote_kill(int(rec.pid)), timeout=ssh_timeout)
            except RemoteCommandError:
                pass  # the first call reports
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode == SSH_FAILED:
        raise HostUnreachableError(f"{rec.ssh[-1]}: ssh failed: {err.strip() or 'exit status 255'}")
    words = next((line.split() for line in out.splitlines() if line.startswith("disagg-stop ")), None)
    if proc.returncode != 0 or words is None or len(words) != 4:
        raise RemoteCommandError(f"{rec.ssh[-1]}: stopping pid {rec.pid} failed (exit {proc.returncode}): "
                                 f"{err.strip() or out.strip()}")
    leader, found, left = (int(w) for w in words[1:])
    if left:
        raise LaunchError(f"{rec.name}: {left} processes of group {rec.pid} still run on {rec.ssh[-1]} "
                          "after SIGKILL")
    return StopOutcome(bool(leader), max(0, found - leader))


def stop_process(rec: ProcessRecord, grace: float, hurry: Callable[[], bool] | None = None, *,
                 ssh_timeout: float = Timeouts.ssh_check) -> StopOutcome:
    """Stop a recorded process wherever it runs, whatever state its leader is in."""
    if rec.ssh:
        return stop_remote(rec, grace, hurry, ssh_timeout=ssh_timeout)
    return stop_local(rec, grace, hurry)


def log_tail(rec: ProcessRecord, lines: int = LOG_TAIL_LINES, *, ssh_timeout: float = Timeouts.ssh_check) -> str:
    """The last ``lines`` lines of the process's log (fetched over SSH for remote ones)."""
    if rec.ssh:
        try:
            return run_remote(rec.ssh, f"tail -n {lines} {shlex.quote(rec.log)}", timeout=ssh_timeout)
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

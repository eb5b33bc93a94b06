"""Fault figures of a 1P1D deployment with real vLLM engines.

For each connector (NIXL over loopback TCP, and our socket connector) this
brings up a 1 prefill + 1 decode pair of real vLLM CPU engines on the tiny
random-weight model with ``disagg up --detach`` (one pinned core per engine,
the topology's default restart policy: on-failure, 5 in 10 min; routing
``split``, so that every prompt goes through the KV handoff), injects
faults, and measures what clients and the engines' own metrics see:

(a) the prefill API server (its leader pid in state.json) SIGKILLed while 40
    requests arrive at 2 req/s: how many were answered / errored / hung, how
    long until prefill was back, and whether the proxy served disaggregated
    requests again afterwards (``disagg_proxy_requests{path="split"}``);
(b) the decode API server SIGKILLed while streaming clients read: the longest
    time from the kill to a client's error event or closed stream, the time
    until decode was back, later requests served, and whether anything of
    the old decode's process group / session was left;
(c) 100 streaming clients disconnecting at random points (during prefill,
    around the KV handoff, mid-stream; planned from a calibration request's
    measured prefill and handoff times), 10 at a time: the time from the last
    disconnect until both engines report 0 running and 0 waiting requests
    (``vllm:num_requests_running`` / ``vllm:num_requests_waiting``), and until
    P's ``vllm:kv_cache_usage_perc`` is back to 0 (KV held for abandoned
    handoffs; the connector's lease is 30 s unless configured otherwise), with
    P's expired-lease counter;
(d) soak: 1,000 requests of mixed shapes (completions / chat, stream /
    non-stream, batched prompts, n=2) at concurrency 8: errors, and the
    proxy's RSS (psutil) at the end against its value after the first 100;
(e) on a fresh deployment, the prefill engine SIGKILLed 5 times in a row, each
    time once it is back (time until the proxy serves a request through it
    again), then a sixth time: whether state.json / ``disagg status`` report
    it failed instead of restarting it again (prefill, so that the run goes
    on and can be asked: a decode engine that fails for good stops the run).

Scenarios (c), (d), (a), (b) share one deployment per connector (in that
order, so (c) and (d) run before any restart); (e) gets its own. Every
deployment is stopped with ``disagg down`` whatever happens, and afterwards no
engine or proxy process of the run may be left. The machine-wide engine lock
(``/tmp/disagg-engines.lock``, as the e2e tests' ``engine_lock``) is held
while engines run, so at most two engines run at once.

    .venv/bin/python benchmarks/faults.py --connector nixl|socket|both [--scenarios a,b,c,d,e]
        [--soak-requests 1000] [--seed 14] [--out results.md]

Prints one Markdown table per connector with the load average beside it;
docs/reliability.md has the figures measured on the project's machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from disagg import topology
from disagg.deployment import build_deployment
from disagg.modelgen import build_model
from disagg.prometheus_text import sample_sum
from disagg.prompts import exact_prompt, load_tokenizer
from disagg.topology import load_topology

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: harness
from harness.engines import ENGINE_ARGS, ENGINE_ENV, engine_processes, free_ports, write_topology

ROOT = Path(__file__).resolve().parents[1]
LOCK_PATH = os.environ.get("DISAGG_ENGINE_LOCK", "/tmp/disagg-engines.lock")
MODEL = "tiny"
#: vLLM's NixlConnector and our socket connector both hold P's blocks this long
#: (``kv_lease_duration``, seconds) unless the kv-transfer config says otherwise.
DEFAULT_LEASE_S = 30.0
PREFILL, DECODE = "prefill[0]", "decode[0]"
#: connector -> (P's expired-lease counter, D's completed-fetch counter)
CONNECTOR_METRICS = {
    "nixl": ("vllm:nixl_num_kv_expired_reqs_total", "vllm:nixl_xfer_time_seconds_count"),
    "socket": ("vllm:socket_kv_expired_reqs_total", "vllm:socket_kv_transfers_total"),
}


# --------------------------------------------------------------------------- results


@dataclass
class Row:
    """One line of the table: a scenario's target and what was measured."""

    key: str  # a, b, ... (for the load line)
    scenario: str
    target: str
    measured: str
    met: bool | None  # None: could not be measured (the reason is in `measured`)


@dataclass
class Report:
    connector: str
    rows: list[Row] = field(default_factory=list)
    load: list[str] = field(default_factory=list)  # "scenario: 1-min load" per scenario

    def add(self, row: Row) -> None:
        self.rows.append(row)
        self.load.append(f"{row.key} {os.getloadavg()[0]:.2f}")
        print(f"[{self.connector}] {row.scenario}: {'met' if row.met else 'NOT met' if row.met is False else 'n/a'}"
              f" - {row.measured}", flush=True)


def table(reports: list[Report], command: str) -> str:
    lines = [f"`{command}`", ""]
    for rep in reports:
        one, five, fifteen = os.getloadavg()
        lines += [f"### {rep.connector}", "",
                  "| scenario | target | measured | met |", "|---|---|---|---|"]
        for r in rep.rows:
            met = "yes" if r.met else ("no" if r.met is False else "n/a")
            lines.append(f"| {r.scenario} | {r.target} | {r.measured} | {met} |")
        lines += ["", f"load average (1 min) when each scenario ended: {'; '.join(rep.load)}; "
                      f"at the end of the table: {one:.2f} {five:.2f} {fifteen:.2f}", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- plumbing


@contextlib.contextmanager
def engine_lock() -> Iterator[None]:
    """The machine-wide engine lock of the e2e tests (at most two engines at once)."""
    with open(LOCK_PATH, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for {LOCK_PATH} (another job runs engines)", flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def disagg(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "disagg", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **ENGINE_ENV})


def get(url: str, timeout: float = 10) -> tuple[int, str]:
    """(status, body) of a GET; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (OSError, ValueError):
        return 0, ""


def metric(url: str, name: str, **labels: str) -> float | None:
    status, text = get(url + "/metrics")
    return sample_sum(text, name, **labels) if status == 200 else None


def wait_for(pred: Callable[[], bool], timeout: float, every: float = 0.25) -> float | None:
    """Seconds until ``pred()`` held, or None after ``timeout``."""
    t0 = time.monotonic()
    while True:
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return None
        time.sleep(every)


def within(seconds: float | None, limit: float, digits: int = 1) -> str:
    """"after 3.2 s", or "NOT within 60 s" for None (a wait that timed out)."""
    return f"after {seconds:.{digits}f} s" if seconds is not None else f"NOT within {limit:.0f} s"


def pid_alive(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def group_members(leader: int) -> list[psutil.Process]:
    """Live processes in the process group or session whose id is ``leader`` (zombies not counted)."""
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if os.getpgid(proc.pid) == leader or os.getsid(proc.pid) == leader:
                found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


class Deployment:
    """One topology brought up with ``disagg up --detach`` in a temp run dir."""

    def __init__(self, work: Path, model: Path, connector: str, tag: str) -> None:
        proxy_port, p_port, d_port, p_kv, d_kv = free_ports(5)
        roles = (f"prefill: [{{port: {p_port}, kv_port: {p_kv}, cpus: [0], args: {ENGINE_ARGS}}}]\n"
                 f"decode: [{{port: {d_port}, kv_port: {d_kv}, cpus: [1], args: {ENGINE_ARGS}}}]\n")
        # every prompt through the KV handoff (the proxy's `auto` routing would prefill many on decode)
        extra = "routing: {policy: split}\n" if "split" in getattr(topology, "ROUTING_POLICIES", ()) else ""
        self.topology = write_topology(work / f"faults-{connector}-{tag}.yaml", model, proxy_port=proxy_port,
                                       roles=roles, connector=connector, extra=extra)
        self.run_dir = work / f"run-{connector}-{tag}"
        self.model = model
        self.connector = connector
        self.proxy = f"http://127.0.0.1:{proxy_port}"
        self.up_seconds = 0.0

    @property
    def state_file(self) -> Path:
        return self.run_dir / "runs" / self.topology.stem / "state.json"

    def up(self) -> None:
        t0 = time.monotonic()
        done = disagg("up", str(self.topology), "--detach", "--run-dir", str(self.run_dir))
        self.up_seconds = time.monotonic() - t0
        if done.returncode != 0:
            raise RuntimeError(f"disagg up failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        print(f"up in {self.up_seconds:.0f} s: {self.topology.name}", flush=True)

    def down(self) -> list[str]:
        """``disagg down``; returns what is still running of this run afterwards (should be nothing)."""
        done = disagg("down", str(self.topology), "--run-dir", str(self.run_dir), timeout=300)
        left = [f"down exited {done.returncode}: {done.stderr.strip()[-300:]}"] if done.returncode else []
        t_end = time.monotonic() + 10
        while True:
            procs = [p for p in engine_processes(self.model)]
            procs += [p for p in psutil.process_iter(["cmdline"])
                      if str(self.run_dir) in " ".join(p.info.get("cmdline") or [])]
            if not procs or time.monotonic() > t_end:
                break
            time.sleep(0.5)
        return left + [f"pid {p.pid}: {' '.join(p.cmdline())[:120]}" for p in procs if pid_alive(p.pid)]

    def state(self) -> dict[str, Any]:
        """state.json as written now (raw, so fields the supervisor adds are kept)."""
        for _ in range(20):  # the supervisor replaces it atomically; a missing file is transient
            with contextlib.suppress(OSError, ValueError):
                return json.loads(self.state_file.read_text())
            time.sleep(0.1)
        return {"processes": []}

    def record(self, name: str) -> dict[str, Any]:
        """The process record ``name`` of state.json ({} when there is none)."""
        return next((p for p in self.state().get("processes", []) if p["name"] == name), {})

    def url(self, name: str) -> str:
        return str(self.record(name)["url"])

    def engine_idle(self, name: str) -> bool:
        status, text = get(self.url(name) + "/metrics")
        if status != 200:
            return False
        return (sample_sum(text, "vllm:num_requests_running") == 0
                and sample_sum(text, "vllm:num_requests_waiting") == 0)

    def back_after_kill(self, name: str, old_pid: int) -> bool:
        """``name`` has a new pid that is alive and answers /health, and the proxy is healthy."""
        rec = self.record(name)
        if rec["pid"] == old_pid or not pid_alive(int(rec["pid"])) or rec.get("status", "running") != "running":
            return False
        return get(rec["url"] + "/health")[0] == 200 and get(self.proxy + "/health")[0] == 200

    def proxy_backend_healthy(self, role: str) -> bool:
        return (metric(self.proxy, "disagg_proxy_backend_healthy", role=role) or 0) >= 1

    def status_text(self) -> str:
        done = disagg("status", str(self.topology), "--run-dir", str(self.run_dir), timeout=60)
        return done.stdout + done.stderr


# --------------------------------------------------------------------------- client side


@dataclass
class Outcome:
    ok: bool
    kind: str  # answered | error | hung | error-event | closed | disconnected
    detail: str = ""
    ended: float = 0.0  # monotonic time the client saw the end
    events: int = 0


def completion(prompt: str | list[str], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def chat(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def endpoint(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


async def request(session: aiohttp.ClientSession, base: str, body: dict[str, Any], timeout: float,
                  expect_choices: int = 1, on_event: Callable[[int], None] | None = None,
                  stop_after: int = 0) -> Outcome:
    """One client request; checks the reply's shape. ``on_event(n)`` after the n-th streamed event;
    ``stop_after``: disconnect (close the connection) after that many streamed events."""
    stream = bool(body.get("stream"))
    events = 0
    try:
        async with asyncio.timeout(timeout):
            async with session.post(base + endpoint(body), json=body) as resp:
                if resp.status != 200:
                    return Outcome(False, "error", f"HTTP {resp.status}: {(await resp.text())[:200]}",
                                   time.monotonic())
                if not stream:
                    data = await resp.json()
                    n = len(data.get("choices") or [])
                    ok = n == expect_choices
                    return Outcome(ok, "answered" if ok else "error",
                                   "" if ok else f"{n} choices, expected {expect_choices}", time.monotonic())
                indices: set[int] = set()
                done = False
                async for raw in resp.content:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        done = True
                        break
                    event = json.loads(payload)
                    if "error" in event:
                        return Outcome(False, "error-event", str(event["error"])[:200], time.monotonic(), events)
                    for choice in event.get("choices") or []:
                        indices.add(int(choice.get("index", 0)))
                    events += 1
                    if on_event is not None:
                        on_event(events)
                    if stop_after and events >= stop_after:
                        return Outcome(False, "disconnected", "", time.monotonic(), events)
                ended = time.monotonic()
                if not done:
                    return Outcome(False, "closed", "stream ended without [DONE]", ended, events)
                ok = len(indices) == expect_choices
                return Outcome(ok, "answered" if ok else "error",
                               "" if ok else f"choices {sorted(indices)}, expected {expect_choices}", ended, events)
    except TimeoutError:
        return Outcome(False, "hung", f"no end within {timeout:.0f} s", time.monotonic(), events)
    except (aiohttp.ClientError, ValueError) as exc:
        return Outcome(False, "closed" if stream else "error", f"{type(exc).__name__}: {exc}"[:200],
                       time.monotonic(), events)


def new_session(limit: int = 0) -> aiohttp.ClientSession:
    # force_close: uvicorn drops idle keep-alive connections after 5 s; a reused one can die under a request
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=limit))


class Prompts:
    """Exact-length prompts with unique tags (no prefix-cache hits between requests)."""

    def __init__(self, model: Path) -> None:
        self.tokenizer = load_tokenizer(model)
        self.n = 0

    def __call__(self, tokens: int, tag: str = "") -> str:
        self.n += 1
        return exact_prompt(self.tokenizer, tokens, f"{tag}{self.n}")


# --------------------------------------------------------------------------- scenarios


def scenario_a(dep: Deployment, prompts: Prompts, rep: Report) -> None:
    """Prefill SIGKILLed while 40 requests at 2 req/s run."""
    before = metric(dep.proxy, "disagg_proxy_requests_total", path="split") or 0.0
    old = dep.record(PREFILL)
    old_pid = int(old["pid"])
    bodies = [completion(prompts(200, "a"), 16) for _ in range(40)]
    killed_at: list[float] = []

    async def run() -> list[Outcome]:
        async with new_session() as session:
            async def at(i: int) -> Outcome:
                await asyncio.sleep(i * 0.5)
                return await request(session, dep.proxy, bodies[i], timeout=180)

            async def kill() -> None:
                await asyncio.sleep(5.0)  # 10 requests sent, some in prefill
                os.kill(old_pid, signal.SIGKILL)
                killed_at.append(time.monotonic())

            outcomes, _ = await asyncio.gather(asyncio.gather(*(at(i) for i in range(40))), kill())
            return list(outcomes)

    outcomes = asyncio.run(run())
    answered = sum(o.kind == "answered" for o in outcomes)
    errors = sum(o.kind in ("error", "error-event", "closed") for o in outcomes)
    hung = sum(o.kind == "hung" for o in outcomes)
    back = wait_for(lambda: dep.back_after_kill(PREFILL, old_pid) and dep.proxy_backend_healthy("prefill"), 300, 0.5)
    back_s = None if back is None else time.monotonic() - killed_at[0]
    after0 = metric(dep.proxy, "disagg_proxy_requests_total", path="split") or 0.0
    later = asyncio.run(_serve(dep, [completion(prompts(200, "a2"), 8) for _ in range(5)]))
    after1 = metric(dep.proxy, "disagg_proxy_requests_total", path="split") or 0.0
    rec = dep.record(PREFILL)
    first_err = next((o.detail for o in outcomes if not o.ok), "")
    measured = (f"{answered}/40 answered, {errors} errors, {hung} hung"
                + (f" (first: {first_err})" if first_err else "")
                + f"; prefill back {within(back_s, 300, 0)}"
                + f" (restarts {rec.get('restarts', '?')}, last exit {rec.get('last_exit', '?')})"
                + f"; after it: {sum(o.ok for o in later)}/5 answered, {after1 - after0:.0f} disaggregated"
                + f" (disaggregated during the run: {after0 - before:.0f})")
    rep.add(Row("a", "a. prefill SIGKILLed, 40 req at 2 req/s",
                "40/40 answered, 0 errors, 0 hung; prefill restarted and used again",
                measured, answered == 40 and hung == 0 and back_s is not None and after1 - after0 > 0))


async def _serve(dep: Deployment, bodies: list[dict[str, Any]]) -> list[Outcome]:
    async with new_session() as session:
        return [await request(session, dep.proxy, b, timeout=180) for b in bodies]


def scenario_b(dep: Deployment, prompts: Prompts, rep: Report, clients: int = 4) -> None:
    """Decode SIGKILLed while streaming clients read."""
    old_pid = int(dep.record(DECODE)["pid"])
    streaming = [0] * clients
    killed_at: list[float] = []

    async def run() -> list[Outcome]:
        async with new_session() as session:
            def seen(i: int) -> Callable[[int], None]:
                def mark(n: int) -> None:
                    streaming[i] = n
                return mark

            tasks = [asyncio.create_task(request(
                session, dep.proxy, completion(prompts(100, "b"), 6000, stream=True, ignore_eos=True),
                timeout=300, on_event=seen(i))) for i in range(clients)]
            deadline = time.monotonic() + 180
            while not all(n >= 2 for n in streaming) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            os.kill(old_pid, signal.SIGKILL)
            killed_at.append(time.monotonic())
            return list(await asyncio.gather(*tasks))

    outcomes = asyncio.run(run())
    t_kill = killed_at[0]
    in_flight = [o for o in outcomes if o.kind != "answered" or o.ended >= t_kill]
    waits = [o.ended - t_kill for o in in_flight]
    kinds = {k: sum(o.kind == k for o in in_flight) for k in ("error-event", "closed", "hung", "answered")}
    left_gone = wait_for(lambda: not group_members(old_pid), 60, 0.2)
    back = wait_for(lambda: dep.back_after_kill(DECODE, old_pid), 300, 0.5)
    back_s = None if back is None else time.monotonic() - t_kill
    left_now = group_members(old_pid)
    later = asyncio.run(_serve(dep, [completion(prompts(100, "b2"), 8) for _ in range(3)]
                               + [chat(prompts(100, "b3"), 8, stream=True) for _ in range(2)]))
    rec = dep.record(DECODE)
    max_wait = max(waits) if waits else float("nan")
    measured = (f"{len(in_flight)} streams in flight: {kinds['error-event']} error events, {kinds['closed']} closed,"
                f" {kinds['hung']} hung, {kinds['answered']} finished; slowest end {max_wait:.2f} s after the kill"
                f"; old group empty {within(left_gone, 60)}"
                f" ({len(left_now)} left when decode was back)"
                f"; decode back {within(back_s, 300, 0)}"
                f" (restarts {rec.get('restarts', '?')}, last exit {rec.get('last_exit', '?')})"
                f"; later: {sum(o.ok for o in later)}/{len(later)} answered")
    met = (len(in_flight) == clients and kinds["hung"] == 0 and kinds["answered"] == 0 and max_wait <= 5
           and back_s is not None and not left_now and all(o.ok for o in later))
    rep.add(Row("b", "b. decode SIGKILLed mid-stream", "every stream ends (error event / close) within 5 s; decode "
                "restarted; later requests served; nothing of the old group left", measured, met))


def scenario_c(dep: Deployment, prompts: Prompts, rep: Report, lease_s: float, rng: random.Random,
               clients: int = 100, parallel: int = 10) -> None:
    """100 streaming clients disconnecting at random points, ``parallel`` at a time."""
    p_url, d_url = dep.url(PREFILL), dep.url(DECODE)
    tokens, max_tokens = 600, 64

    def body(tag: str) -> dict[str, Any]:
        return completion(prompts(tokens, tag), max_tokens, stream=True)

    # calibration: one undisturbed wave of `parallel` requests, timed by the proxy (prefill) and the clients
    m0 = get(dep.proxy + "/metrics")[1]
    calib = asyncio.run(_wave(dep, [body("c0") for _ in range(parallel)]))
    m1 = get(dep.proxy + "/metrics")[1]
    n_pre = sample_sum(m1, "disagg_proxy_prefill_seconds_count") - sample_sum(m0, "disagg_proxy_prefill_seconds_count")
    pre_sum = sample_sum(m1, "disagg_proxy_prefill_seconds_sum") - sample_sum(m0, "disagg_proxy_prefill_seconds_sum")
    if not all(o.ok for o, _ in calib) or not n_pre:
        bad = next((o.detail for o, _ in calib if not o.ok), "no request went through prefill")
        rep.add(Row("c", "c. 100 clients disconnect", "-", f"calibration wave failed: {bad}", None))
        return
    prefill_s = pre_sum / n_pre
    ttft = statistics.median(t for _, t in calib)
    expired_name, fetched_name = CONNECTOR_METRICS[dep.connector]
    p0, d0, x0 = get(p_url + "/metrics")[1], get(d_url + "/metrics")[1], get(dep.proxy + "/metrics")[1]
    phases = ["prefill", "handoff", "mid-stream"]
    plan = [phases[i % 3] for i in range(clients)]
    rng.shuffle(plan)
    cut: dict[str, list[int]] = {p: [] for p in phases}  # events each client had seen when it left
    finished = 0
    last_disconnect = [0.0]

    async def client(session: aiohttp.ClientSession, phase: str, sem: asyncio.Semaphore) -> None:
        nonlocal finished
        async with sem:
            if phase == "mid-stream":
                out = await request(session, dep.proxy, body("c"), timeout=120,
                                    stop_after=rng.randint(1, max_tokens - 2))
                if out.kind == "disconnected":
                    cut[phase].append(out.events)
                else:
                    finished += 1
            else:
                after = (rng.uniform(0.05, 0.9) * prefill_s if phase == "prefill"
                         else rng.uniform(prefill_s, max(ttft, prefill_s + 0.05)))
                seen = [0]
                task = asyncio.create_task(request(session, dep.proxy, body("c"), timeout=120,
                                                   on_event=lambda n: seen.__setitem__(0, n)))
                done, _ = await asyncio.wait({task}, timeout=after)
                if done:
                    finished += 1
                else:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    cut[phase].append(seen[0])
            last_disconnect[0] = time.monotonic()

    async def run() -> None:
        sem = asyncio.Semaphore(parallel)
        async with new_session() as session:
            await asyncio.gather(*(client(session, ph, sem) for ph in plan))

    asyncio.run(run())
    t_last = last_disconnect[0]
    idle = wait_for(lambda: dep.engine_idle(PREFILL) and dep.engine_idle(DECODE), 120, 0.2)
    idle_s = None if idle is None else time.monotonic() - t_last

    def kv_free() -> bool:
        return metric(p_url, "vllm:kv_cache_usage_perc") == 0 and metric(d_url, "vllm:kv_cache_usage_perc") == 0

    freed = wait_for(kv_free, lease_s + 60, 0.25)
    freed_s = None if freed is None else time.monotonic() - t_last
    p1, d1, x1 = get(p_url + "/metrics")[1], get(d_url + "/metrics")[1], get(dep.proxy + "/metrics")[1]

    def delta(before: str, after: str, name: str, **labels: str) -> float:
        return sample_sum(after, name, **labels) - sample_sum(before, name, **labels)

    prefilled = delta(p0, p1, "vllm:request_success_total")
    fetched = delta(d0, d1, fetched_name)
    expired = delta(p0, p1, expired_name)
    split = delta(x0, x1, "disagg_proxy_requests_total", path="split")
    before_first = sum(n == 0 for ph in ("prefill", "handoff") for n in cut[ph])
    measured = (f"left: {len(cut['prefill'])} in prefill, {len(cut['handoff'])} between P's reply and the first "
                f"token, {len(cut['mid-stream'])} mid-stream ({before_first} of the first two before any token; "
                f"{finished} finished first; calibration wave: prefill {prefill_s:.2f} s, TTFT {ttft:.2f} s); "
                f"P finished {prefilled:.0f} prefills, D fetched {fetched:.0f} ({split:.0f} requests counted "
                f"disaggregated by the proxy); 0 running/waiting on both {within(idle_s, 120)}; "
                f"P and D KV usage 0 {within(freed_s, lease_s + 60)} (lease {lease_s:.0f} s; "
                f"{expired:.0f} leases expired on P)")
    met = idle_s is not None and idle_s <= 10 and freed_s is not None and freed_s <= lease_s + 5
    rep.add(Row("c", f"c. {clients} clients disconnect at random points",
                f"0 running/waiting within 10 s; P's KV back to 0 within lease + 5 s = {lease_s + 5:.0f} s",
                measured, met))


async def _wave(dep: Deployment, bodies: list[dict[str, Any]]) -> list[tuple[Outcome, float]]:
    """Send ``bodies`` at once; each outcome with the client's time to its first streamed event."""
    async with new_session() as session:
        async def one(body: dict[str, Any]) -> tuple[Outcome, float]:
            t0 = time.monotonic()
            first: list[float] = []

            def mark(n: int) -> None:
                if n == 1:
                    first.append(time.monotonic() - t0)

            out = await request(session, dep.proxy, body, timeout=180, on_event=mark)
            return out, first[0] if first else float("nan")

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def soak_body(i: int, prompts: Prompts, rng: random.Random) -> tuple[dict[str, Any], int]:
    """The i-th soak request and the number of choices its reply must carry."""
    tokens, max_tokens = rng.randint(20, 120), rng.randint(4, 16)
    shape = i % 8
    if shape == 0:
        return completion(prompts(tokens, "d"), max_tokens), 1
    if shape == 1:
        return completion(prompts(tokens, "d"), max_tokens, stream=True), 1
    if shape == 2:
        return chat(prompts(tokens, "d"), max_tokens), 1
    if shape == 3:
        return chat(prompts(tokens, "d"), max_tokens, stream=True), 1
    if shape == 4:
        return completion([prompts(tokens, "d") for _ in range(3)], max_tokens), 3
    if shape == 5:
        return completion(prompts(tokens, "d"), max_tokens, n=2, temperature=0.8), 2
    if shape == 6:
        return chat(prompts(tokens, "d"), max_tokens, n=2, temperature=0.8, stream=True), 2
    return completion([prompts(tokens, "d") for _ in range(2)], max_tokens, stream=True), 2


def scenario_d(dep: Deployment, prompts: Prompts, rep: Report, rng: random.Random, total: int,
               concurrency: int = 8) -> None:
    """Soak: mixed shapes at concurrency 8; errors and proxy RSS."""
    proxy_pid = int(dep.record("proxy")["pid"])
    proxy = psutil.Process(proxy_pid)
    bodies = [soak_body(i, prompts, rng) for i in range(total)]
    outcomes: list[Outcome] = []
    rss_100: list[int] = []
    rss_max = [0]
    t0 = time.monotonic()

    async def run() -> None:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(total):
            queue.put_nowait(i)
        async with new_session() as session:
            async def worker() -> None:
                while not queue.empty():
                    body, choices = bodies[queue.get_nowait()]
                    outcomes.append(await request(session, dep.proxy, body, timeout=300, expect_choices=choices))
                    rss = proxy.memory_info().rss
                    rss_max[0] = max(rss_max[0], rss)
                    if len(outcomes) == 100:
                        rss_100.append(rss)
                    if len(outcomes) % 100 == 0:
                        print(f"  soak: {len(outcomes)}/{total}, proxy RSS {rss / 2**20:.1f} MiB", flush=True)

            await asyncio.gather(*(worker() for _ in range(concurrency)))

    asyncio.run(run())
    wall = time.monotonic() - t0
    rss_end = proxy.memory_info().rss
    errors = [o for o in outcomes if not o.ok]
    base = rss_100[0] if rss_100 else rss_end
    growth = (rss_end - base) / base * 100
    measured = (f"{len(outcomes) - len(errors)}/{total} ok, {len(errors)} errors"
                + (f" (first: {errors[0].kind} {errors[0].detail})" if errors else "")
                + f" in {wall:.0f} s; proxy RSS {base / 2**20:.1f} MiB after 100, {rss_end / 2**20:.1f} MiB at "
                  f"the end ({growth:+.1f}%), max {rss_max[0] / 2**20:.1f} MiB")
    rep.add(Row("d", f"d. soak: {total} mixed requests at concurrency {concurrency}",
                "0 errors; proxy RSS at the end within 10% of after the first 100", measured,
                not errors and abs(growth) <= 10))


def scenario_e(dep: Deployment, prompts: Prompts, rep: Report, kills: int = 6) -> None:
    """The prefill engine SIGKILLed again each time it is back; the sixth failure must stick.

    Prefill, so that the run goes on after the last failure (decode serves alone) and its
    failed state can be read back; a decode engine that fails for good stops the whole run.
    """
    times: list[str] = []
    exits: set[str] = set()  # last_exit as state.json gave it after each restart
    all_back = True
    disaggregated = "disagg_proxy_requests_total"
    for i in range(1, kills):
        old_pid = int(dep.record(PREFILL)["pid"])
        os.kill(old_pid, signal.SIGKILL)
        t_kill = time.monotonic()

        def served(old: int = old_pid) -> bool:
            if not dep.back_after_kill(PREFILL, old) or not dep.proxy_backend_healthy("prefill"):
                return False
            n0 = metric(dep.proxy, disaggregated, path="split") or 0.0
            ok = all(o.ok for o in asyncio.run(_serve(dep, [completion(prompts(50, "e"), 4)])))
            return ok and (metric(dep.proxy, disaggregated, path="split") or 0.0) > n0

        back = wait_for(served, 300, 0.5)
        if back is None:
            times.append(f"#{i}: NOT back within 300 s")
            all_back = False
            break
        times.append(f"{time.monotonic() - t_kill:.0f}")
        exits.add(str(dep.record(PREFILL).get("last_exit", "?")))
        print(f"  restart {i}: back and used after {times[-1]} s", flush=True)
    rec = dep.record(PREFILL)
    restarts_before = rec.get("restarts", "?")
    final_pid = int(rec["pid"])
    os.kill(final_pid, signal.SIGKILL)
    failed = wait_for(lambda: dep.record(PREFILL).get("status") == "failed", 120, 0.5)
    # and it stays failed: no new prefill process for twice the longest backoff (30 s)
    watch_until = time.monotonic() + 60
    restarted_again = False
    while time.monotonic() < watch_until and not restarted_again:
        rec = dep.record(PREFILL)
        restarted_again = int(rec.get("pid", final_pid)) != final_pid and pid_alive(int(rec["pid"]))
        time.sleep(1)
    status = dep.status_text()
    line = " ".join(next((ln for ln in status.splitlines() if PREFILL in ln), status[-200:]).split())
    says_failed = "failed" in line or "gave up" in line
    served_after = asyncio.run(_serve(dep, [completion(prompts(50, "e2"), 4) for _ in range(3)]))
    measured = (f"back and serving disaggregated after each kill (s): {', '.join(times)}; restarts recorded "
                f"{restarts_before}, last exits: {' / '.join(sorted(exits))}; "
                f"6th kill: state 'failed' {within(failed, 120)}, "
                f"{'restarted again' if restarted_again else 'no new process in the next 60 s'}; "
                f"decode alone then served {sum(o.ok for o in served_after)}/3; `disagg status`: `{line[:200]}`")
    rep.add(Row("e", "e. prefill SIGKILLed 5 times, then a 6th",
                "back each time; the 6th failure reported (failed / gave up), not retried",
                measured, all_back and failed is not None and not restarted_again and says_failed))


# --------------------------------------------------------------------------- driver

SHARED = ("c", "d", "a", "b")  # order on the shared deployment: no restart before (c) and (d)


def lease_seconds(dep: Deployment) -> float:
    """The ``kv_lease_duration`` the plan gives P (NIXL and our connector both default to 30 s)."""
    plan = build_deployment(load_topology(dep.topology))
    engine = next(e for e in plan.engines if e.instance.role == "prefill")
    config = json.loads(engine.argv[engine.argv.index("--kv-transfer-config") + 1])
    extra = config.get("kv_connector_extra_config") or {}
    return float(extra.get("kv_lease_duration", extra.get("lease_s", DEFAULT_LEASE_S)))


def run_connector(connector: str, scenarios: list[str], work: Path, model: Path, args: argparse.Namespace,
                  ) -> Report:
    rep = Report(connector)
    prompts = Prompts(model)
    rng = random.Random(args.seed)
    shared = [s for s in SHARED if s in scenarios]
    if shared:
        dep = Deployment(work, model, connector, "shared")
        try:
            dep.up()
            lease = lease_seconds(dep)
            for s in shared:
                print(f"[{connector}] scenario {s}", flush=True)
                try:
                    if s == "a":
                        scenario_a(dep, prompts, rep)
                    elif s == "b":
                        scenario_b(dep, prompts, rep)
                    elif s == "c":
                        scenario_c(dep, prompts, rep, lease, rng)
                    else:
                        scenario_d(dep, prompts, rep, rng, args.soak_requests)
                except Exception as exc:  # one scenario's failure is a row, the others still run
                    rep.add(Row(s, s, "-", f"scenario crashed: {type(exc).__name__}: {exc}"[:300], False))
        finally:
            left = dep.down()
            if left:
                rep.add(Row("down", "down (shared)", "nothing left", "; ".join(left)[:400], False))
    if "e" in scenarios:
        dep = Deployment(work, model, connector, "restarts")
        try:
            dep.up()
            print(f"[{connector}] scenario e", flush=True)
            try:
                scenario_e(dep, prompts, rep)
            except Exception as exc:
                rep.add(Row("e", "e", "-", f"scenario crashed: {type(exc).__name__}: {exc}"[:300], False))
        finally:
            left = dep.down()
            if left:
                rep.add(Row("down", "down (restarts)", "nothing left", "; ".join(left)[:400], False))
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connector", default="both", choices=["nixl", "socket", "both"])
    ap.add_argument("--scenarios", default="a,b,c,d,e")
    ap.add_argument("--soak-requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--out", type=Path, help="append the Markdown tables here")
    args = ap.parse_args(argv)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if bad := [s for s in scenarios if s not in "abcde" or len(s) != 1]:
        ap.error(f"unknown scenarios: {bad}")
    connectors = ["nixl", "socket"] if args.connector == "both" else [args.connector]
    # `kill` (SIGTERM) unwinds like Ctrl-C: every deployment goes down in its finally
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="faults-"))
    model = build_model("tiny", work / "tiny")
    command = "python benchmarks/faults.py " + " ".join(argv if argv is not None else sys.argv[1:])
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    reports = []
    with engine_lock():
        for connector in connectors:
            reports.append(run_connector(connector, scenarios, work, model, args))
    out = f"{started}\n\n" + table(reports, command.strip())
    print(out)
    if args.out:
        with args.out.open("a") as f:
            f.write(out + "\n")
    print(f"logs: {work}", file=sys.stderr)
    return 0 if all(r.met for rep in reports for r in rep.rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""From what the agents said to one row per check and host: ``ok``, ``FAIL``, ``warn`` or ``skip``.

Called by :func:`disagg.doctor.run_doctor`. Each ``_check`` function reads one participant's report
(and, for the checks across hosts, a reference host's) and returns its row; a host whose agent
did not answer gets one ``reach`` FAIL row saying why and no other rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from disagg.doctor.agents import AgentRun
from disagg.doctor.plan import Reach, package_groups
from disagg.topology import Topology
from disagg.units import fmt_bytes

OK, FAIL, WARN, SKIP = "ok", "FAIL", "warn", "skip"
#: the checks in table order
CHECKS = ("agent", "python", "versions", "model", "device", "address", "interface", "ports", "reach",
          "clock", "disk")
#: the checks ``up`` runs before anything starts (each needs no listener, no other host, no clock)
CHEAP = ("agent", "python", "versions", "model", "device", "address", "interface")
#: a host's clock this far from this machine's fails (log lines and metrics of two hosts stop lining up)
CLOCK_SKEW_MAX_S = 1.0
#: less free disk than this under a host's run directory fails (engine logs grow there)
DISK_MIN_BYTES = 1 << 30


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    check: str
    host: str
    status: str
    detail: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def _python(run: AgentRun) -> Row:
    assert run.ready is not None
    py = run.ready["python"]
    if py["fallback"]:
        return Row("python", run.part.name, FAIL, f"{run.part.python} not found (the checks ran with "
                                                   f"{py['executable']}, Python {py['version']})")
    venv = run.part.request.get("venv")
    where = f"venv {venv}" if venv else py["executable"]
    return Row("python", run.part.name, OK, f"Python {py['version']} ({where})")


def _versions(run: AgentRun, ref: AgentRun | None, groups: list[tuple[str, ...]]) -> Row:
    assert run.ready is not None
    mine: dict[str, str | None] = run.ready["versions"]
    found = {k: v for k, v in mine.items() if v}
    text = ", ".join(f"{k} {v}" for k, v in found.items()) or "none"
    if run.ready["python"]["fallback"]:
        return Row("versions", run.part.name, FAIL, f"no venv: {text} (of the fallback Python)")
    missing = [" or ".join(group) for group in groups if not any(mine.get(name) for name in group)]
    if missing:
        return Row("versions", run.part.name, FAIL, f"not installed: {', '.join(missing)} (have {text})")
    if ref is not None and ref is not run and ref.ready is not None:
        theirs = ref.ready["versions"]
        differ = [f"{k} {mine.get(k) or '-'} here, {theirs.get(k) or '-'} on {ref.part.name}"
                  for k in mine if k in theirs and mine.get(k) != theirs.get(k)]
        if differ:
            return Row("versions", run.part.name, FAIL, "; ".join(differ))
        return Row("versions", run.part.name, OK, f"{text} (same as {ref.part.name})")
    return Row("versions", run.part.name, OK, text)


def _model(run: AgentRun, ref: AgentRun | None) -> Row:
    assert run.ready is not None
    spec = run.part.request["model"]
    got = run.ready.get("model") or {}
    name = run.part.name
    if not got.get("ok"):
        if spec.get("embedded") and got.get("missing"):
            status, only = (WARN, " only") if run.part.is_remote else (SKIP, "")
            return Row("model", name, status, f"embedded model not built yet at {spec['path']}: "
                                              f"`up` builds it on this machine{only}")
        if spec.get("hf_id") and got.get("missing"):
            return Row("model", name, WARN, f"{got['error']}; the engine downloads it at start")
        return Row("model", name, FAIL, got.get("error", "unreadable"))
    detail = f"{spec['path']}: config.json ({got.get('model_type') or 'no model_type'}), {got['fingerprint']}"
    if ref is not None and ref is not run and ref.ready is not None and (ref.ready.get("model") or {}).get("ok"):
        theirs = ref.ready["model"]["fingerprint"]
        if theirs != got["fingerprint"]:
            return Row("model", name, FAIL, f"{spec['path']} differs from {ref.part.name}'s copy "
                                            f"({got['fingerprint']} here, {theirs} there)")
        detail += f" (same as {ref.part.name})"
    return Row("model", name, OK, detail)


def _device(run: AgentRun, topo: Topology) -> Row:
    assert run.ready is not None and run.part.host is not None
    host, name = run.part.host, run.part.name
    insts = [i for i in topo.instances if i.host == host.name]
    if host.device == "cuda":
        gpus = run.ready.get("gpus") or {}
        if not gpus.get("ok"):
            return Row("device", name, FAIL, gpus.get("error", "no GPU answer"))
        have = {g["index"]: g["name"] for g in gpus["gpus"]}
        wanted = sorted({g for i in insts for g in i.gpus}) or [0]
        absent = [g for g in wanted if g not in have]
        listed = ", ".join(f"{k} {v}" for k, v in sorted(have.items())) or "none"
        if absent:
            return Row("device", name, FAIL, f"GPU {','.join(map(str, absent))} not visible (nvidia-smi: {listed})")
        return Row("device", name, OK, f"GPUs {listed}")
    cpus = run.ready["cpus"]
    wanted = sorted({c for i in insts for c in i.cpus})
    absent = [c for c in wanted if c not in cpus]
    if absent:
        return Row("device", name, FAIL, f"CPU cores {','.join(map(str, absent))} not available "
                                         f"(this host has {len(cpus)}: {_span(cpus)})")
    named = f"cores {','.join(map(str, wanted))} of {len(cpus)}" if wanted else f"{len(cpus)} cores"
    return Row("device", name, OK, f"cpu: {named}")


def _span(cpus: list[int]) -> str:
    return f"{cpus[0]}-{cpus[-1]}" if cpus and cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))


def _address(run: AgentRun) -> Row:
    assert run.ready is not None
    got, address = run.ready["address"], run.part.request["address"]
    if got["ok"]:
        return Row("address", run.part.name, OK, f"{address} is this host's")
    return Row("address", run.part.name, FAIL, f"{address}: {got['error']}")


def _interface(run: AgentRun) -> Row:
    assert run.ready is not None
    names = run.part.request.get("interfaces") or []
    if not names:
        return Row("interface", run.part.name, SKIP, "none named (UCX picks its own)")
    got = run.ready["interfaces"]
    bad = [n for n in names if got["state"].get(n) is not True]
    if bad:
        why = [f"{n} is down" if got["state"].get(n) is False else f"no interface {n}" for n in bad]
        return Row("interface", run.part.name, FAIL, "; ".join(why) + f" (have: {', '.join(got['have'])})")
    return Row("interface", run.part.name, OK, ", ".join(names) + " up")


def _ports(run: AgentRun) -> Row:
    assert run.ready is not None
    busy, free, notes = [], [], []
    system = run.ready.get("local_port_range")
    for entry in run.ready["ports"]:
        if "range" in entry:
            lo, hi = entry["range"]
            text = f"UCX {lo}-{hi}: {entry['free']} free"
            if system and (hi < system[0] or lo > system[1]):
                busy.append(f"UCX {lo}-{hi} lies outside this host's ip_local_port_range "
                            f"{system[0]}-{system[1]} (UCX refuses it)")
            elif entry["free"] == 0:
                busy.append(f"UCX {lo}-{hi}: every port in use")
            else:
                notes.append(text)
        elif entry["free"]:
            free.append(str(entry["port"]))
        else:
            busy.append(f"{entry['port']} ({entry['label']}) {entry.get('error', 'in use')}")
    if busy:
        return Row("ports", run.part.name, FAIL, "; ".join(busy))
    return Row("ports", run.part.name, OK, ", ".join(free) + " free" + "".join(f"; {n}" for n in notes))


def _reach(run: AgentRun, reach: list[Reach], runs: dict[str, AgentRun]) -> Row:
    mine = [r for r in reach if r.source == run.part.name]
    if not mine:
        return Row("reach", run.part.name, SKIP, "connects to nothing")
    results = {c["label"]: c for c in (run.done or {}).get("connect", [])}
    bad, good = [], []
    for r in mine:
        got = results.get(r.label)
        target = runs.get(r.target)
        where = f"{r.label} on {r.target}"
        if got is None:
            why = (f"{r.target} did not answer" if target is None or target.error
                   else "no port to try (none free in its range)")
            bad.append(f"{where}: not tried, {why}")
        elif got["ok"]:
            good.append(f"{r.label} {got['address']}:{got['port']}")
        else:
            bad.append(f"{where} {got['address']}:{got['port']}: {got['error']}")
    if bad:
        return Row("reach", run.part.name, FAIL, "; ".join(bad))
    return Row("reach", run.part.name, OK, f"{len(good)} connects: " + ", ".join(good))


def _clock(run: AgentRun) -> Row:
    if not run.part.is_remote:
        return Row("clock", run.part.name, SKIP, "this machine's clock")
    if run.clock is None or run.sent_at is None or run.clock_at is None:
        return Row("clock", run.part.name, FAIL, "no clock reading")
    middle = (run.sent_at + run.clock_at) / 2
    skew, error = run.clock - middle, (run.clock_at - run.sent_at) / 2
    text = f"{skew:+.3f} s (±{error:.3f}) from this machine"
    return Row("clock", run.part.name, FAIL if abs(skew) - error > CLOCK_SKEW_MAX_S else OK,
               text + (f"; more than {CLOCK_SKEW_MAX_S:g} s" if abs(skew) - error > CLOCK_SKEW_MAX_S else ""))


def _disk(run: AgentRun) -> Row:
    assert run.ready is not None
    got = run.ready["disk"]
    text = f"{fmt_bytes(got['free'])} free at {got['path']}"
    return Row("disk", run.part.name, OK if got["free"] >= DISK_MIN_BYTES else FAIL,
               text + ("" if got["free"] >= DISK_MIN_BYTES else f" (under {fmt_bytes(DISK_MIN_BYTES)})"))


def reference(runs: dict[str, AgentRun]) -> AgentRun | None:
    """The host others are compared with: the first local engine host, else the first engine host."""
    engine_runs = [r for r in runs.values() if r.part.runs_engines and r.ready is not None]
    return next((r for r in engine_runs if not r.part.is_remote), engine_runs[0] if engine_runs else None)


def rows(topo: Topology, runs: dict[str, AgentRun], reach: list[Reach], *, cheap: bool = False) -> list[Row]:
    """Every row, in :data:`CHECKS` order, hosts in file order."""
    ref = reference(runs)
    out: list[Row] = []
    emulated = topo.link.type == "emulated"
    for run in runs.values():
        if run.ready is None:
            out.append(Row("agent", run.part.name, FAIL, run.error or "no answer"))
            continue
        part = run.part
        out.append(_python(run))
        if part.runs_engines:
            out.append(_versions(run, ref, package_groups(topo)))
            out.append(_model(run, ref))
            out.append(_device(run, topo))
        if part.host is not None:
            if emulated:
                out.append(Row("address", part.name, SKIP, "the emulated link's addresses exist only while up runs"))
            else:
                out.append(_address(run))
                out.append(_interface(run))
        if cheap:
            continue
        if emulated:
            out.append(Row("ports", part.name, SKIP, "`up` checks them inside the emulated link"))
        else:
            out.append(_ports(run))
            out.append(_reach(run, reach, runs) if run.error is None
                       else Row("reach", part.name, FAIL, run.error))
        out.append(_clock(run))
        if "disk" in part.request:
            out.append(_disk(run))
    order = {c: i for i, c in enumerate(CHECKS)}
    names = list(runs)
    return sorted(out, key=lambda r: (order[r.check], names.index(r.host)))


def as_json(found: list[Row]) -> dict[str, Any]:
    """``disagg doctor --json``: every row and whether all passed."""
    return {"ok": all(r.status != FAIL for r in found), "checks": [r.to_json() for r in found]}

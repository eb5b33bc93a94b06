"""Streamed vs fetched KV handoffs: 1P1D time to first token, next to prefill alone and transfer alone.

For each link, one pair of real vLLM CPU engines with the socket connector (P's processes
pinned to core 0, D's to core 1: ``connector_throughput.pin``; prefix caching off on both so
that every request computes and moves its whole prompt) answers prompts of each size (exact
token counts, sent as token ids) four ways, the ways interleaved within each repeat:

- ``prefill``: P alone, a plain request computing one token: the prefill as a client sees it;
- ``fetch``: the socket connector's pull mode, as the proxy's ``vllm`` handoff does it: P with
  ``do_remote_decode`` and ``max_tokens: 1``, then D with P's ``kv_transfer_params``; TTFT is
  from sending P's request to D's answer (one token). ``xfer`` is the connector's own transfer
  time on D (``vllm:socket_kv_xfer_seconds``), the transfer alone;
- ``stream``: the streaming mode, as the proxy's ``vllm-socket-stream`` handoff does it: P and D
  at once, joined by a ``stream_key``; TTFT from sending both to D's answer;
- ``nixl`` (``--nixl``): the same sequential handoff with vLLM's NIXL connector, on a pair of
  its own started after the socket pair on the same link;
- ``nixl_push`` (``--nixl-push``): vLLM's own push connector (``NixlPushConnector``), as the
  proxy's ``vllm-nixl-push`` handoff does it: P and D at once under one request id, D given P's
  NIXL engine id and side channel (learned from a first, sequential handoff), P WRITEs into the
  blocks D registered when its prefill ends; TTFT from sending both to D's answer, ``xfer`` the
  WRITE's time on P (push mode counts its transfers on the writing side). A pair of its own too.

``fixed`` = fetch handoff - xfer, where the fetch handoff is measured within each fetch (P's
answer to D's): what a handoff costs beyond computing and moving the KV (D's request, its
scheduling, its last-token step). (Rows of runs before 2026-12-01 evening lack the in-request
handoff and use fetch TTFT - prefill - xfer, which the spread of a prefill measured in another
request enters: -736 ms on a 2,048-token row whose prefills alone spread 6.1-7.0 s.) The target for the
streamed handoff: ``stream <= 1.15 x max(prefill, xfer) + fixed`` on every shaped row; the
table prints the bound and the ratio.

Links as in ``connector_throughput.py``: ``loopback``, ``1gbit``, ``2.5gbit`` (P in a network
namespace behind a tbf-shaped veth; needs root). Model: ``--embedded tiny-kvdeep`` (16 layers,
32 KiB of bf16 KV per token), so that a layer-by-layer stream has 16 steps to overlap, run in
``--dtype float32`` by default (64 KiB of KV per token; see ``--dtype``).

Run (holds the engine lock; alone on the machine)::

    flock /tmp/disagg-engines.lock .venv/bin/python benchmarks/streaming_ttft.py \\
        --embedded tiny-kvdeep --links 1gbit,2.5gbit --sizes 512,2048,8000 --repeats 3 --nixl --nixl-push
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a sibling script: LINKS, planned_engines, prompt_ids
import connector_throughput as ct

from disagg.kvmath import ModelArch, embedded_arch, kv_dtype_bytes
from disagg.modelgen import EMBEDDED_MODELS, build_model
from disagg.proxy.nixl_push_handoff import NixlPushHandoff, PushPeer, push_request_id
from disagg.routecost import FIRST_STEP_CPU_BYTES_PER_S, exposed_transfer_s, first_step_s, handoff_fixed_s
from harness.vllm_pair import Engine, free_port, metric, start_engine, wait_healthy

SOCKET = ct.CONNECTORS["socket"]
NIXL = ct.CONNECTORS["nixl"]
#: vLLM's push connector; its transfer metrics are the prefill engine's (the side that WRITEs)
NIXL_PUSH = ct.Connector("nixl-push", NIXL.xfer_seconds, NIXL.xfer_count)


def body(ids: list[int], params: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0}
    if params is not None:
        out["kv_transfer_params"] = params
    return out


async def timed(coro: Any) -> tuple[Any, float]:
    """The coroutine's result and how long it took."""
    started = time.perf_counter()
    result = await coro
    return result, time.perf_counter() - started


async def xfer_after(d: Engine, conn: ct.Connector, secs0: float, n0: float) -> float:
    """The transfer time D recorded since (secs0, n0) (stats reach /metrics a step later)."""
    deadline = time.monotonic() + 15
    while metric(d.url, conn.xfer_count) <= n0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{conn.name}: no transfer recorded on D\n{d.log_tail()}")
        await asyncio.sleep(0.1)
    return metric(d.url, conn.xfer_seconds) - secs0


async def fetch_ttft(session: aiohttp.ClientSession, p: Engine, d: Engine, conn: ct.Connector,
                     ids: list[int]) -> tuple[float, float, float]:
    """(TTFT, transfer seconds, handoff seconds) of one sequential handoff; the handoff is what the
    split adds after P answered, measured within the request: from P's answer to D's."""
    secs0, n0 = metric(d.url, conn.xfer_seconds), metric(d.url, conn.xfer_count)
    started = time.perf_counter()
    pre = await ct.post(session, p, body(ids, dict(ct.REMOTE_DECODE)))
    p_done = time.perf_counter()
    await ct.post(session, d, body(ids, pre["kv_transfer_params"]))
    ended = time.perf_counter()
    return ended - started, await xfer_after(d, conn, secs0, n0), ended - p_done


async def stream_ttft(session: aiohttp.ClientSession, p: Engine, d: Engine, p_kv: tuple[str, int],
                      ids: list[int]) -> tuple[float, float, float]:
    """(TTFT, D's transfer seconds, handoff seconds) of one streamed handoff (P and D at once); the
    handoff is from P's answer (its prefill done) to D's, both of the same request."""
    key = secrets.token_urlsafe(24)
    secs0, n0 = metric(d.url, SOCKET.xfer_seconds), metric(d.url, SOCKET.xfer_count)
    p_params = {"do_remote_decode": True, "do_remote_prefill": False, "stream_key": key}
    d_params = {"do_remote_prefill": True, "do_remote_decode": False, "transfer": "socket", "stream_key": key,
                "remote_host": p_kv[0], "remote_port": p_kv[1]}
    started = time.perf_counter()
    prefill = asyncio.create_task(timed(ct.post(session, p, body(ids, p_params))))
    await ct.post(session, d, body(ids, d_params))
    ttft = time.perf_counter() - started
    _, p_secs = await prefill
    return ttft, await xfer_after(d, SOCKET, secs0, n0), ttft - p_secs


async def post_as(session: aiohttp.ClientSession, eng: Engine, payload: dict[str, Any], request_id: str
                  ) -> dict[str, Any]:
    """``ct.post`` under an ``X-Request-Id``: vLLM's push connector matches D's registration to P's
    request by that id."""
    return await ct.post(session, eng, payload, headers={"X-Request-Id": request_id})


async def push_peer(session: aiohttp.ClientSession, p: Engine, d: Engine, ids: list[int]) -> PushPeer:
    """One sequential push handoff (P, then D with P's reply, as the proxy's first split to a prefill
    engine): P's NIXL coordinates, and both sides' handshakes done."""
    rid = push_request_id("bench-warm")
    pre = await post_as(session, p, body(ids, dict(NixlPushHandoff.PREFILL_PARAMS)), rid)
    peer = PushPeer.from_params(pre.get("kv_transfer_params"))
    if peer is None:
        raise RuntimeError(f"{p.name}: not a push-mode reply: {pre.get('kv_transfer_params')}")
    await post_as(session, d, body(ids, pre["kv_transfer_params"]), rid)
    return peer


async def push_ttft(session: aiohttp.ClientSession, p: Engine, d: Engine, peer: PushPeer,
                    ids: list[int]) -> tuple[float, float, float]:
    """(TTFT, P's WRITE seconds, handoff seconds) of one push handoff (P and D at once, one fresh
    request id); the handoff is from P's answer to D's."""
    rid = push_request_id("bench")
    secs0, n0 = metric(p.url, NIXL_PUSH.xfer_seconds), metric(p.url, NIXL_PUSH.xfer_count)
    started = time.perf_counter()
    prefill = asyncio.create_task(timed(post_as(session, p, body(ids, dict(NixlPushHandoff.PREFILL_PARAMS)), rid)))
    await post_as(session, d, body(ids, NixlPushHandoff.decode_params(peer)), rid)
    ttft = time.perf_counter() - started
    _, p_secs = await prefill
    return ttft, await xfer_after(p, NIXL_PUSH, secs0, n0), ttft - p_secs


def start_pair(conn: ct.Connector, place: ct.Placement, model_dir: Path, log_dir: Path, dtype: str
               ) -> tuple[Engine, Engine, tuple[str, int]]:
    p_port, d_port = free_port(), free_port()
    p_cfg, d_cfg, p_env, d_env = ct.planned_engines(conn.name, place, p_port, d_port)
    args = ["--dtype", dtype]
    p = start_engine(f"{conn.label}-prefill", str(model_dir), 0, p_cfg, p_env, log_dir, max_model_len=8192,
                     host=place.p_host, wrap=place.p_argv, args=args)
    d = start_engine(f"{conn.label}-decode", str(model_dir), 1, d_cfg, d_env, log_dir, max_model_len=8192,
                     args=args, wrap=place.d_argv)
    extra = p_cfg.get("kv_connector_extra_config", {})
    return p, d, (str(extra.get("host", place.p_host)), int(extra.get("port", 0)))


#: one handoff of a prompt (token ids) on a warmed pair: (TTFT, transfer seconds, handoff seconds)
Measure = Callable[[aiohttp.ClientSession, list[int]], Awaitable[tuple[float, float, float]]]
#: warms a pair with one handoff of a prompt and returns how to measure the next ones
Warm = Callable[[aiohttp.ClientSession, Engine, Engine, list[int]], Awaitable[Measure]]


def run_nixl_pair(conn: ct.Connector, label: str, place: ct.Placement, model_dir: Path, log_dir: Path,
                  dtype: str, sizes: list[int], repeats: int, add: Callable[[int, str, float], None],
                  warm: Warm) -> None:
    """One NIXL mode on a pair of its own: ``warm`` with a 64-token handoff, then per size a plain
    request on P and ``repeats`` handoffs, recorded as ``label``, ``label_xfer`` and ``label_handoff``."""
    p, d, _ = start_pair(conn, place, model_dir, log_dir, dtype)
    try:
        wait_healthy([p, d])

        async def measure() -> None:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                one = await warm(session, p, d, ct.prompt_ids(model_dir, 64))
                for n in sizes:
                    ids = ct.prompt_ids(model_dir, n)
                    await ct.post(session, p, body(ids))
                    for _ in range(repeats):
                        ttft, xfer, handoff = await one(session, ids)
                        add(n, label, ttft)
                        add(n, f"{label}_xfer", xfer)
                        add(n, f"{label}_handoff", handoff)

        asyncio.run(measure())
    finally:
        p.stop()
        d.stop()


def run_link(link: str, model_dir: Path, sizes: list[int], repeats: int, log_dir: Path,
             nixl: bool, dtype: str, nixl_push: bool = False) -> list[dict[str, Any]]:
    samples: dict[tuple[int, str], list[float]] = {}

    def add(n: int, what: str, value: float) -> None:
        samples.setdefault((n, what), []).append(value)

    with ct.LINKS[link]() as place:
        p, d, p_kv = start_pair(SOCKET, place, model_dir, log_dir, dtype)
        try:
            wait_healthy([p, d])

            async def measure() -> None:
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                    warm = ct.prompt_ids(model_dir, 64)
                    await fetch_ttft(session, p, d, SOCKET, warm)
                    await stream_ttft(session, p, d, p_kv, warm)
                    for n in sizes:
                        ids = ct.prompt_ids(model_dir, n)
                        await ct.post(session, p, body(ids))          # first use of this size: not measured
                        for r in range(repeats):
                            _, pre = await timed(ct.post(session, p, body(ids)))
                            add(n, "prefill", pre)
                            order = ("fetch", "stream") if r % 2 == 0 else ("stream", "fetch")
                            for mode in order:
                                if mode == "fetch":
                                    ttft, xfer, handoff = await fetch_ttft(session, p, d, SOCKET, ids)
                                    add(n, "fetch", ttft)
                                    add(n, "xfer", xfer)
                                    add(n, "fetch_handoff", handoff)
                                else:
                                    ttft, sxfer, handoff = await stream_ttft(session, p, d, p_kv, ids)
                                    add(n, "stream", ttft)
                                    add(n, "stream_xfer", sxfer)
                                    add(n, "stream_handoff", handoff)
                            print({k: [round(v * 1e3, 1) for v in vs] for (m, k), vs in samples.items() if m == n},
                                  flush=True)

            asyncio.run(measure())
        finally:
            p.stop()
            d.stop()
        if nixl:
            async def warm_nixl(session: aiohttp.ClientSession, p: Engine, d: Engine, ids: list[int]) -> Measure:
                await fetch_ttft(session, p, d, NIXL, ids)
                return lambda session, ids: fetch_ttft(session, p, d, NIXL, ids)

            run_nixl_pair(NIXL, "nixl", place, model_dir, log_dir, dtype, sizes, repeats, add, warm_nixl)
        if nixl_push:
            async def warm_push(session: aiohttp.ClientSession, p: Engine, d: Engine, ids: list[int]) -> Measure:
                peer = await push_peer(session, p, d, ids)
                return lambda session, ids: push_ttft(session, p, d, peer, ids)

            run_nixl_pair(NIXL_PUSH, "nixl_push", place, model_dir, log_dir, dtype, sizes, repeats, add, warm_push)
    rows = []
    for n in sizes:
        med = {what: statistics.median(vs) * 1e3 for (m, what), vs in samples.items() if m == n}
        spread = {what: [round(v * 1e3, 1) for v in vs] for (m, what), vs in samples.items() if m == n}
        rows.append({"link": link, "tokens": n, **med, **judged(med), "samples": spread})
        print(rows[-1], flush=True)
    return rows


def judged(med: dict[str, Any]) -> dict[str, float]:
    """A row's ``fixed``, its ``bound`` and the streamed TTFT's ratios to the bound and to the fetch's
    (module doc), from its medians (ms)."""
    if "fetch_handoff" in med:
        fixed = med["fetch_handoff"] - med["xfer"]
    else:
        fixed = med["fetch"] - med["prefill"] - med["xfer"]
    bound = 1.15 * max(med["prefill"], med["xfer"]) + fixed
    return {"fixed": fixed, "bound": bound, "stream_vs_bound": med["stream"] / bound,
            "stream_vs_fetch": med["stream"] / med["fetch"]}


def predicted(row: dict[str, Any], arch: ModelArch, dtype: str) -> dict[str, float]:
    """What ``disagg plan``'s arithmetic says of a row, from its measured prefill and transfer alone and
    the seeded figures (not the row's own), in ms: the handoff each mode adds to the prefill. A
    sequential handoff (pulled, or NIXL's push) adds decode's first step after the transfer
    (:func:`disagg.routecost.first_step_s`: the model's weights and the prompt's KV at the one-core CPU
    rate); a streamed one's measured fixed cost holds it."""
    x, p = row["xfer"], row["prefill"]
    step = first_step_s(arch.active_params * kv_dtype_bytes(dtype), arch.kv_bytes(row["tokens"], dtype),
                        FIRST_STEP_CPU_BYTES_PER_S) * 1e3
    out = {"plan_fetch": handoff_fixed_s("socket") * 1e3 + step + x,
           "plan_stream": handoff_fixed_s("socket", streaming=True) * 1e3 + exposed_transfer_s(x, p, arch.layers)}
    if "nixl_push_xfer" in row:
        out["plan_push"] = handoff_fixed_s("nixl-push") * 1e3 + step + row["nixl_push_xfer"]
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| link | tokens | prefill ms | xfer ms | fetch TTFT | stream TTFT | nixl TTFT | nixl push TTFT | "
            "fixed ms | bound ms | stream / bound | stream / fetch |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        r = {**row, **judged(row)}
        nixl, push = (f"{r[k]:.0f}" if k in r else "-" for k in ("nixl", "nixl_push"))
        out.append(f"| {r['link']} | {r['tokens']} | {r['prefill']:.0f} | {r['xfer']:.0f} | {r['fetch']:.0f} | "
                   f"{r['stream']:.0f} | {nixl} | {push} | {r['fixed']:.0f} | {r['bound']:.0f} | "
                   f"{r['stream_vs_bound']:.2f} | {r['stream_vs_fetch']:.2f} |")
    return "\n".join(out)


def measured_handoffs(row: dict[str, Any]) -> tuple[float, float]:
    """A row's (pulled, streamed) handoff in ms: what the split adds after P answered, measured within
    each request (``fetch_handoff``, ``stream_handoff``); rows of older runs, which lack them, fall
    back to TTFT - the prefill measured alone (a separate request, so its spread enters the figure)."""
    if "fetch_handoff" in row and "stream_handoff" in row:
        return row["fetch_handoff"], row["stream_handoff"]
    return row["fetch"] - row["prefill"], row["stream"] - row["prefill"]


def plan_table(rows: list[dict[str, Any]], arch: ModelArch, dtype: str) -> str:
    """Measured handoff (:func:`measured_handoffs`) per mode next to the plan's arithmetic, and vLLM's
    push connector's (P's answer to D's) where the rows have it."""
    push = all("nixl_push_handoff" in r for r in rows)
    head = ("| link | tokens | fetch handoff ms | plan | error | stream handoff ms | plan | error | "
            + ("push handoff ms | plan | error | " if push else "") + "stream TTFT | plan | error |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        plan = predicted(r, arch, dtype)
        got_f, got_s = measured_handoffs(r)
        ttft = r["prefill"] + plan["plan_stream"]
        pushed = (f"{r['nixl_push_handoff']:.0f} | {plan['plan_push']:.0f} | "
                  f"{plan['plan_push'] / r['nixl_push_handoff'] - 1:+.0%} | ") if push else ""
        out.append(f"| {r['link']} | {r['tokens']} | {got_f:.0f} | {plan['plan_fetch']:.0f} | "
                   f"{plan['plan_fetch'] / got_f - 1:+.0%} | {got_s:.0f} | {plan['plan_stream']:.0f} | "
                   f"{(plan['plan_stream'] - got_s) / abs(got_s) if got_s else float('nan'):+.0%} | {pushed}"
                   f"{r['stream']:.0f} | {ttft:.0f} | {ttft / r['stream'] - 1:+.0%} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--embedded", default="tiny-kvdeep", choices=sorted(EMBEDDED_MODELS))
    ap.add_argument("--links", default="1gbit,2.5gbit")
    ap.add_argument("--sizes", default="512,2048,8000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--nixl", action="store_true", help="also the sequential handoff with NIXL")
    ap.add_argument("--nixl-push", action="store_true",
                    help="also vLLM's push connector (NixlPushConnector), P and D at once")
    ap.add_argument("--dtype", default="float32",
                    help="the engines' --dtype (default float32: on a CPU without bf16 instructions, such as "
                         "AVX2-only ones, bf16 matmuls fall back to a path ~80x slower than fp32, and a bf16 "
                         "prefill then dwarfs any transfer); the KV cache has this dtype too")
    ap.add_argument("--json", type=Path, help="write the rows here too")
    ap.add_argument("--log-dir", type=Path, help="keep the engines' logs here (default: a temporary directory)")
    ap.add_argument("--render", type=Path, help="only print the tables of rows a --json run wrote")
    args = ap.parse_args(argv)
    if args.render:
        rows = json.loads(args.render.read_text())
        print(table(rows))
        print()
        print(plan_table(rows, embedded_arch(args.embedded), args.dtype))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="streaming-ttft-") as tmp:
        model_dir = build_model(args.embedded, Path(tmp) / args.embedded)
        print(f"load average before: {os.getloadavg()}", flush=True)
        rows: list[dict[str, Any]] = []
        for link in args.links.split(","):
            log_dir = args.log_dir or Path(tmp)
            log_dir.mkdir(parents=True, exist_ok=True)
            rows += run_link(link, model_dir, sizes, args.repeats, log_dir, args.nixl, args.dtype, args.nixl_push)
        print(f"load average after: {os.getloadavg()}", flush=True)
    print(table(rows))
    print()
    print(plan_table(rows, embedded_arch(args.embedded), args.dtype))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

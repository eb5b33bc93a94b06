"""NIXL vs the socket connector: KV handoff time and bytes/s, side by side.

For each connector the same 1P1D pair of real vLLM CPU engines (every process
of P pinned to core 0, of D to core 1: :func:`pin`; prefix caching off) serves prompts of each size (exact
token counts, sent as token ids): P prefills with ``max_tokens: 1`` and
``do_remote_decode``, then D gets P's ``kv_transfer_params`` and generates one
token. P caches prefixes (each prompt is prefilled once, before its repeats);
D does not, so every repeat moves the whole prompt's KV. Reported per row
(median of ``--repeats``, after one small warm-up handoff):

- ``xfer ms``: the connector's own transfer time from D's /metrics
  (NIXL: ``vllm:nixl_xfer_time_seconds``, the READ only; socket:
  ``vllm:socket_kv_xfer_seconds``, connect + HMAC + data + release);
- ``wire MB``: the bytes D received (socket: ``vllm:socket_kv_bytes_received_total``;
  NIXL: the KV's size); ``socket-fp8`` is the socket connector with
  ``wire_format: fp8``, whose xfer time includes P's quantizing and D's
  dequantizing (both happen inside the fetch);
- ``MB/s``: wire bytes / xfer time;
- ``D ms``: D's whole request (schedule, fetch, last-token step), the
  handoff as a client sees it.

Links: ``loopback`` (both engines on this host's loopback) and ``1gbit`` /
``2.5gbit``: P runs in a network namespace of its own behind a veth pair
shaped with ``tc tbf`` at that rate in both directions
(:class:`disagg.linkemu.EmulatedLink`, as ``link: {type: emulated}`` in a
topology), D stays in the root namespace, and all KV traffic crosses the
shaped veth (NIXL: ``UCX_NET_DEVICES`` names each side's veth). Emulated
links need root. ``% of link`` is MB/s over the shaped rate.

``--decode-tpot N``: after the sizes, a streamed answer of 1,500 tokens runs on
D (a short plain prompt) while N handoffs of the largest size arrive one after
the other; its inter-token gaps are split into those that overlap a handoff's
D request and the others, so the effect of receiving KV (and, for
``socket-fp8``, of D's dequantizing on its one core) on the decodes running
there shows as ``TPOT during / outside handoffs`` (second table).

Each engine's ``--kv-transfer-config`` and env come from the planner's own
connector adapters (``disagg/kv/``), as ``disagg up`` would start them
(:func:`planned_engines`); ``--socket-extra`` adds settings to the socket
connector's for A/B runs.

Run (holds the engine lock; ~25 min for all three links)::

    flock /tmp/disagg-engines.lock .venv/bin/python benchmarks/connector_throughput.py \\
        --embedded tiny-kvheavy --links loopback,1gbit,2.5gbit
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from disagg.launch.launcher import per_run_env
from disagg.linkemu import EmulatedLink
from disagg.modelgen import EMBEDDED_MODELS, build_model
from disagg.registry import vllm_kv_adapter
from disagg.topology import HostSpec, InstanceSpec, LinkSpec, ModelSpec, Topology

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: harness
from harness.vllm_pair import Engine, free_port, metric, start_engine, wait_healthy

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass(frozen=True)
class Connector:
    """One connector under test: its topology name and the D-side metrics of its transfers."""

    name: str  # the topology's ``connector:`` value
    xfer_seconds: str  # D-side metric: total seconds
    xfer_count: str  # D-side metric: number of transfers
    wire_format: str = "raw"  # the topology's ``connector.wire_format``
    wire_bytes: str | None = None  # D-side metric: bytes received (None: the KV's size is what moves)

    @property
    def label(self) -> str:
        return self.name if self.wire_format == "raw" else f"{self.name}-{self.wire_format}"


_SOCKET = ("vllm:socket_kv_xfer_seconds_total", "vllm:socket_kv_transfers_total")
CONNECTORS = {
    "nixl": Connector("nixl", "vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_xfer_time_seconds_count"),
    "socket": Connector("socket", *_SOCKET, wire_bytes="vllm:socket_kv_bytes_received_total"),
    "socket-fp8": Connector("socket", *_SOCKET, wire_format="fp8", wire_bytes="vllm:socket_kv_bytes_received_total"),
}


def planned_engines(connector: str, place: Placement, p_port: int, d_port: int,
                    socket_extra: dict[str, Any] | None = None, wire_format: str = "raw"
                    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, str], dict[str, str]]:
    """P's and D's ``--kv-transfer-config`` and env, as ``disagg up`` plans them for this placement.

    The planner sees a plain Ethernet link between P (core 0) and D (core 1);
    the benchmark shapes it itself, so it names the veth devices for UCX. The
    socket connector's secret comes from the launcher's per-run env.
    """
    hosts = {"p": HostSpec("p", place.p_host), "d": HostSpec("d", place.d_host)}
    p_inst = InstanceSpec("prefill", 0, "p", 0, p_port, cpus=(0,))
    d_inst = InstanceSpec("decode", 0, "d", 0, d_port, cpus=(1,))
    topo = Topology(file="<connector_throughput>", name="bench", model=ModelSpec("bench", "bench", None),
                    engine="vllm", connector=connector,
                    link=LinkSpec("loopback" if place.rate_bps is None else "ethernet"),
                    hosts=hosts, instances=(p_inst, d_inst), wire_format=wire_format)
    adapter = vllm_kv_adapter(connector)
    configs = [adapter.transfer_config(topo, inst, hosts[inst.host]) for inst in (p_inst, d_inst)]
    envs = [adapter.env(topo, inst, hosts[inst.host]) for inst in (p_inst, d_inst)]
    run_env = per_run_env(topo)
    for env, device in zip(envs, (place.p_device, place.d_device), strict=True):
        env.update(run_env)
        if connector == "nixl" and device:
            env["UCX_NET_DEVICES"] = device
    if connector == "socket":
        for cfg in configs:
            cfg["kv_connector_extra_config"].update(socket_extra or {})
    return configs[0], configs[1], envs[0], envs[1]


@dataclass(frozen=True)
class Placement:
    """Where the two engines run on a link: addresses, UCX devices and P's command wrapper."""

    p_host: str
    d_host: str
    rate_bps: float | None = None  # None: unshaped
    p_wrap: Callable[[list[str]], list[str]] | None = None
    p_device: str | None = None
    d_device: str | None = None

    def p_argv(self, argv: list[str]) -> list[str]:
        """P's command: pinned to core 0, then wrapped for its namespace (emulated links)."""
        pinned = pin(0, argv)
        return self.p_wrap(pinned) if self.p_wrap is not None else pinned

    def d_argv(self, argv: list[str]) -> list[str]:
        """D's command: pinned to core 1."""
        return pin(1, argv)


def pin(core: int, argv: list[str]) -> list[str]:
    """``argv`` with every process and thread of the engine on ``core`` (its API server and engine
    core loop too, not only the model's threads as ``VLLM_CPU_OMP_THREADS_BIND`` does): each engine
    gets one core as if it had a machine of its own. Unpinned, a decode engine waiting for KV spins
    its engine core loop on whichever core is free, which here is often the prefill's, and the
    conversions of ``socket-fp8`` share a core with the other engine's loop."""
    return ["taskset", "-c", str(core), *argv]


@contextlib.contextmanager
def loopback() -> Iterator[Placement]:
    """Both engines on this host's loopback."""
    yield Placement("127.0.0.1", "127.0.0.1")


def emulated(rate_bps: float) -> Callable[[], contextlib.AbstractContextManager[Placement]]:
    """P in a namespace behind a tbf-shaped veth at ``rate_bps``, D in the root namespace."""

    @contextlib.contextmanager
    def link() -> Iterator[Placement]:
        with EmulatedLink(rate_bps, b_in_root=True) as emu:
            yield Placement(emu.a.address, emu.b.address, rate_bps, lambda argv: emu.wrap("a", argv),
                            emu.a.interface, emu.b.interface)

    return link


#: link name -> context manager giving the engines' placement.
LINKS: dict[str, Callable[[], contextlib.AbstractContextManager[Placement]]] = {
    "loopback": loopback, "1gbit": emulated(1e9), "2.5gbit": emulated(2.5e9)}


def prompt_ids(model_dir: Path, n: int) -> list[int]:
    """Exactly ``n`` token ids of varied text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    lines = n // 8 + 16
    while True:
        text = " ".join(f"Line {i}: a quiet harbour keeps {i % 13} boats and {i % 7} gulls." for i in range(lines))
        ids = tok(text).input_ids
        if len(ids) >= n:
            return ids[:n]
        lines *= 2


async def post(session: aiohttp.ClientSession, eng: Engine, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> dict[str, Any]:
    async with session.post(eng.url + "/v1/completions", json=body, headers=headers,
                            timeout=aiohttp.ClientTimeout(total=600)) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"{eng.name}: HTTP {r.status}: {data}\n{eng.log_tail()}")
        return data


async def one_handoff(session: aiohttp.ClientSession, p: Engine, d: Engine, conn: Connector,
                      ids: list[int]) -> tuple[float, float, float | None]:
    """One P->D handoff; returns (connector transfer seconds, D request seconds, bytes D received
    when the connector counts them)."""
    body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0}
    pre = await post(session, p, {**body, "kv_transfer_params": dict(REMOTE_DECODE)})
    secs0, n0 = metric(d.url, conn.xfer_seconds), metric(d.url, conn.xfer_count)
    bytes0 = metric(d.url, conn.wire_bytes) if conn.wire_bytes else None
    started = time.perf_counter()
    await post(session, d, {**body, "kv_transfer_params": pre["kv_transfer_params"]})
    d_secs = time.perf_counter() - started
    deadline = time.monotonic() + 15
    while metric(d.url, conn.xfer_count) <= n0:  # stats reach /metrics a step later
        if time.monotonic() > deadline:
            raise RuntimeError(f"{conn.name}: no transfer recorded on D\n{d.log_tail()}")
        await asyncio.sleep(0.2)
    moved = None if bytes0 is None or conn.wire_bytes is None else metric(d.url, conn.wire_bytes) - bytes0
    return metric(d.url, conn.xfer_seconds) - secs0, d_secs, moved


async def decode_tpot_under_handoffs(session: aiohttp.ClientSession, p: Engine, d: Engine, conn: Connector,
                                     ids: list[int], handoffs: int) -> dict[str, Any]:
    """A 1,500-token streamed answer on D while ``handoffs`` handoffs of ``ids`` arrive one after the
    other: its mean inter-token gap during and outside the handoffs' D requests."""
    windows: list[tuple[float, float]] = []
    chunks: list[float] = []

    async def stream() -> None:
        body = {"model": "tiny", "prompt": "Tell a long story.", "max_tokens": 1500, "ignore_eos": True,
                "temperature": 0, "stream": True}
        async with session.post(d.url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=600)) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    chunks.append(time.perf_counter())

    async def handoff_train() -> None:
        while len(chunks) < 20:                     # decoding steadily first
            await asyncio.sleep(0.01)
        for _ in range(handoffs):
            pre = await post(session, p, {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0,
                                          "kv_transfer_params": dict(REMOTE_DECODE)})
            started = time.perf_counter()
            await post(session, d, {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0,
                                    "kv_transfer_params": pre["kv_transfer_params"]})
            windows.append((started, time.perf_counter()))
            await asyncio.sleep(0.3)                # gaps outside any handoff in between

    await asyncio.gather(stream(), handoff_train())
    during, outside = [], []
    for a, b in itertools.pairwise(chunks[20:]):
        (during if any(a < end and b > start for start, end in windows) else outside).append(b - a)
    return {"connector": conn.label, "tokens": len(ids), "handoffs": len(windows),
            "tpot_during_ms": statistics.mean(during) * 1e3 if during else None,
            "tpot_outside_ms": statistics.mean(outside) * 1e3 if outside else None,
            "gaps_during": len(during), "gaps_outside": len(outside)}


def run_connector(conn: Connector, link: str, model_dir: Path, sizes: list[int], repeats: int,
                  kv_bytes_per_token: int, log_dir: Path,
                  socket_extra: dict[str, Any] | None = None, decode_tpot: int = 0,
                  tpot_rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    rows = []
    with LINKS[link]() as place:
        p_cfg, d_cfg, p_env, d_env = planned_engines(conn.name, place, free_port(), free_port(), socket_extra,
                                                     conn.wire_format)
        max_len = 8192  # the embedded models' max_position_embeddings
        # P caches prefixes, so repeats skip the (slow, O(n^2) on one core) prefill; the
        # handoff still moves every block. D must not, or it would not fetch at all.
        p = start_engine(f"{conn.label}-prefill", str(model_dir), 0, p_cfg, p_env, log_dir, max_model_len=max_len,
                         prefix_caching=True, host=place.p_host, wrap=place.p_argv)
        d = start_engine(f"{conn.label}-decode", str(model_dir), 1, d_cfg, d_env, log_dir, max_model_len=max_len,
                         wrap=place.d_argv)
        try:
            wait_healthy([p, d])

            async def measure() -> None:
                # force_close: uvicorn drops idle keep-alive connections after 5 s, and a reused
                # one can die under the next request (ServerDisconnectedError)
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                    await one_handoff(session, p, d, conn, prompt_ids(model_dir, 64))  # warm-up: handshakes
                    for n in sizes:
                        ids = prompt_ids(model_dir, n)
                        await post(session, p, {"model": "tiny", "prompt": ids, "max_tokens": 1})  # fill P's cache
                        samples = [await one_handoff(session, p, d, conn, ids) for _ in range(repeats)]
                        xfer = statistics.median(s[0] for s in samples)
                        d_ms = statistics.median(s[1] for s in samples)
                        nbytes = n * kv_bytes_per_token
                        moved = [s[2] for s in samples if s[2] is not None]
                        wire = statistics.median(moved) if moved else nbytes
                        mb_s = wire / 1e6 / xfer if xfer else 0.0
                        rows.append({"link": link, "connector": conn.label, "tokens": n, "MB": nbytes / 1e6,
                                     "wire_MB": wire / 1e6,
                                     "xfer_ms": xfer * 1e3, "MB_s": mb_s,
                                     "link_pct": 100 * mb_s * 8e6 / place.rate_bps if place.rate_bps else None,
                                     "d_ms": d_ms * 1e3, "samples_ms": [round(s[0] * 1e3, 1) for s in samples]})
                        print(rows[-1], flush=True)
                    if decode_tpot and tpot_rows is not None:
                        tpot = await decode_tpot_under_handoffs(session, p, d, conn, prompt_ids(model_dir, max(sizes)),
                                                                decode_tpot)
                        tpot_rows.append({"link": link, **tpot})
                        print(tpot_rows[-1], flush=True)

            asyncio.run(measure())
        finally:
            p.stop()
            d.stop()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a Markdown table, connectors side by side per size."""
    lines = ["| link | tokens | KV MB | connector | wire MB | xfer ms | MB/s (wire) | % of link | D request ms "
             "| xfer samples ms |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    order = list(LINKS)
    for r in sorted(rows, key=lambda r: (order.index(r["link"]), r["tokens"], r["connector"])):
        pct = "-" if r["link_pct"] is None else f"{r['link_pct']:.0f}%"
        samples = ", ".join(f"{v:g}" for v in r["samples_ms"])
        lines.append(f"| {r['link']} | {r['tokens']} | {r['MB']:.1f} | {r['connector']} | {r['wire_MB']:.1f} "
                     f"| {r['xfer_ms']:.1f} "
                     f"| {r['MB_s']:.0f} | {pct} | {r['d_ms']:.1f} | {samples} |")
    return "\n".join(lines)


def tpot_table(rows: list[dict[str, Any]]) -> str:
    """The decode-under-handoffs rows as a Markdown table."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = ["| link | connector | handoff tokens | handoffs | TPOT during ms (gaps) | TPOT outside ms (gaps) "
             "| ratio |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = (f"{r['tpot_during_ms'] / r['tpot_outside_ms']:.2f}"
                 if r["tpot_during_ms"] and r["tpot_outside_ms"] else "-")
        lines.append(f"| {r['link']} | {r['connector']} | {r['tokens']} | {r['handoffs']} "
                     f"| {ms(r['tpot_during_ms'])} ({r['gaps_during']}) | {ms(r['tpot_outside_ms'])} "
                     f"({r['gaps_outside']}) | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--embedded", default="tiny-kvheavy", choices=sorted(EMBEDDED_MODELS))
    ap.add_argument("--model-dir", type=Path, help="where to build the model (default: a temp dir)")
    ap.add_argument("--connectors", default="nixl,socket", help=f"comma list of {', '.join(CONNECTORS)}")
    ap.add_argument("--links", default="loopback", help=f"comma list of {', '.join(LINKS)}")
    ap.add_argument("--sizes", default="512,2048,8000", help="prompt tokens (< 8192, the models' context)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, help="append the Markdown table here")
    ap.add_argument("--decode-tpot", type=int, default=0, metavar="N",
                    help="also: TPOT of a decode running on D while N handoffs of the largest size arrive")
    ap.add_argument("--socket-extra", type=json.loads, default=None, metavar="JSON",
                    help='extra kv_connector_extra_config for both socket engines, e.g. \'{"idle_wait_ms": 0}\'')
    args = ap.parse_args(argv)
    # `kill` (SIGTERM) unwinds like Ctrl-C: engines stopped, namespaces removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cfg = EMBEDDED_MODELS[args.embedded]
    kv_bytes = 2 * cfg.layers * cfg.kv_heads * cfg.head_dim * 2
    work = Path(tempfile.mkdtemp(prefix="connector-bench-"))
    model_dir = args.model_dir or work / args.embedded
    if not (model_dir / "config.json").exists():
        build_model(args.embedded, model_dir)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: list[dict[str, Any]] = []
    tpot_rows: list[dict[str, Any]] = []
    for link in args.links.split(","):
        if link not in LINKS:
            print(f"link {link!r} not available here (have: {', '.join(LINKS)})", file=sys.stderr)
            return 2
        for name in args.connectors.split(","):
            rows += run_connector(CONNECTORS[name], link, model_dir, sizes, args.repeats, kv_bytes, work,
                                  args.socket_extra, args.decode_tpot, tpot_rows)
    out = table(rows)
    if tpot_rows:
        out += "\n\n" + tpot_table(tpot_rows)
    print(out)
    if args.out:
        with args.out.open("a") as f:
            f.write(out + "\n")
    print(f"engine logs: {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

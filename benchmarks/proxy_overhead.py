"""What the proxy adds: TTFT and per-token latency, proxy vs direct, and the
most streamed requests per second the proxy serves on one core.

A trivially fast stand-in upstream (raw asyncio HTTP/1.1, chunked SSE) streams
``max_tokens`` events, each stamped with ``time.monotonic()`` when written; the
client measures against the same clock, so per-token latency is
upstream-write -> client-read. The proxy is ``python -m disagg proxy
--decode UPSTREAM`` (colocated mode: the same relay path as the decode leg of
a handoff) pinned with ``taskset`` to one core; the upstream and the client
share the other core.

    python benchmarks/proxy_overhead.py [--requests 300] [--tokens 32]
        [--interval-ms 5] [--concurrency 64] [--duration 10] [--proxy-cpu 0] [--other-cpu 1]
        [--loop auto|asyncio|uvloop]

Prints a Markdown table (the figures in docs/proxy.md come from it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------- upstream

class StandInUpstream(asyncio.Protocol):
    """A minimal keep-alive HTTP/1.1 server: GET /health -> 200; POST -> SSE of
    ``max_tokens`` events, ``interval_ms`` apart (0: all at once)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                key, _, value = line.partition(":")
                if key.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            if head.split(" ", 2)[1] == "/health":
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                continue
            params = json.loads(body) if body else {}
            tokens, interval = int(params.get("max_tokens", 16)), float(params.get("interval_ms", 0)) / 1000
            head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")
            if interval:
                self.transport.write(head)
                asyncio.get_running_loop().create_task(self.paced(tokens, interval))
            else:
                self.transport.write(head + b"".join(self.event(i) for i in range(tokens)) + self.done())

    @staticmethod
    def event(i: int) -> bytes:
        data = b'data: {"id":"b","object":"text_completion","choices":[{"index":0,"text":"t%d",' \
               b'"finish_reason":null}],"t":%.9f}\n\n' % (i, time.monotonic())
        return b"%x\r\n%s\r\n" % (len(data), data)

    @staticmethod
    def done() -> bytes:
        data = b"data: [DONE]\n\n"
        return b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)

    async def paced(self, tokens: int, interval: float) -> None:
        for i in range(tokens):
            if self.transport.is_closing():
                return
            self.transport.write(self.event(i))
            await asyncio.sleep(interval)
        self.transport.write(self.done())


async def serve_upstream(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(StandInUpstream, "127.0.0.1", port, backlog=1024)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async with server:
        await stop.wait()


# ----------------------------------------------------------------------- client

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def latency(url: str, requests: int, tokens: int, interval_ms: float) -> tuple[list[float], list[float]]:
    """Sequential streamed requests: TTFTs and per-token latencies (upstream write -> client read), seconds."""
    ttfts: list[float] = []
    token_lat: list[float] = []
    body = {"model": "x", "prompt": "x", "stream": True, "max_tokens": tokens, "interval_ms": interval_ms}
    async with aiohttp.ClientSession() as http:
        for i in range(requests + 20):
            sent = time.monotonic()
            first = None
            lats = []
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, resp.status
                async for line in resp.content:
                    now = time.monotonic()
                    if not line.startswith(b"data: {"):
                        continue
                    if first is None:
                        first = now - sent
                    lats.append(now - json.loads(line[6:])["t"])
            if i >= 20:  # warm-up excluded
                ttfts.append(first or 0.0)
                token_lat.extend(lats[1:])
    return ttfts, token_lat


async def throughput(port: int, concurrency: int, duration: float, tokens: int) -> tuple[float, int]:
    """Requests/s of ``concurrency`` keep-alive raw-socket clients streaming ``tokens`` events each."""
    body = json.dumps({"model": "x", "prompt": "x", "stream": True, "max_tokens": tokens}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    done = 0
    errors = 0
    deadline = time.monotonic() + duration

    async def worker() -> None:
        nonlocal done, errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while time.monotonic() < deadline:
            writer.write(request)
            buf = b""
            while not buf.endswith(b"\r\n0\r\n\r\n"):
                chunk = await reader.read(65536)
                if not chunk:
                    raise ConnectionError("server closed the connection")
                buf += chunk
            if buf.startswith(b"HTTP/1.1 200") and b"[DONE]" in buf:
                done += 1
            else:
                errors += 1
        writer.close()

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.monotonic() - started), errors


# ------------------------------------------------------------------------- main

def start(argv: list[str], cpu: int, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["taskset", "-c", str(cpu), *argv], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def wait_health(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                async with http.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit(f"{url}/health not 200 within {timeout}s")


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f}"


async def bench(args: argparse.Namespace) -> None:
    os.sched_setaffinity(0, {args.other_cpu})
    up_port, proxy_port = free_port(), free_port()
    upstream = start([sys.executable, __file__, "--serve-upstream", str(up_port)], args.other_cpu)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proxy = start([sys.executable, "-m", "disagg", "proxy", "--port", str(proxy_port),
                   "--decode", f"http://127.0.0.1:{up_port}", "--loop", args.loop], args.proxy_cpu, env)
    direct_url, proxy_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{proxy_port}"
    try:
        await wait_health(direct_url)
        await wait_health(proxy_url)
        rows = []
        results = {}
        proxy_ps = psutil.Process(proxy.pid)  # taskset execs: this is the proxy's python process
        events = (args.requests + 20) * args.tokens
        cpu_per_event = {}
        for name, url in (("direct", direct_url), ("proxy", proxy_url)):
            me, them = resource.getrusage(resource.RUSAGE_SELF), sum(proxy_ps.cpu_times()[:2])
            results[name] = await latency(url, args.requests, args.tokens, args.interval_ms)
            after = resource.getrusage(resource.RUSAGE_SELF)
            client_cpu = after.ru_utime + after.ru_stime - me.ru_utime - me.ru_stime
            cpu_per_event[name] = (client_cpu / events, (sum(proxy_ps.cpu_times()[:2]) - them) / events)
        for name in ("direct", "proxy"):
            ttft, tok = results[name]
            rows.append((name, pct(ttft, 0.5), pct(ttft, 0.99), pct(tok, 0.5), pct(tok, 0.99)))
        d, p = rows
        rows.append(("added by proxy", *(pv - dv for pv, dv in zip(p[1:], d[1:], strict=True))))

        target = proxy_ps
        direct_rps, _ = await throughput(up_port, args.concurrency, args.duration, args.stream_tokens)
        cpu_before = sum(target.cpu_times()[:2])
        t0 = time.monotonic()
        proxy_rps, errors = await throughput(proxy_port, args.concurrency, args.duration, args.stream_tokens)
        cpu_share = (sum(target.cpu_times()[:2]) - cpu_before) / (time.monotonic() - t0)
    finally:
        for proc in (proxy, upstream):
            proc.send_signal(signal.SIGTERM)
        for proc in (proxy, upstream):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    print(f"# proxy overhead ({platform.machine()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}; python {platform.python_version()}, aiohttp {aiohttp.__version__}, "
          f"proxy --loop {args.loop})\n")
    print(f"Latency: {args.requests} sequential streamed requests per target (after 20 warm-up), "
          f"{args.tokens} tokens {args.interval_ms} ms apart; times in ms.\n")
    print("| target | TTFT p50 | TTFT p99 | per-token p50 | per-token p99 |")
    print("|---|---|---|---|---|")
    for name, *vals in rows:
        print(f"| {name} | " + " | ".join(fmt_ms(v) for v in vals) + " |")
    print(f"\nCPU time per streamed event in those runs: client {fmt_ms(cpu_per_event['direct'][0])} ms "
          f"(direct), proxy process {fmt_ms(cpu_per_event['proxy'][1])} ms (proxied).")
    print(f"\nThroughput: {args.concurrency} concurrent keep-alive clients, {args.stream_tokens} events per "
          f"stream, {args.duration} s; proxy pinned to CPU {args.proxy_cpu}, upstream + client on CPU "
          f"{args.other_cpu}.\n")
    print("| target | streamed requests/s | errors | proxy CPU (cores) |")
    print("|---|---|---|---|")
    print(f"| direct (client + upstream ceiling) | {direct_rps:.0f} | - | - |")
    print(f"| proxy on one core | {proxy_rps:.0f} | {errors} | {cpu_share:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per stream in the latency runs")
    parser.add_argument("--interval-ms", type=float, default=5.0, help="gap between tokens in the latency runs")
    parser.add_argument("--stream-tokens", type=int, default=16, help="tokens per stream in the throughput run")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--proxy-cpu", type=int, default=0)
    parser.add_argument("--other-cpu", type=int, default=1)
    parser.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"),
                        help="the proxy's event loop (auto: uvloop when installed)")
    parser.add_argument("--serve-upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        asyncio.run(serve_upstream(args.serve_upstream))
    else:
        asyncio.run(bench(args))


if __name__ == "__main__":
    main()

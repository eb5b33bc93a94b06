"""The probe-link agent: a small TCP throughput/RTT sender and receiver.

Runs on each end of the link (locally, inside a namespace, or over SSH as
``python -m disagg._probe_agent ...``) and uses only the standard library.

``serve --bind ADDR [--port 0]``
    Listens, prints ``PROBE-READY <port>`` on stdout, then serves until its
    stdin closes (the parent or the SSH session went away), a quit request,
    or ``--idle-timeout`` seconds without a connection. Each connection
    starts with one mode byte: ``T`` reads (``recv_into`` a preallocated
    buffer) until EOF and answers the byte count as 8 bytes big-endian;
    ``E`` echoes single bytes (round-trip pings); ``Q`` stops the server.

``send --host ADDR --port P [--streams 1,2,4] [--seconds 3] [--pings 20]``
    For each stream count: opens that many connections, writes 1 MiB chunks
    on each for ``--seconds``, half-closes, and waits for every byte count;
    rate = bytes received x 8 / (first write .. last count). Then the median
    of ``--pings`` one-byte round trips. Prints one JSON line:
    ``{"streams_bps": {"1": ..., ...}, "rtt_s": ...}``.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time

CHUNK = 1 << 20
READY = "PROBE-READY"
MODE_THROUGHPUT, MODE_ECHO, MODE_QUIT = b"T", b"E", b"Q"


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("connection closed early")
        data += part
    return data


def _serve_connection(conn: socket.socket, stop: threading.Event) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = conn.recv(1)
        if mode == MODE_THROUGHPUT:
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            total = 0
            while True:
                n = conn.recv_into(view)
                if n == 0:
                    break
                total += n
            conn.sendall(total.to_bytes(8, "big"))
        elif mode == MODE_ECHO:
            while True:
                b = conn.recv(1)
                if not b:
                    break
                conn.sendall(b)
        elif mode == MODE_QUIT:
            stop.set()


def serve(bind: str, port: int, idle_timeout: float) -> int:
    """Run the receiver until stdin closes, a quit request, or idle_timeout."""
    stop = threading.Event()
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind((bind, port))
        except OSError as exc:
            print(f"probe agent: cannot listen on {bind}:{port}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        srv.listen(16)
        srv.settimeout(0.2)
        print(f"{READY} {srv.getsockname()[1]}", flush=True)

        def watch_stdin() -> None:
            sys.stdin.read()
            stop.set()

        threading.Thread(target=watch_stdin, daemon=True).start()
        last = time.monotonic()
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                if time.monotonic() - last > idle_timeout:
                    break
                continue
            last = time.monotonic()
            threading.Thread(target=_serve_connection, args=(conn, stop), daemon=True).start()
    return 0


def _connect(host: str, port: int, mode: bytes) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(mode)
    return sock


def throughput(host: str, port: int, streams: int, seconds: float) -> float:
    """Payload bits per second with ``streams`` parallel connections."""
    socks = [_connect(host, port, MODE_THROUGHPUT) for _ in range(streams)]
    for s in socks:
        s.settimeout(seconds + 30)
    payload = memoryview(bytes(CHUNK))
    counts = [0] * streams
    errors: list[BaseException] = []
    start = time.perf_counter()
    deadline = start + seconds

    def pump(i: int) -> None:
        try:
            s = socks[i]
            while time.perf_counter() < deadline:
                s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            counts[i] = int.from_bytes(_recv_exact(s, 8), "big")
        except (OSError, ConnectionError) as exc:
            errors.append(exc)

    threads = [threading.Thread(target=pump, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    for s in socks:
        s.close()
    if errors:
        raise errors[0]
    return sum(counts) * 8 / elapsed


def rtt(host: str, port: int, pings: int) -> float:
    """Median round-trip time of one-byte pings, in seconds."""
    with _connect(host, port, MODE_ECHO) as s:
        s.settimeout(10)
        samples = []
        for _ in range(pings):
            t0 = time.perf_counter()
            s.sendall(b"x")
            _recv_exact(s, 1)
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def send(host: str, port: int, streams: list[int], seconds: float, pings: int) -> int:
    """Measure and print one JSON line; exit status 1 with a message on failure."""
    try:
        rates = {str(n): throughput(host, port, n, seconds) for n in streams}
        result = {"streams_bps": rates, "rtt_s": rtt(host, port, pings)}
    except OSError as exc:
        print(f"probe agent: {host}:{port}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m disagg._probe_agent``."""
    p = argparse.ArgumentParser(prog="python -m disagg._probe_agent")
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--bind", required=True)
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--idle-timeout", type=float, default=120.0)
    c = sub.add_parser("send")
    c.add_argument("--host", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--streams", default="1,2,4")
    c.add_argument("--seconds", type=float, default=3.0)
    c.add_argument("--pings", type=int, default=20)
    args = p.parse_args(argv)
    if args.mode == "serve":
        return serve(args.bind, args.port, args.idle_timeout)
    return send(args.host, args.port, [int(x) for x in args.streams.split(",")], args.seconds, args.pings)


if __name__ == "__main__":
    raise SystemExit(main())

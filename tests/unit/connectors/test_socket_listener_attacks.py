"""The prefill listener (and the decode client) against peers that are not what they claim.

Short timeouts throughout: each case would hold a thread for the socket's
I/O timeout or longer without the protection it checks.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from disagg_connectors.socket_connector import server as server_mod
from disagg_connectors.socket_connector.auth import MAGIC, NONCE_BYTES, AuthError, client_handshake, listener_id
from disagg_connectors.socket_connector.client import FetchError, FetchOptions, FetchPlan, connect, fetch
from disagg_connectors.socket_connector.counters import TransferCounters
from disagg_connectors.socket_connector.layout import make_store
from disagg_connectors.socket_connector.leases import LeaseTable
from disagg_connectors.socket_connector.server import MAX_BLOCKS_PER_MESSAGE, KVServer
from disagg_connectors.socket_connector.wire import recv_exact, recv_frame, recv_into_views, send_frame

from tests.unit.connectors.kvdata import NUM_BLOCKS, SECRET, eventually, kv_caches


@pytest.fixture
def logs() -> Iterator[list[str]]:
    """Warning lines of the listener (captured on its own logger: vLLM's setup may stop propagation)."""
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("disagg_connectors.socket_connector.server")
    log.addHandler(handler)
    yield lines
    log.removeHandler(handler)


@pytest.fixture
def make_server() -> Iterator:
    servers: list[KVServer] = []

    def make(**kwargs) -> tuple[KVServer, dict[str, torch.Tensor]]:
        caches = kv_caches(7)
        opts = {"registration_wait_s": 0.2, "io_timeout_s": 5, "counters": TransferCounters(), **kwargs}
        srv = KVServer(make_store(caches, NUM_BLOCKS), LeaseTable(), SECRET, "127.0.0.1", 0, **opts)
        srv.start()
        servers.append(srv)
        return srv, caches

    yield make
    for srv in servers:
        srv.close()


def refused(srv: KVServer) -> int:
    return len((srv.counters.drain() or {}).get("num_refused", []))


def closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """True if the peer closes ``sock`` (EOF or reset) within ``timeout_s``, reading whatever comes first."""
    sock.settimeout(timeout_s)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if not sock.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def fetch_works(srv: KVServer, rid: str = "ok-req") -> None:
    srv.leases.register(rid, [1, 2], 30)
    store = make_store(kv_caches(0, fill=False), NUM_BLOCKS)
    res = fetch(FetchPlan("127.0.0.1", srv.port, rid, [1, 2], [3, 4]), SECRET, store, FetchOptions(io_timeout_s=5))
    assert res.nbytes == 2 * store.layout.block_bytes


# -- before authentication ------------------------------------------------------

def test_connections_over_the_pre_auth_cap_are_closed_at_once(make_server, logs) -> None:
    srv, _ = make_server(max_pending_handshakes=2, handshake_timeout_s=10, io_timeout_s=10)
    idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(2)]
    for s in idle:  # each got its challenge: both hold a handshake slot, saying nothing
        assert recv_exact(s, len(MAGIC) + NONCE_BYTES)[:4] == MAGIC
    assert srv.pending_handshakes == 2
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as extra:
        assert closed_by_peer(extra, 2)  # no challenge, just closed
    assert time.monotonic() - started < 1.5
    assert eventually(lambda: any("max_pending_handshakes" in line for line in logs), True), logs
    assert eventually(lambda: refused(srv) >= 1, True)
    for s in idle:
        s.close()
    assert eventually(lambda: srv.pending_handshakes, 0) == 0  # slots come back when the peers leave
    fetch_works(srv)


def test_a_slow_loris_is_cut_off_at_the_handshake_deadline(make_server, logs) -> None:
    """One byte every 0.1 s never trips the 5 s per-read timeout; the 0.5 s handshake deadline ends it."""
    srv, _ = make_server(handshake_timeout_s=0.5, io_timeout_s=5)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        recv_exact(s, len(MAGIC) + NONCE_BYTES)
        started = time.monotonic()
        cut = False
        for _ in range(60):  # 60 of the 64 bytes the answer needs, over 6 s
            try:
                s.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            s.settimeout(0.1)
            try:
                if s.recv(1) == b"":
                    cut = True
                    break
            except ConnectionResetError:   # closed with our bytes unread: the kernel resets, as for sendall
                cut = True
                break
            except TimeoutError:
                pass
        took = time.monotonic() - started
    assert cut and took < 2, took
    assert eventually(lambda: srv.pending_handshakes, 0) == 0
    assert eventually(lambda: any("handshake" in line and "deadline" in line for line in logs), True), logs
    fetch_works(srv)


def test_the_client_gives_a_trickling_listener_one_handshake_deadline() -> None:
    """A fake listener sending its greeting a byte at a time: the decode side gives up after the deadline."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            for b in MAGIC + bytes(NONCE_BYTES):
                if stop.wait(0.1):
                    return
                try:
                    conn.sendall(bytes([b]))
                except OSError:
                    return

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    store = make_store(kv_caches(0, fill=False), NUM_BLOCKS)
    started = time.monotonic()
    with pytest.raises(FetchError, match="handshake"):
        connect("127.0.0.1", listener.getsockname()[1], SECRET, store,
                FetchOptions(io_timeout_s=5, handshake_timeout_s=0.5))
    assert time.monotonic() - started < 1.5
    stop.set()
    t.join(5)
    listener.close()


def test_a_failed_thread_start_closes_that_connection_and_the_listener_goes_on(
        make_server, logs, monkeypatch: pytest.MonkeyPatch) -> None:
    srv, _ = make_server()
    real = server_mod.start_thread
    failures = [1]

    def flaky(target, args, name) -> None:
        if failures:
            failures.pop()
            raise RuntimeError("can't start new thread")
        real(target, args, name)

    monkeypatch.setattr(server_mod, "start_thread", flaky)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        assert closed_by_peer(s, 2)
    assert eventually(lambda: any("cannot start a thread" in line for line in logs), True), logs
    assert srv.pending_handshakes == 0  # the slot was given back
    fetch_works(srv)  # the next connection is served


def test_the_accept_loop_survives_running_out_of_descriptors(make_server, monkeypatch) -> None:
    """EMFILE from accept() (too many open files) must not end the listener."""
    import errno

    real_accept = socket.socket.accept
    failures = [1, 1, 1]

    def accept(sock):
        if failures:
            failures.pop()
            raise OSError(errno.EMFILE, "Too many open files")
        return real_accept(sock)

    # patched before the listener starts: its very first accept() calls fail (patching a
    # running listener would race with an accept() already blocked in the real one)
    monkeypatch.setattr(socket.socket, "accept", accept)
    srv, _ = make_server()
    fetch_works(srv)
    assert not failures


# -- the handshake is bound to the listener --------------------------------------

def relay(to_port: int) -> tuple[socket.socket, threading.Event]:
    """A listener that pipes every connection to 127.0.0.1:``to_port`` (a man in the middle who only relays)."""
    front = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def run() -> None:
        front.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = front.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            back = socket.create_connection(("127.0.0.1", to_port))
            for a, b in ((conn, back), (back, conn)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    threading.Thread(target=run, daemon=True).start()
    return front, stop


def test_a_relayed_challenge_authenticates_nobody(make_server, logs) -> None:
    srv, _ = make_server()
    front, stop = relay(srv.port)
    relay_port = front.getsockname()[1]
    try:
        # A decode engine lured to the relay answers for the address it dialled: the real listener refuses.
        with socket.create_connection(("127.0.0.1", relay_port), timeout=5) as s, pytest.raises(AuthError):
            client_handshake(s, SECRET, listener_id("127.0.0.1", relay_port))
        assert eventually(lambda: any("refused unauthenticated connection" in line for line in logs), True)
        assert eventually(lambda: refused(srv), 1) == 1
        # Control: the relay itself is transparent; an answer for the real listener's address passes.
        with socket.create_connection(("127.0.0.1", relay_port), timeout=5) as s:
            client_handshake(s, SECRET, listener_id("127.0.0.1", srv.port))
            assert recv_frame(s)["ok"] is True
        # And the client API dials with its own view of the address: through the relay, nothing fetched.
        srv.leases.register("r1", [1], 30)
        with pytest.raises(FetchError, match="auth"):
            fetch(FetchPlan("127.0.0.1", relay_port, "r1", [1], [1]), SECRET,
                  make_store(kv_caches(0, fill=False), NUM_BLOCKS), FetchOptions())
        assert len(srv.leases) == 1
    finally:
        stop.set()
        front.close()


def test_a_listener_speaking_the_old_protocol_is_named() -> None:
    a, b = socket.socketpair()
    a.sendall(b"DKV1" + bytes(NONCE_BYTES))
    with pytest.raises(AuthError, match="same disagg_connectors version"):
        client_handshake(b, SECRET, "127.0.0.1:1")
    a.close()
    b.close()


def test_a_fake_listener_cannot_make_the_client_read_a_huge_frame() -> None:
    a, b = socket.socketpair()
    a.sendall(MAGIC + bytes(NONCE_BYTES) + struct.pack(">I", 3 << 20))  # a 3 MiB "auth answer"
    started = time.monotonic()
    with pytest.raises(AuthError, match="control frame of"):
        client_handshake(b, SECRET, "127.0.0.1:1", timeout_s=5)
    assert time.monotonic() - started < 1
    a.close()
    b.close()


# -- after authentication: every size the peer sends is checked ------------------

def authed(srv: KVServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    client_handshake(s, SECRET, listener_id("127.0.0.1", srv.port))
    assert recv_frame(s)["ok"] is True
    return s


def fetch_msg(**changes) -> dict:
    return {"op": "fetch", "request_id": "req-1", "block_ids": [1, 2], "blocks_per_message": 8, **changes}


@pytest.mark.parametrize(("msg", "error"), [
    (fetch_msg(block_ids=[1, 1]), "repeats block ids"),
    (fetch_msg(block_ids=[1, 2, 3]), "whose lease holds 2"),
    (fetch_msg(block_ids=list(range(10**5))), "whose lease holds 2"),
    (fetch_msg(block_ids=["1", "2"]), "list of integers"),
    (fetch_msg(block_ids=[1.0, 2.0]), "list of integers"),
    (fetch_msg(block_ids=[True, 2]), "list of integers"),
    (fetch_msg(block_ids="1,2"), "list of integers"),
    (fetch_msg(blocks_per_message="64"), "blocks_per_message"),
    (fetch_msg(blocks_per_message=0), "blocks_per_message"),
    (fetch_msg(blocks_per_message=None), "blocks_per_message"),
    (fetch_msg(request_id="r" * 100_000), "malformed request id"),
    (fetch_msg(request_id=["req-1"]), "malformed request id"),
    ({"op": "release", "request_id": {"a": 1}}, "malformed request id"),
    ({"op": "x" * 10_000}, "unknown op"),
])
def test_bad_sizes_and_types_are_refused_with_a_log_line(make_server, logs, msg: dict, error: str) -> None:
    srv, _ = make_server()
    srv.leases.register("req-1", [1, 2], 30)
    with authed(srv) as s:
        send_frame(s, msg)
        reply = recv_frame(s)
        assert reply["ok"] is False and error in reply["error"]
        assert len(reply["error"]) < 300
        assert closed_by_peer(s, 2)
    assert eventually(lambda: any(error in line for line in logs), True), logs
    assert all(len(line) < 400 for line in logs)
    assert len(srv.leases) == 1  # the lease is untouched
    fetch_works(srv)


def test_an_absurd_frame_length_closes_the_connection(make_server, logs) -> None:
    srv, _ = make_server()
    with authed(srv) as s:
        s.sendall(struct.pack(">I", 0xFFFFFFFF))
        assert closed_by_peer(s, 2)
    assert eventually(lambda: any("control frame of 4294967295 bytes" in line for line in logs), True)
    fetch_works(srv)


def test_an_oversized_blocks_per_message_is_clamped_not_obeyed(make_server) -> None:
    srv, caches = make_server()
    srv.leases.register("req-1", [1, 2], 30)
    block_bytes = srv.store.layout.block_bytes
    with authed(srv) as s:
        send_frame(s, fetch_msg(blocks_per_message=10**12))
        reply = recv_frame(s)
        assert reply == {"ok": True, "nbytes": 2 * block_bytes}
        out = bytearray(2 * block_bytes)
        assert recv_into_views(s, [memoryview(out)]) == len(out)
    dst = kv_caches(0, fill=False)
    with make_store(dst, NUM_BLOCKS).writing([1, 2]) as views:
        offset = 0
        for v in views:
            v[:] = out[offset: offset + v.nbytes]
            offset += v.nbytes
    for name in caches:
        assert torch.equal(dst[name][1:3], caches[name][1:3])
    assert MAX_BLOCKS_PER_MESSAGE < 10**12


# -- the pre-authentication budget is per source address; allowed_peers ----------------

def dial(srv: KVServer, source: str) -> socket.socket:
    """A TCP connection to the listener from ``source`` (any 127.0.0.0/8 address: Linux routes them all to lo)."""
    return socket.create_connection(("127.0.0.1", srv.port), timeout=5, source_address=(source, 0))


def what_comes_before_eof(sock: socket.socket, timeout_s: float = 2) -> bytes | None:
    """The bytes the listener sends before closing ``sock``, or None if it keeps it open past ``timeout_s``."""
    sock.settimeout(timeout_s)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        return None
    return got


def what_comes_before_eof_of_each(socks: list[socket.socket], timeout_s: float) -> list[bytes | None]:
    """:func:`what_comes_before_eof` of every socket in ``socks``, waiting on all of them at once
    (one ``timeout_s`` in all, not one per socket)."""
    deadline = time.monotonic() + timeout_s
    got = {s: b"" for s in socks}
    ended: dict[socket.socket, bytes] = {}
    while len(ended) < len(socks) and (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([s for s in socks if s not in ended], [], [], left)
        for s in readable:
            try:
                chunk = s.recv(4096)
            except ConnectionResetError:
                chunk = b""
            if chunk:
                got[s] += chunk
            else:
                ended[s] = got[s]
    return [ended.get(s) for s in socks]


def authenticates(srv: KVServer, source: str) -> bool:
    """One bare handshake from ``source`` (no retry), answered with the listener's hello."""
    try:
        with dial(srv, source) as s:
            client_handshake(s, SECRET, listener_id("127.0.0.1", srv.port), timeout_s=5)
            return recv_frame(s)["ok"] is True
    except OSError:
        return False


def test_idle_strangers_on_one_address_do_not_lock_out_another(make_server, logs) -> None:
    """Sixteen idle connections (each address's own budget, then closed at accept) hold at most
    max_pending_handshakes_per_source slots per address; the decode engine's address still
    authenticates every time. Under one global cap of 16 they took every slot."""
    srv, _ = make_server(handshake_timeout_s=30, io_timeout_s=30)   # strangers hold their slots throughout
    assert (srv.max_pending_handshakes, srv.max_pending_per_source) == (64, 4)
    strangers = [dial(srv, source) for source in ("127.0.0.2", "127.0.0.3") for _ in range(16)]
    try:
        assert eventually(lambda: (srv.pending_from("127.0.0.2"), srv.pending_from("127.0.0.3")), (4, 4)) == (4, 4)
        assert eventually(lambda: any("max_pending_handshakes_per_source" in line for line in logs), True), logs
        assert what_comes_before_eof_of_each(strangers, 0.5).count(b"") == 2 * (16 - 4)  # closed, no greeting
        ok = sum(authenticates(srv, "127.0.0.1") for _ in range(50))
        assert ok == 50
        assert srv.pending_from("127.0.0.2") == 4     # the strangers' slots were never given to anyone else
        fetch_works(srv)
    finally:
        for s in strangers:
            s.close()
    assert eventually(lambda: srv.pending_handshakes, 0) == 0


def test_an_allowed_peer_opening_a_burst_is_held_to_the_global_cap_only(make_server) -> None:
    """A decode engine opens many connections at once (parallel fetches and streams): from an
    allowed_peers address they are not held to the per-source budget, only to the global cap."""
    srv, _ = make_server(allowed_peers=["127.0.0.1"], max_pending_handshakes=10, max_pending_per_source=2,
                         handshake_timeout_s=30)
    held = [dial(srv, "127.0.0.1") for _ in range(8)]
    try:
        for s in held:  # each got its challenge
            assert recv_exact(s, len(MAGIC) + NONCE_BYTES)[:4] == MAGIC
        assert srv.pending_from("127.0.0.1") == 8
    finally:
        for s in held:
            s.close()
    assert eventually(lambda: srv.pending_handshakes, 0) == 0


def test_the_global_cap_still_bounds_all_sources_together(make_server) -> None:
    srv, _ = make_server(max_pending_handshakes=3, max_pending_per_source=2, handshake_timeout_s=30)
    held = [dial(srv, "127.0.0.2"), dial(srv, "127.0.0.2"), dial(srv, "127.0.0.3")]
    try:
        for s in held:  # each got its challenge
            assert recv_exact(s, len(MAGIC) + NONCE_BYTES)[:4] == MAGIC
        assert srv.pending_handshakes == 3
        with dial(srv, "127.0.0.4") as fresh:   # its own budget is empty, the global one full
            assert what_comes_before_eof(fresh) == b""
    finally:
        for s in held:
            s.close()
    assert eventually(lambda: srv.pending_handshakes, 0) == 0
    assert authenticates(srv, "127.0.0.4")


def test_the_client_dials_again_when_the_listener_closes_before_its_greeting(
        make_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of one engine's connections over its address's budget: the ones closed at accept
    are retried (client.GREETING_RETRY_S) instead of failing the fetch."""
    srv, _ = make_server()
    real = server_mod.start_thread
    closes = [1, 1]

    def flaky(target, args, name) -> None:
        if closes:
            closes.pop()
            raise RuntimeError("can't start new thread")   # the listener closes that connection at once
        real(target, args, name)

    monkeypatch.setattr(server_mod, "start_thread", flaky)
    sock, engine = connect("127.0.0.1", srv.port, SECRET, make_store(kv_caches(0, fill=False), NUM_BLOCKS),
                           FetchOptions(io_timeout_s=5))
    sock.close()
    assert closes == [] and engine == ""


def test_the_client_gives_up_on_a_listener_that_keeps_closing_before_its_greeting(make_server) -> None:
    srv, _ = make_server(max_pending_per_source=1, handshake_timeout_s=30)
    with dial(srv, "127.0.0.1") as stranger:   # takes 127.0.0.1's only slot, and keeps it
        assert recv_exact(stranger, len(MAGIC) + NONCE_BYTES)[:4] == MAGIC
        started = time.monotonic()
        with pytest.raises(FetchError, match="pre-authentication budget is full"):
            connect("127.0.0.1", srv.port, SECRET, make_store(kv_caches(0, fill=False), NUM_BLOCKS),
                    FetchOptions(io_timeout_s=5))
        assert time.monotonic() - started < 2
    assert eventually(lambda: srv.pending_from("127.0.0.1"), 0) == 0   # the slot is back once the stranger left
    assert authenticates(srv, "127.0.0.1")


def test_a_peer_not_in_allowed_peers_is_closed_at_accept_without_a_handshake(
        make_server, logs, monkeypatch: pytest.MonkeyPatch) -> None:
    real = server_mod.start_thread
    threads_for: list[str] = []

    def recording(target, args, name) -> None:
        threads_for.append(args[1][0])
        real(target, args, name)

    monkeypatch.setattr(server_mod, "start_thread", recording)
    srv, _ = make_server(allowed_peers=["127.0.0.1"])
    for _ in range(5):
        with dial(srv, "127.0.0.2") as stranger:
            assert what_comes_before_eof(stranger) == b""   # no challenge: closed as accepted
    assert threads_for == []                                 # no thread was started for any of them
    assert srv.pending_handshakes == 0
    counted = srv.counters.drain() or {}
    assert len(counted.get("num_refused_peers", [])) == 5 and not counted.get("num_refused")
    stranger_lines = [line for line in logs if "not an allowed_peers address" in line]
    assert len(stranger_lines) == 1 and "127.0.0.2" in stranger_lines[0]   # rate-limited: one line for five
    assert authenticates(srv, "127.0.0.1")
    fetch_works(srv)
    assert set(threads_for) == {"127.0.0.1"}


def test_allowed_peers_host_names_are_resolved_once_at_start(make_server, monkeypatch: pytest.MonkeyPatch) -> None:
    looked_up: list[str] = []
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if not host[0].isdigit():   # names, not the tests' own dialling of 127.0.0.1
            looked_up.append(host)
        if host == "decode.invalid":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real("127.0.0.1", *args, **kwargs) if host == "decode-box.lan" else real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    srv, _ = make_server(allowed_peers=["decode-box.lan", "198.18.0.2"])
    assert looked_up == ["decode-box.lan"]                   # the IP address needs no lookup
    assert authenticates(srv, "127.0.0.1") and not authenticates(srv, "127.0.0.3")
    assert looked_up == ["decode-box.lan"]                   # not per connection
    with pytest.raises(OSError, match=r"allowed_peers entry 'decode\.invalid' does not resolve"):
        make_server(allowed_peers=["decode.invalid"])


@pytest.mark.parametrize(("address", "source"), [
    ("127.0.0.2", "127.0.0.2"), ("::ffff:127.0.0.2", "127.0.0.2"),
    ("2001:db8::1", "2001:db8::/64"), ("2001:db8::ffff:1", "2001:db8::/64"), ("fe80::1%lo", "fe80::/64"),
])
def test_the_budget_counts_an_ipv4_address_or_an_ipv6_slash_64(address: str, source: str) -> None:
    assert server_mod.source_of(address) == source

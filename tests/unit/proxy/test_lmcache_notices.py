"""The LMCache notice socket (:class:`disagg.proxy.lmcache_handoff.KvNotices`) against real ZMQ
PUSH sockets on 127.0.0.1: it keeps only notices for ids a prompt awaits, survives malformed
and oversized messages, caps the prompts awaiting notices; and where ``disagg up`` makes it
listen (:func:`disagg.kv.lmcache.proxy_options`): the address the prefill hosts send to."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import textwrap
import tracemalloc
from collections.abc import AsyncIterator

import msgspec
import psutil
import pytest
import zmq

from disagg.errors import DeploymentError
from disagg.kv.lmcache import check_ports, lmcache_config, notify_host, proxy_options
from disagg.proxy.handoff import PrefillFailed
from disagg.proxy.lmcache_handoff import MAX_NOTICE_BYTES, KvNotices
from disagg.topology import parse_topology
from harness.ports import free_port

#: every wait of these tests ends within this many seconds
LIMIT_S = 60.0
SPOOFED = 20_000
#: the spoofed ids are this long (the notice stays under MAX_NOTICE_BYTES): 20,000 of them kept
#: would hold about 19 MB
SPOOFED_ID_CHARS = 900


class ProxyNotif(msgspec.Struct, tag=True):
    """The shape of LMCache's notice (lmcache.v1.storage_backend.pd_backend_async.ProxyNotif)."""

    req_id: str


def notice(req_id: str) -> bytes:
    """A notice as LMCache's sender encodes it."""
    return msgspec.msgpack.encode(ProxyNotif(req_id=req_id))


@pytest.fixture
async def notices() -> AsyncIterator[KvNotices]:
    listener = KvNotices(f"tcp://127.0.0.1:{free_port()}")
    yield listener
    await listener.aclose()


def push(endpoint: str, messages: list[bytes]) -> None:
    """Send ``messages`` in order from one PUSH socket and wait until ZMQ handed them all over
    (run in a thread: the listener needs the event loop meanwhile)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDTIMEO, int(LIMIT_S * 1000))
    sock.connect(endpoint)
    for msg in messages:
        sock.send(msg)
    sock.close(linger=int(LIMIT_S * 1000))
    ctx.term()


async def test_spoofed_notices_are_dropped_and_an_awaited_id_still_completes(notices: KvNotices) -> None:
    spoofed = [notice(os.urandom(SPOOFED_ID_CHARS // 2).hex()) for _ in range(SPOOFED)]
    assert all(len(m) <= MAX_NOTICE_BYTES for m in spoofed)
    sizes: list[int] = []

    async def watch() -> None:
        while True:
            sizes.append(notices.awaited)
            await asyncio.sleep(0.005)

    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    tracemalloc.start()
    traced_before = tracemalloc.get_traced_memory()[0]
    watcher = asyncio.create_task(watch())
    try:
        async with asyncio.timeout(LIMIT_S):
            with notices.expect("disagg-real-0123456789abcdef", 1) as kv_sent:
                # the real notice comes last on the same connection: when it is counted, so is every spoofed one
                await asyncio.to_thread(push, notices.endpoint, [*spoofed, notice("disagg-real-0123456789abcdef")])
                assert await kv_sent.wait(LIMIT_S)
    finally:
        watcher.cancel()
    del spoofed
    gc.collect()
    traced_growth = tracemalloc.get_traced_memory()[0] - traced_before
    tracemalloc.stop()
    rss_growth = psutil.Process().memory_info().rss - rss_before
    print(f"\n{SPOOFED} spoofed notices of {SPOOFED_ID_CHARS}-char ids: Python allocations kept "
          f"{traced_growth / 1e6:+.2f} MB, process RSS {rss_growth / 1e6:+.1f} MB (kept, they would be "
          f"about {SPOOFED * SPOOFED_ID_CHARS / 1e6:.0f} MB)")
    assert notices.dropped == {"unawaited": SPOOFED}
    assert sizes and max(sizes) <= 1 and notices.awaited == 0
    assert traced_growth < 1_000_000
    assert rss_growth < 16_000_000


async def test_malformed_and_oversized_messages_do_not_stop_the_listener(notices: KvNotices) -> None:
    malformed = [b"\xc1", b"", msgspec.msgpack.encode(["req_id", "x"]), msgspec.msgpack.encode({"req_id": 3}),
                 msgspec.msgpack.encode("req_id"), msgspec.msgpack.encode({"id": "x"}), b"\x91" * 1000]
    async with asyncio.timeout(LIMIT_S):
        with notices.expect("after-malformed", 1) as kv_sent:
            await asyncio.to_thread(push, notices.endpoint, [*malformed, notice("after-malformed")])
            assert await kv_sent.wait(LIMIT_S)
        assert notices.dropped == {"malformed": len(malformed)}
        # over MAX_NOTICE_BYTES: ZMQ drops the message and the connection before the listener sees it
        await asyncio.to_thread(push, notices.endpoint, [notice("x" * (2 * MAX_NOTICE_BYTES))])
        with notices.expect("after-oversized", 1) as kv_sent:
            await asyncio.to_thread(push, notices.endpoint, [notice("after-oversized")])
            assert await kv_sent.wait(LIMIT_S)
    assert notices.dropped == {"malformed": len(malformed)}


async def test_one_notice_per_rank_surplus_and_late_ones_dropped(notices: KvNotices) -> None:
    async with asyncio.timeout(LIMIT_S):
        with notices.expect("two-ranks", 2) as kv_sent:
            await asyncio.to_thread(push, notices.endpoint, [notice("two-ranks")])
            assert not await kv_sent.wait(0.2)                     # one of two
            await asyncio.to_thread(push, notices.endpoint, [notice("two-ranks")] * 2)
            assert await kv_sent.wait(LIMIT_S)
            while notices.dropped["surplus"] < 1:
                await asyncio.sleep(0.01)
        await asyncio.to_thread(push, notices.endpoint, [notice("two-ranks")])   # its wait is over
        while notices.dropped["unawaited"] < 1:
            await asyncio.sleep(0.01)
    assert notices.dropped == {"surplus": 1, "unawaited": 1} and notices.awaited == 0


async def test_a_notice_before_the_wait_counts(notices: KvNotices) -> None:
    """Prefill's notices often arrive before its HTTP reply, so before the handoff waits."""
    async with asyncio.timeout(LIMIT_S):
        with notices.expect("early", 1) as kv_sent:
            await asyncio.to_thread(push, notices.endpoint, [notice("early")])
            while kv_sent.received < 1:
                await asyncio.sleep(0.01)
            assert await kv_sent.wait(0)


async def test_awaited_prompts_are_capped() -> None:
    listener = KvNotices(f"tcp://127.0.0.1:{free_port()}", max_awaited=2)
    try:
        with listener.expect("a", 1), listener.expect("b", 1):
            with pytest.raises(PrefillFailed) as failed, listener.expect("c", 1):
                pass
            assert failed.value.reason == "kv_notice_table_full" and listener.awaited == 2
        with listener.expect("c", 1):
            assert listener.awaited == 1
    finally:
        await listener.aclose()


async def test_dropped_notices_are_logged_at_most_once_per_interval(notices: KvNotices, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="disagg.proxy"):
        async with asyncio.timeout(LIMIT_S):
            await asyncio.to_thread(push, notices.endpoint, [notice(f"spoof-{i}") for i in range(200)])
            while notices.dropped["unawaited"] < 200:
                await asyncio.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records if "dropped LMCache notices" in r.getMessage()]
    assert len(lines) == 1 and "1 unawaited" in lines[0]


TOPOLOGY = """\
model: {path: /models/qwen}
engine: vllm
connector: lmcache
link: LINK
proxy: {host: "PROXY", port: 8000}
hosts:
  p: {address: P_ADDR, device: cuda}
  d: {address: D_ADDR, device: cuda}
roles:
  prefill:
    - {host: p, port: 8100, gpus: [0]}
  decode:
    - {host: d, port: 8200, kv_port: 7300, gpus: [1]}
"""


def lmcache_topology(proxy: str, link: str = "{type: loopback}", p: str = "127.0.0.1", d: str = "127.0.0.1",
                     remote: bool = False):
    text = TOPOLOGY.replace("PROXY", proxy).replace("LINK", link).replace("P_ADDR", p).replace("D_ADDR", d)
    if remote:
        text = text.replace("device: cuda}", "device: cuda, ssh: me@h}", 1)
    return parse_topology(textwrap.dedent(text), "t.yaml", run_dir="/tmp/run")


@pytest.mark.parametrize(("proxy", "link", "p", "d", "where"), [
    ("0.0.0.0", "{type: loopback}", "127.0.0.1", "127.0.0.1", "127.0.0.1"),     # not every address of the host
    ("::", "{type: loopback}", "127.0.0.1", "127.0.0.1", "127.0.0.1"),
    ("127.0.0.1", "{type: loopback}", "127.0.0.1", "127.0.0.1", "127.0.0.1"),
    ("10.0.0.9", "{type: ethernet, rate: 25gbit}", "10.0.0.1", "10.0.0.2", "10.0.0.9"),
    # behind an emulated link prefill reaches the root namespace only at the decode end of the veth
    ("127.0.0.1", "{type: emulated, rate: 1gbit}", "198.18.10.1", "198.18.10.2", "198.18.10.2"),
    ("0.0.0.0", "{type: emulated, rate: 1gbit}", "198.18.10.1", "198.18.10.2", "198.18.10.2"),
])
def test_the_notice_socket_listens_where_prefill_sends(proxy: str, link: str, p: str, d: str, where: str) -> None:
    topo = lmcache_topology(proxy, link, p, d)
    prefill = topo.role("prefill")[0]
    sender = lmcache_config(topo, prefill, topo.hosts[prefill.host])
    assert dict(proxy_options(topo))["notify"] == f"{where}:8001"
    assert (sender["pd_proxy_host"], sender["pd_proxy_port"]) == (notify_host(topo), 8001) == (where, 8001)


def test_a_wildcard_proxy_with_remote_prefill_hosts_needs_its_link_address() -> None:
    topo = lmcache_topology("0.0.0.0", "{type: ethernet, rate: 25gbit}", "10.0.0.1", "10.0.0.2", remote=True)
    with pytest.raises(DeploymentError, match=r"set proxy\.host to this machine's address on the link"):
        proxy_options(topo)


def test_an_emulated_links_notice_port_is_checked_at_the_decode_address() -> None:
    text = TOPOLOGY.replace("port: 8200, kv_port", "port: 8001, kv_port")
    topo = parse_topology(textwrap.dedent(text).replace("PROXY", "127.0.0.1").replace(
        "LINK", "{type: emulated, rate: 1gbit}").replace("P_ADDR", "198.18.10.1").replace("D_ADDR", "198.18.10.2"),
        "t.yaml", run_dir="/tmp/run")
    with pytest.raises(DeploymentError, match=r"proxy notification port 198\.18\.10\.2:8001 clashes with "
                                              r"roles\.decode\[0\]\.port"):
        check_ports(topo)

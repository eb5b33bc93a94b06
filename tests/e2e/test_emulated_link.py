"""1P1D across an emulated 1 Gb/s link between emulated hosts, with routing ``auto``: one bring-up.

The prefill engine runs in a network namespace behind a tc-tbf-shaped veth, decode and proxy in
the root namespace, one core each. The hosts emulate hardware: the prefill host prefills at most
:data:`PREFILL_RATE` tokens/s (connectors/emulated_prefill.py), the decode host has a KV cache of
:data:`KV_MEMORY` and a CPU quota of :data:`CPU_SHARE` cores in a cgroup. On that one deployment:

- the emulation: the namespace is there; the decode engine's KV cache is the emulated size (its
  block count), every process of that engine is in the quota's cgroup with the quota's value; the
  split long prompt's KV crosses the shaped veth (the veth's received bytes cover what the
  connector says it moved), streamed no sooner than the emulated host could have prefilled it (its
  TTFT at least the emulated prefill time over the emulation's margin); the prefill engine's own
  prefill-time histogram measures its rate back at the emulated one (0.8 x to 1.02 x) on a prompt
  of the long one's length sent to it alone (on a core slower than the emulated rate, which the
  emulation never speeds up: no slower than the decode engine prefills the same prompt under its
  quota);
  `disagg down` removes the cgroup, the namespace and the veth;
- the routing: while the decode engine decodes :data:`BUSY` long answers, a long prompt
  (:data:`LONG` tokens) splits and a very short one does not; each answer equals the one the
  decode engine computes alone (the long one with a cache salt, so from its own prefill, not
  from the KV it was sent).

Why these choices:

- Connector: socket, as the routing test this module grew from ran, streaming the KV layer by
  layer (its default across a link): a streamed split's fixed cost is seeded at 40 ms and learned
  as a line in the decode engine's requests in flight on top of that engine's busy line (what its
  load adds to any first token there), which keeps a 2-token prompt's split dearer than its local
  prefill on the busy decode engine. With the KV fetched after the prefill
  (``streaming: false``) the proxy priced the handoff near its 16 ms seed while one into the busy
  decode engine took 550-590 ms, and split the short prompt (2 runs of 7). Streamed, the KV leaves while the
  prefill engine computes; the emulation holds such a step mostly before its forward once the
  engine has an estimate of its own compute (connectors/emulated_prefill.py), and the proxy may
  cancel the prefill request once decode answered: the rate is measured on a prompt sent to the
  prefill engine alone, once it is idle, so that its histogram counts that one request; sent
  before the split, it also gives the engine its compute estimate, without which its first
  prompt step is held only after the forward. NIXL
  across an emulated link (UCX over a veth between namespaces) is tested by
  test_pd_nixl_push.py (push mode); the socket connector's KV fetched after the prefill runs over
  loopback only.
- Model: ``disagg:tiny-kvheavy`` (32 KiB of KV per token). A prompt prefilled on the decode engine
  stalls every decode running there for the whole prefill: with ``BUSY`` decodes a local prefill
  scores ``(1 + BUSY) x`` its prefill time on the decode host, a split its prefill on the prefill
  host plus the part of the transfer the prefill does not hide plus the handoff's fixed cost. With
  the tiny model that fixed cost is all a split adds; with this one the transfer (0.28 ms per token
  over 1 Gb/s) is real, and the split still wins by the stall, which is what routing ``auto`` is
  for (disagg/proxy/policy.py, disagg/routecost.py).
- Rates. The emulated prefill rate must be below what one core prefills this model at, or the
  engine is not slowed to it: 1,000 tokens/s, where one core of this 2-core AMD EPYC prefills
  2,048-token prompts of this model at about 1,744 tokens/s. A prefill host slower than its core
  makes a split dearer (the proxy prices the long prompt's at 2.2 s: its prefill, the transfer the
  prefill does not hide, the fixed cost); the decode host's quota of 0.8 cores slows its own
  prefills a little too (the proxy measured 1,557-2,073 tokens/s there), and ``BUSY`` is 5 so that
  the stall keeps the local option dearer: a local prefill scores about ``(1 + BUSY) / (decode
  host's rate)`` per token, and the split wins while the decode host prefills below about 5,500
  tokens/s (three runs here scored local 6.0-7.9 s against a split's 2.2 s). The quota is no lower
  because it slows the decode engine's start as much as its prefills (at 0.4 cores `disagg up`
  took 65 s, at 0.8 cores 32 s). The short prompt (2 tokens) stalls the decodes for less than a
  streamed handoff's fixed cost: it stays local (without the decode engine's busy line in the
  split's price, one run of many predicted its split at 44 ms against a local 40 ms, scored the
  split 1.4 ms below local for the local prefill's stall, and the split took 117 ms), or, once the
  proxy has seen the decode engine's time per output token rise with its load (the long prompt's
  answer is such a sample), the idle prefill engine serves it whole (``decode_load``, or
  ``decode_backlog``); either is right, a split is not. On a core slower than the emulated rate
  (about 2 ms per token of this model on an AVX2 core) nothing is held, and the rate check's
  floor is the decode engine's own rate for the same prompt.
- Seeds. Routing ``auto`` prices hosts that emulate their speed only with measured rates (the
  stated rate is what the emulation aims at, not what an engine reaches): the test stores them as
  `disagg bench` would before `disagg up`, the prefill host at its emulated rate (which this test
  measures back), the decode host at the same rate, a seed only: the proxy fits the decode
  engine's own line from the warm-up prompts (at idle a split never beats a local prefill between
  alike rates, so they stay local and measure it). On a core slower than the seeds (an AVX2-only
  EPYC prefills this model at 250-280 tokens/s) the first local prompt shows the decode engine
  slower than the prefill engine's seed, and short prompts split until the prefill engine's own
  line stands; the decode engine's line keeps its seed's overhead meanwhile (docs/proxy.md), so
  short prompts come back to it (a line fitted freely through the seed and one 256-token sample
  had 482 ms of overhead, and the short prompt below split).
- Warm-up answers of one token: they teach the proxy each engine's prefill line (their first
  tokens) and no decode line (no gaps between tokens), and the busy decodes are still running
  when the prompts are decided, so no engine has a time per output token then. With one, the
  idle prefill engine borrows the decode engine's line (docs/proxy.md), and once the busy decodes
  raise the decode engine's above 1.05 x that, the ``decode_load`` rule serves the next prompt
  whole on the prefill engine (rightly, by its rule): CI saw a busy decode and the long prompt go
  whole that way (27.5 ms a token against 1.05 x 26.1).
- KV memory: 704 MiB (22,528 tokens), room for the ``BUSY`` decodes at their full 4,000 tokens each
  plus the long and the short prompt, so no decode is preempted and no prompt waits for room (vLLM
  needs at least ``max_model_len``, 4,096 tokens).

The proxy learns the decode engine's rate from the first token of streamed local prompts. The
decisions are read from the proxy's metrics (``disagg_route_total``) and the ``X-Disagg-Route``
header; the proxy logs at debug level, so a failure shows the predicted options behind each
decision.

Starts engines of its own, under the engine lock, with every shared deployment down: never more
than two engines on this machine.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import warnings
from pathlib import Path

import psutil
import pytest

from connectors.emulated_prefill import StepHold
from disagg.emulation import cpu_share_for, emulated_link
from disagg.linkemu import netns_unavailable_reason
from disagg.measurements import store_prefill
from disagg.prometheus_text import sample_sum
from disagg.prompts import exact_prompt, load_tokenizer
from disagg.proxy.measure import DUTY_WINDOW_S
from disagg.topology import load_topology
from harness.engines import (
    ENGINE_ARGS,
    Running,
    bring_up,
    free_ports,
    get_text,
    plain_answer,
    routed_stream,
    timed_stream,
)
from tests.e2e.emulated_links import left_of, namespace_listed, received_bytes

pytestmark = [pytest.mark.e2e, pytest.mark.netns,
              pytest.mark.skipif(netns_unavailable_reason() is not None, reason=str(netns_unavailable_reason()))]

#: the prefill host's emulated rate (prompt tokens/s): below what one core prefills the model at
PREFILL_RATE = 1000
#: the decode host's KV cache: 22,528 tokens of the model's 32 KiB
KV_MEMORY = 704 * 2**20
#: the decode host's cores (a cgroup quota)
CPU_SHARE = 0.8
#: KV bytes per token of tiny-kvheavy: 8 layers x 8 KV heads x 128 x (K, V) x 2 bytes
KV_PER_TOKEN = 32 * 1024
#: long answers decoding on the decode engine while the long and the short prompt are decided
BUSY = 5
#: the long prompt's tokens
LONG = 2048
#: its answer's: enough token events for a sure sample of the decode engine's time per output token
#: with the busy decodes running (the proxy takes one from 4 events), which the short prompt's
#: ``decode_load`` rule reads
LONG_OUT = 16

_REASONS = ("predicted", "explore", "no_prefill", "no_decode", "decode_backlog", "decode_load", "policy")


def _cache_blocks(metrics: str) -> tuple[int, int]:
    """(num_gpu_blocks, block_size) from vLLM's ``vllm:cache_config_info`` labels."""
    line = next(ln for ln in metrics.splitlines() if ln.startswith("vllm:cache_config_info{"))
    labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
    return int(labels["num_gpu_blocks"].strip('"')), int(labels["block_size"].strip('"'))


def _counted(before: str, after: str) -> dict[str, float]:
    """The routes counted between two scrapes of the proxy's metrics, as ``path/reason``."""
    counted = {f"{path}/{reason}": sample_sum(after, "disagg_route_total", path=path, reason=reason)
               - sample_sum(before, "disagg_route_total", path=path, reason=reason)
               for path in ("split", "local", "whole") for reason in _REASONS}
    return {k: v for k, v in counted.items() if v}


def _proxy_log(run: Running) -> str:
    log = next((Path(r.log) for r in run.state().processes if r.kind == "proxy"), None)
    return log.read_text() if log is not None and log.exists() else ""


def _health_lines(run: Running) -> list[str]:
    text = _proxy_log(run)
    return [ln for ln in text.splitlines() if "taken out" in ln or "service" in ln or "not healthy" in ln][-10:]


def _route_lines(run: Running) -> str:
    """The proxy's debug lines on its routing decisions and what their first tokens took (the
    predicted options and the measurements behind them, from the warm-up on), for a failure's
    message: one string, which pytest shows in full (a list's repr it cuts short)."""
    return "\n".join([ln for ln in _proxy_log(run).splitlines() if "route " in ln][-60:] + _health_lines(run))


def _decided(run: Running, body: dict) -> tuple[str, str, dict[str, float], float]:
    """(route, text, routes counted, TTFT) of one streamed prompt, decided with both engines in service.

    If the proxy had taken the prefill engine out of service when the prompt came (a health probe
    that failed on this loaded machine: the route is then ``local`` for ``no_prefill``, not the
    policy's choice this test is about), it waits for the engine to be back and asks once more,
    saying so in a warning."""
    proxy = run.proxy_url
    before = get_text(proxy + "/metrics")
    route, text, ttft = timed_stream(proxy, body)
    counted = _counted(before, get_text(proxy + "/metrics"))
    if "local/no_prefill" in counted:
        warnings.warn(f"prefill engine out of service when a prompt came; asked again. Proxy log: "
                      f"{_health_lines(run)}", stacklevel=2)
        deadline = time.monotonic() + 60
        while sample_sum(get_text(proxy + "/metrics"), "disagg_proxy_backend_healthy", role="prefill") < 1:
            assert time.monotonic() < deadline, f"the prefill engine stayed out of service: {_health_lines(run)}"
            time.sleep(0.5)
        before = get_text(proxy + "/metrics")
        route, text, ttft = timed_stream(proxy, body)
        counted = _counted(before, get_text(proxy + "/metrics"))
    return route, text, counted, ttft


def _prefilled(engine: str, before: str, timeout: float = 30) -> str:
    """The engine's /metrics once its prefill-time histogram counts a request more than ``before``
    (vLLM counts a request once its last output went out, which a client may outrun)."""
    deadline = time.monotonic() + timeout
    while True:
        text = get_text(engine + "/metrics")
        if (sample_sum(text, "vllm:request_prefill_time_seconds_count")
                > sample_sum(before, "vllm:request_prefill_time_seconds_count")):
            return text
        assert time.monotonic() < deadline, f"{engine} counted no prefill within {timeout:.0f} s"
        time.sleep(0.2)


def _prefill_rate(before: str, after: str) -> float:
    """Prompt tokens per second of prefill between two /metrics texts of one engine that prefilled
    one :data:`LONG`-token prompt in between."""
    tokens = sample_sum(after, "vllm:prompt_tokens_total") - sample_sum(before, "vllm:prompt_tokens_total")
    seconds = (sample_sum(after, "vllm:request_prefill_time_seconds_sum")
               - sample_sum(before, "vllm:request_prefill_time_seconds_sum"))
    assert tokens == LONG, tokens
    return tokens / seconds


def _idle(engine: str, timeout: float = 30) -> None:
    """Wait until ``engine`` runs and holds no request."""
    deadline = time.monotonic() + timeout
    while True:
        text = get_text(engine + "/metrics")
        if sample_sum(text, "vllm:num_requests_running") == 0 and sample_sum(text, "vllm:num_requests_waiting") == 0:
            return
        assert time.monotonic() < deadline, f"{engine} still ran requests after {timeout:.0f} s"
        time.sleep(0.2)


class _LongDecode:
    """A streamed completion through the proxy that keeps the decode engine decoding until closed."""

    def __init__(self, proxy: str, body: dict) -> None:
        self.first = threading.Event()
        self.route = ""
        self._stop = threading.Event()
        req = urllib.request.Request(proxy + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"content-type": "application/json"})
        self._resp = urllib.request.urlopen(req, timeout=600)
        self.route = self._resp.headers["X-Disagg-Route"]
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for raw in self._resp:
                if raw.startswith(b"data: {"):
                    self.first.set()
                if self._stop.is_set():
                    break
        except (OSError, ValueError, AttributeError):  # closed under the reader by close()
            if not self._stop.is_set():
                raise

    def close(self) -> None:
        """Stop reading and close the stream (the proxy aborts the decode)."""
        self._stop.set()
        self._resp.close()
        self._thread.join(timeout=30)


def test_emulated_hosts_route_long_prompts_over_the_link(engine_lock: None, tmp_path: Path) -> None:
    proxy_port, p_port, d_port, p_kv, d_kv = free_ports(5)
    topo_path, run_dir = tmp_path / "emu-1g.yaml", tmp_path / "run"
    topo_path.write_text(f"""\
model: {{path: "disagg:tiny-kvheavy", max_model_len: 4096, served_name: m}}
connector: socket
link: {{type: emulated, rate: 1gbit}}
proxy: {{host: 127.0.0.1, port: {proxy_port}, log_level: debug}}
hosts:
  p: {{address: 198.18.30.1, emulate: {{prefill_rate: {PREFILL_RATE}}}}}
  d: {{address: 198.18.30.2, emulate: {{kv_memory: {KV_MEMORY}, cpu_share: {CPU_SHARE}}}}}
roles:
  prefill: [{{host: p, port: {p_port}, kv_port: {p_kv}, cpus: [0], args: {ENGINE_ARGS}}}]
  decode: [{{host: d, port: {d_port}, kv_port: {d_kv}, cpus: [1], args: {ENGINE_ARGS}}}]
""")
    for host in ("p", "d"):   # the routing's seeds (module doc): what `disagg bench` would have stored
        store_prefill(run_dir, "m", host, PREFILL_RATE, "e2e seed: the prefill host's emulated rate",
                      connector="socket")
    topo = load_topology(topo_path, run_dir=str(run_dir))
    assert topo.routing.policy == "auto"
    link = emulated_link(topo)
    share = cpu_share_for(topo, topo.hosts["d"])
    assert share is not None
    cgroup = share.path()
    phases = {"start": time.monotonic()}
    run = bring_up(topo_path, run_dir)
    phases["up"] = time.monotonic()
    try:
        assert namespace_listed(link)
        proxy, decode, prefill = run.proxy_url, run.engines["decode[0]"], run.engines["prefill[0]"]
        # the decode host's KV cache is the emulated size (whole blocks of 32 KiB per token) ...
        blocks, block_size = _cache_blocks(get_text(decode + "/metrics"))
        assert KV_MEMORY - block_size * KV_PER_TOKEN < blocks * block_size * KV_PER_TOKEN <= KV_MEMORY, \
            (blocks, block_size)
        # ... and every process of its engine runs under the quota
        assert (cgroup / "cpu.cfs_quota_us").read_text().strip() == str(round(CPU_SHARE * 100_000))
        members = {int(p) for p in (cgroup / "cgroup.procs").read_text().split()}
        leader = next(r.pid for r in run.state().processes if r.name == "decode[0]")
        engine = {leader, *(c.pid for c in psutil.Process(leader).children(recursive=True))}
        assert engine <= members and len(engine) >= 2, (engine, members)

        tok = load_tokenizer(Path(topo.model.path))

        def body(tokens: int, tag: str, max_tokens: int = 4) -> dict:
            return {"model": "m", "prompt": exact_prompt(tok, tokens, tag), "max_tokens": max_tokens,
                    "temperature": 0}

        # warm-up: the proxy learns the engines' rates from these. Their routes are not asserted: an
        # engine's first requests carry one-off costs that the first measurements include, so a warm-up
        # prompt may go either way; what must hold is the decision once decode is busy, below. An
        # engine's line learns only from prompts sent while it is idle, and stands on its own after
        # a warm-up sample and 4 more: go on until the decode engine has prefilled 5 of them.
        sizes, local = (8, 256, 64, 384, 32, 512, 128, 448), 0
        for i in range(16):
            route, _ = routed_stream(proxy, body(sizes[i % len(sizes)], f"warm{i}", max_tokens=1))
            local += route == "local"
            if local >= 5:
                break

        # the prefill host's rate, measured back by the engine: its prefill time for a prompt of the
        # long one's length sent to it alone, once idle (module doc). This prompt also gives the
        # engine the estimate of its own compute that the emulation holds a step by before its
        # forward, so that the streamed split below cannot hand over the KV sooner than the
        # emulated host would have (connectors/emulated_prefill.py)
        warmed = time.monotonic()
        _idle(prefill)   # any warm-up split's prefill request finished (or cancelled) and counted
        p_before = get_text(prefill + "/metrics")
        plain_answer(prefill, body(LONG, "rate", max_tokens=1))
        prefill_rate = _prefill_rate(p_before, _prefilled(prefill, p_before))

        # the warm-up's local prefills leave the proxy's prefill duty of the decode engine (the share
        # of its last DUTY_WINDOW_S seconds spent prefilling, which prices its time per output token):
        # until then it looks a shade slower per token than the idle prefill engine, and the
        # ``decode_load`` rule would serve the busy prompts below whole there
        time.sleep(max(0.0, DUTY_WINDOW_S - (time.monotonic() - warmed)))
        phases["warm-up"] = time.monotonic()
        busy: list[_LongDecode] = []
        try:
            # one at a time, each decoding before the next comes: a prompt arriving while the decode
            # engine still has one waiting may be served whole by the idle prefill engine (the
            # ``decode_backlog`` relief), and this test wants them all decoding on the decode engine,
            # which a local and a split route both do (the policy's choice for these is not the point)
            for i in range(BUSY):
                busy.append(_LongDecode(proxy, {**body(8, f"busy{i}", max_tokens=4000), "ignore_eos": True}))
                assert busy[-1].route in ("local", "split"), busy[-1].route
                assert busy[-1].first.wait(120), "a long decode never started"
            rx_before, d_before = received_bytes(link), get_text(decode + "/metrics")
            long_route, long_text, long_counted, long_ttft = _decided(run, body(LONG, "long", max_tokens=LONG_OUT))
            rx_after, d_after = received_bytes(link), get_text(decode + "/metrics")
            short_route, short_text, short_counted, _ = _decided(run, body(2, "short"))
            after = get_text(proxy + "/metrics")
        finally:
            for b in busy:
                b.close()
        phases["decisions"] = time.monotonic()
        # the long decodes were still running on the decode engine when both prompts were answered
        assert sample_sum(after, "disagg_proxy_backend_in_flight", role="decode") == BUSY

        assert (long_route, long_counted) == ("split", {"split/predicted": 1}), _route_lines(run)
        # streamed from the emulated host, the long prompt's KV reached the decode engine no sooner
        # than that host could have prefilled it: its forward ends no sooner than the emulated time
        # over the emulation's margin (and on a core slower than the rate, later still)
        assert long_ttft >= LONG / PREFILL_RATE / StepHold.MARGIN, (long_ttft, _route_lines(run))
        assert (short_route, short_counted) in (("local", {"local/predicted": 1}),
                                                ("whole", {"whole/decode_load": 1}),
                                                ("whole", {"whole/decode_backlog": 1})), _route_lines(run)
        assert sample_sum(after, "disagg_route_predicted_ttft_seconds_count", path="split") >= 1

        # the long prompt's KV came in through the shaped veth
        moved = (sample_sum(d_after, "vllm:socket_kv_bytes_received_total")
                 - sample_sum(d_before, "vllm:socket_kv_bytes_received_total"))
        assert moved >= (LONG - 1) * KV_PER_TOKEN, moved
        assert rx_after - rx_before >= moved, (rx_after - rx_before, moved)
        # whichever path, the answer is the decode engine's own: the long one computed from its own
        # prefill (a cache salt keeps it from the KV the split sent it), which also gives the rate
        # one core under the decode host's quota prefills the model at
        _idle(decode)   # the busy decodes aborted and counted
        d_before = get_text(decode + "/metrics")
        assert long_text == plain_answer(decode, {**body(LONG, "long", max_tokens=LONG_OUT), "cache_salt": "alone"})
        decode_rate = _prefill_rate(d_before, _prefilled(decode, d_before))
        # the prefill host's rate measured back before the busy decodes: the emulation only ever
        # slows an engine down: on a core slower than the emulated rate it holds nothing, and the
        # prefill engine's core is no slower than the decode engine's under its quota, so the floor
        # is the lower of the emulated rate and the decode engine's
        assert 0.8 * min(PREFILL_RATE, decode_rate) <= prefill_rate <= 1.02 * PREFILL_RATE, (prefill_rate, decode_rate)
        print(f"prefill host measured back at {prefill_rate:,.0f} tokens/s (emulated {PREFILL_RATE}; the decode "
              f"engine under its quota: {decode_rate:,.0f}); long prompt split (TTFT {long_ttft:.2f} s), "
              f"KV moved {moved / 2**20:.1f} MiB, "
              f"veth received {(rx_after - rx_before) / 2**20:.1f} MiB; "
              f"short prompt {short_route} ({', '.join(short_counted)})")
        assert short_text == plain_answer(decode, body(2, "short"))
        phases["checks"] = time.monotonic()
    finally:
        done = run.down()
    phases["down"] = time.monotonic()
    marks = list(phases.values())
    print("seconds: " + ", ".join(f"{name} {b - a:.1f}"
                                  for name, a, b in zip(list(phases)[1:], marks[:-1], marks[1:], strict=True)))
    assert done.returncode == 0, done.stderr
    assert not cgroup.exists()
    assert left_of(link) == []

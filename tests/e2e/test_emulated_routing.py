"""Routing policy ``auto`` (the default) on real engines: the KV-heavy embedded model (32 KiB of KV
per token) across an emulated 1 Gb/s link, socket connector, prefill in a network namespace, one
core per engine.

While the decode engine is decoding several long answers, a long prompt prefilled there would
stall every one of them for the whole prefill, while the link moves its KV in about the time of
one prefill: the proxy splits it. The margin is set by how many answers are decoding
(:data:`BUSY`), not by how fast this machine's cores are: with ``BUSY`` decodes running, a local
prefill scores ``(1 + BUSY) x`` its prefill time, a split about one prefill plus the transfer
(0.28 ms of link per token), so the split wins on any core that prefills this model slower than
0.28 / BUSY ms per token (one AVX2 core took about 2 ms, one AMX core 0.24 ms; with one busy
decode the AMX machine's choice fell within a few percent of even and went either way). The long
prompt is long (:data:`LONG`) so that the margin also covers the error of what the proxy
learned from a few warm-up prompts on a loaded machine, above all a split's fixed cost, which
does not grow with the prompt while the stall does: with 768 tokens the margin was about 0.8 s
on the AMX machine and CI once saw ``local`` chosen (the warm-up's first tokens there came up to
30 x their prediction; the decision lines were cut from that message, so the failure message now
carries every decision); with 2,048 tokens it is about 1.7 s, and grows with slower cores. A very
short prompt would stall those decodes for less than a handoff's fixed cost: it does not split.
The decode engine prefills it, or, once the proxy has seen the decode engine's time per output
token rise with its load (the long prompt's answer is such a sample), the idle prefill engine
serves it whole (reason ``decode_load``): either is right, a split is not. At idle every prompt
stays local (alike engines: a split never answers sooner).

The proxy learns the decode engine's rate from the first token of streamed local prompts, and
judges the not yet measured prefill engine by its seed scaled the way the decode engine's
measurement fell from its own. The decisions are read from the proxy's metrics
(``disagg_route_total``) and the ``X-Disagg-Route`` header, and each answer equals the one the
decode engine gives alone. The proxy logs at debug level, so a failure shows the predicted
options behind each decision.

Starts engines of its own (sorts after test_emulated_link, before the modules that use the
session's NIXL 1P1D), under the engine lock: never more than two engines on this machine.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import warnings
from pathlib import Path

import pytest

from disagg.linkemu import netns_unavailable_reason
from disagg.prometheus_text import sample_sum
from disagg.prompts import exact_prompt, load_tokenizer
from disagg.topology import load_topology
from harness.engines import ENGINE_ARGS, Running, bring_up, free_ports, get_text, plain_answer, routed_stream

pytestmark = [pytest.mark.e2e, pytest.mark.netns,
              pytest.mark.skipif(netns_unavailable_reason() is not None, reason=str(netns_unavailable_reason()))]


#: long answers decoding on the decode engine while the long and the short prompt are decided
BUSY = 4
#: the long prompt's tokens
LONG = 2048

_REASONS = ("predicted", "explore", "no_prefill", "no_decode", "decode_backlog", "decode_load", "policy")


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


def _route_lines(run: Running) -> list[str]:
    """The proxy's debug lines on its routing decisions and what their first tokens took (the
    predicted options and the measurements behind them, from the warm-up on), for a failure's message."""
    return [ln for ln in _proxy_log(run).splitlines() if "route " in ln][-60:] + _health_lines(run)


def _decided(run: Running, body: dict) -> tuple[str, str, dict[str, float]]:
    """(route, text, routes counted) of one streamed prompt, decided with both engines in service.

    If the proxy had taken the prefill engine out of service when the prompt came (a health probe
    that failed on this loaded machine: the route is then ``local`` for ``no_prefill``, not the
    policy's choice this test is about), it waits for the engine to be back and asks once more,
    saying so in a warning."""
    proxy = run.proxy_url
    before = get_text(proxy + "/metrics")
    route, text = routed_stream(proxy, body)
    counted = _counted(before, get_text(proxy + "/metrics"))
    if "local/no_prefill" in counted:
        warnings.warn(f"prefill engine out of service when a prompt came; asked again. Proxy log: "
                      f"{_health_lines(run)}", stacklevel=2)
        deadline = time.monotonic() + 60
        while sample_sum(get_text(proxy + "/metrics"), "disagg_proxy_backend_healthy", role="prefill") < 1:
            assert time.monotonic() < deadline, f"the prefill engine stayed out of service: {_health_lines(run)}"
            time.sleep(0.5)
        before = get_text(proxy + "/metrics")
        route, text = routed_stream(proxy, body)
        counted = _counted(before, get_text(proxy + "/metrics"))
    return route, text, counted


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


def test_short_prompts_stay_local_long_ones_split_while_decode_is_busy(engine_lock: None, tmp_path: Path) -> None:
    proxy_port, p_port, d_port, p_kv, d_kv = free_ports(5)
    topo_path = tmp_path / "emu-routing.yaml"
    topo_path.write_text(f"""\
model: {{path: "disagg:tiny-kvheavy", max_model_len: 4096, served_name: m}}
connector: socket
link: {{type: emulated, rate: 1gbit}}
proxy: {{host: 127.0.0.1, port: {proxy_port}, log_level: debug}}
hosts:
  p: {{address: 198.18.31.1}}
  d: {{address: 198.18.31.2}}
roles:
  prefill: [{{host: p, port: {p_port}, kv_port: {p_kv}, cpus: [0], args: {ENGINE_ARGS}}}]
  decode: [{{host: d, port: {d_port}, kv_port: {d_kv}, cpus: [1], args: {ENGINE_ARGS}}}]
""")
    run = bring_up(topo_path, tmp_path / "run")
    try:
        topo = load_topology(topo_path, run_dir=str(tmp_path / "run"))
        assert topo.routing.policy == "auto"
        tok = load_tokenizer(Path(topo.model.path))
        proxy, decode = run.proxy_url, run.engines["decode[0]"]

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
            route, _ = routed_stream(proxy, body(sizes[i % len(sizes)], f"warm{i}"))
            local += route == "local"
            if local >= 5:
                break

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
            long_route, long_text, long_counted = _decided(run, body(LONG, "long"))
            short_route, short_text, short_counted = _decided(run, body(2, "short"))
            after = get_text(proxy + "/metrics")
        finally:
            for b in busy:
                b.close()
        # the long decodes were still running on the decode engine when both prompts were answered
        assert sample_sum(after, "disagg_proxy_backend_in_flight", role="decode") == BUSY

        assert (long_route, long_counted) == ("split", {"split/predicted": 1}), _route_lines(run)
        assert (short_route, short_counted) in (("local", {"local/predicted": 1}),
                                                ("whole", {"whole/decode_load": 1}),
                                                ("whole", {"whole/decode_backlog": 1})), _route_lines(run)
        assert sample_sum(after, "disagg_route_predicted_ttft_seconds_count", path="split") >= 1
        # whichever path, the answer is the decode engine's own
        assert long_text == plain_answer(decode, body(LONG, "long"))
        assert short_text == plain_answer(decode, body(2, "short"))
    finally:
        done = run.down()
    assert done.returncode == 0, done.stderr

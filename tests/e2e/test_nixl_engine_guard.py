"""Engines of a `disagg up` deployment answer generation requests only from the proxy.

The session's 1P1D deployment runs with the engine key ENGINE_KEY (the tests
set DISAGG_ENGINE_KEY for every `disagg up`). Without that key, or with
another, every engine refuses /v1 (vLLM's own key check) and every route vLLM
leaves open (/invocations, /tokenize: the engine guard) with 401, and nothing
reaches the engine: its finished-request counter stays put; the read-only
probes stay open. The proxy holds the key, so clients keep being served, and
a client's own Authorization header is not what the engine sees.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from disagg.prometheus_text import sample_sum
from harness.engines import ENGINE_KEY, Running, get_text
from tests.e2e.shared_deployment import NIXL

pytestmark = pytest.mark.e2e
SHARED_DEPLOYMENT = NIXL

COMPLETION = {"model": "tiny", "prompt": "The river runs past the mill and", "max_tokens": 1, "temperature": 0}
#: what a crafted request sends to hang or kill a P/D engine: a pull from nowhere
CRAFTED = {**COMPLETION, "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                                "remote_engine_id": "nobody", "remote_block_ids": [0, 1],
                                                "remote_host": "198.18.99.99", "remote_port": 1}}
REFUSED = [
    ("/v1/completions", COMPLETION),
    ("/v1/completions", CRAFTED),
    ("/invocations", COMPLETION),  # SageMaker's completion route: vLLM's own key leaves it open
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 1}),
    ("/tokenize", {"model": "tiny", "prompt": "hi"}),
]


def post(url: str, body: dict, auth: str | None = None, timeout: float = 120) -> tuple[int, dict]:
    headers = {"content-type": "application/json"}
    if auth is not None:
        headers["Authorization"] = auth
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read() or b"{}")


def finished(url: str) -> float:
    return sample_sum(get_text(url + "/metrics"), "vllm:request_success_total")


def wait_finished(url: str, count: float, timeout: float = 10) -> float:
    """The engine's finished-request count once it reaches ``count`` (metrics lag the reply a little)."""
    deadline = time.monotonic() + timeout
    while (now := finished(url)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return now


@pytest.mark.parametrize("name", ["prefill[0]", "decode[0]"])
def test_an_engine_refuses_everyone_without_the_engine_key(pd: Running, name: str) -> None:
    url = pd.engines[name]
    before = finished(url)
    for path, body in REFUSED:
        for auth in (None, "Bearer wrong-key", f"Basic {ENGINE_KEY}"):
            status, reply = post(url + path, body, auth)
            assert status == 401, (path, auth, status, reply)
            assert reply["error"]["code"] == 401 and reply["error"]["type"] == "AuthenticationError", reply
    for probe in ("/health", "/metrics"):
        with urllib.request.urlopen(url + probe, timeout=10) as resp:  # no key: read-only probes stay open
            assert resp.status == 200
    assert finished(url) == before  # nothing reached the engine
    status, reply = post(url + "/v1/completions", COMPLETION, f"Bearer {ENGINE_KEY}")
    assert status == 200 and reply["choices"][0]["text"], reply
    assert wait_finished(url, before + 1) == before + 1  # ... and the counter would have shown it


def test_the_proxy_holds_the_key_and_never_forwards_the_clients(pd: Running) -> None:
    decode = pd.engines["decode[0]"]
    before = finished(decode)
    status, reply = post(pd.proxy_url + "/v1/completions", COMPLETION, "Bearer something-else")
    assert status == 200 and reply["choices"][0]["text"], reply
    assert wait_finished(decode, before + 1) == before + 1  # decode served it, with the proxy's key

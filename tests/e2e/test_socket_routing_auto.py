"""Issue 13's conformance suite under issue 15's default routing (``auto``): a 1P1D with the socket
connector whose proxy picks each prompt's path; every answer is still the one a single vLLM server
gives, whichever path served it, and the paths taken are named in the header and the metrics.

The deployment is this module's own; it sorts after the other socket modules and starts only
once no other engine on the session's model runs (never more than two engines at once).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from disagg.prometheus_text import sample_sum
from disagg.prompts import exact_prompt
from tests.e2e.conformance import CASE_NAMES, Recorded, check_case
from tests.e2e.engines import Running, bring_up_socket_pd, engine_processes, get_text, plain_answer, routed_stream

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def auto_pd(conformance_reference: dict[str, Recorded], e2e_dir: Path, tiny_model: Path) -> Iterator[Running]:
    """1 prefill + 1 decode, socket connector, loopback, the topology's default routing."""
    run = bring_up_socket_pd(e2e_dir, tiny_model, "pd-socket-auto")
    assert "routing" not in run.topology.read_text()
    try:
        yield run
    finally:
        done = run.down()
        assert done.returncode == 0, done.stderr
        assert not engine_processes(tiny_model)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_answers_like_one_vllm_server(auto_pd: Running, conformance_reference: dict[str, Recorded],
                                      name: str) -> None:
    check_case(auto_pd.proxy_url, name, conformance_reference[name])


def test_every_prompt_was_routed_and_named(auto_pd: Running) -> None:
    req = urllib.request.Request(auto_pd.proxy_url + "/v1/completions", headers={"content-type": "application/json"},
                                 data=json.dumps({"model": "tiny", "prompt": ["a b c", "d e f"], "max_tokens": 2,
                                                  "temperature": 0}).encode())
    with urllib.request.urlopen(req, timeout=120) as resp:
        paths = [p.strip() for p in resp.headers["X-Disagg-Route"].split(",")]
    assert len(paths) == 2 and set(paths) <= {"split", "local", "whole"}
    metrics = get_text(auto_pd.proxy_url + "/metrics")
    routed = sum(sample_sum(metrics, "disagg_route_total", path=p) for p in ("split", "local", "whole"))
    served = sample_sum(metrics, "disagg_proxy_requests_total") - sample_sum(
        metrics, "disagg_proxy_requests_total", path="error")
    assert routed >= served >= 1
    assert sample_sum(metrics, "disagg_route_total", reason="predicted") >= 1


def test_a_backed_up_decode_engine_sends_a_prompt_whole_to_the_idle_prefill_engine(
        auto_pd: Running, tokenizer: Tokenizer) -> None:
    """Prompts that come faster than the decode engine prefills them: the first goes local (alike
    engines: a split never answers sooner at idle), and once the decode engine has prefills
    queued while the prefill engine has nothing to do, the policy itself sends one ``whole`` to
    the prefill engine (reason ``decode_backlog``), which answers it alone with the text the
    decode engine gives."""
    proxy, decode = auto_pd.proxy_url, auto_pd.engines["decode[0]"]

    def body(i: int, tag: str) -> dict:
        return {"model": "tiny", "prompt": exact_prompt(tokenizer, 600, f"{tag}-{i}"), "max_tokens": 6,
                "temperature": 0}

    for attempt in range(3):   # the fits carry what earlier tests measured: allow for a first round that differs
        tag = f"backlog{attempt}"
        before = get_text(proxy + "/metrics")
        answers: dict[int, tuple[str, str]] = {}

        def ask(i: int, tag: str = tag, answers: dict[int, tuple[str, str]] = answers) -> None:
            answers[i] = routed_stream(proxy, body(i, tag))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:       # 40 ms apart: each arrives after the previous one was sent on
            t.start()
            time.sleep(0.04)
        for t in threads:
            t.join(timeout=300)
        assert len(answers) == 4, answers
        after = get_text(proxy + "/metrics")
        wholes = [i for i, (route, _) in answers.items() if route == "whole"]
        if not wholes:
            print(f"round {attempt}: routes {[answers[i][0] for i in range(4)]}; asking again")
            continue
        counted = (sample_sum(after, "disagg_route_total", path="whole", reason="decode_backlog")
                   - sample_sum(before, "disagg_route_total", path="whole", reason="decode_backlog"))
        assert counted == len(wholes)
        print(f"round {attempt}: routes {[answers[i][0] for i in range(4)]}")
        for i in wholes:
            assert answers[i][1] == plain_answer(decode, body(i, tag))
        return
    raise AssertionError("no prompt went whole in 3 rounds of 4 prompts sent 40 ms apart")

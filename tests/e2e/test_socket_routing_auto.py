"""Issue 13's conformance suite under issue 15's default routing (``auto``): a 1P1D with the socket
connector whose proxy picks each prompt's path; every answer is still the one a single vLLM server
gives, whichever path served it, and the paths taken are named in the header and the metrics.

The deployment is this module's own; it sorts after the other socket modules and starts only
once no other engine on the session's model runs (never more than two engines at once).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from disagg.prometheus_text import sample_sum
from tests.e2e.conformance import CASE_NAMES, Recorded, check_case
from tests.e2e.engines import Running, bring_up_socket_pd, engine_processes, get_text

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

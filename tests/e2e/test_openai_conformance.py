"""The conformance suite against the NIXL 1P1D (the session's `pd` deployment).

Every case of tests/e2e/conformance.py goes to the proxy; its reply must equal what one
colocated vLLM server answered to the same bytes (recorded by the `reference` fixture before
any 1P1D started). Plus: a batched request hands every prompt's KV to the decode engine.
"""

from __future__ import annotations

import pytest

from harness.engines import Running
from tests.e2e.conformance import CASE_NAMES, KV_CASE, Recorded, check_case, check_kv_batch, claim_problems
from tests.e2e.shared_deployment import NIXL

pytestmark = pytest.mark.e2e
SHARED_DEPLOYMENT = NIXL


@pytest.mark.parametrize("name", [*CASE_NAMES, KV_CASE])
def test_reference_reply_exercises_the_case(conformance_reference: dict[str, Recorded], name: str) -> None:
    """One vLLM server's reply shows what the case is about (e.g. the stop string did stop it)."""
    rec = conformance_reference[name]
    problems = claim_problems(name, rec.payload, rec.reply)
    assert not problems, f"{name}: {problems}\nreference raw: {rec.reply.raw[:600]!r}"


def test_batched_request_moves_every_prompts_kv(pd: Running, conformance_reference: dict[str, Recorded]) -> None:
    check_kv_batch(pd.proxy_url, pd.engines["decode[0]"], conformance_reference[KV_CASE], "nixl")


@pytest.mark.parametrize("name", CASE_NAMES)
def test_answers_like_one_vllm_server(pd: Running, conformance_reference: dict[str, Recorded], name: str) -> None:
    check_case(pd.proxy_url, name, conformance_reference[name])

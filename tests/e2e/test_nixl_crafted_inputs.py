"""Crafted inputs against the NIXL 1P1D (`pd`): no request can harm an engine.

Each case of tests/e2e/crafted.py goes to the proxy (a clear answer, never a
5xx, within its timeout) and straight to both engines without the engine key
(refused: 4xx, or the connection closed on an oversized request). Afterwards
every engine is healthy and idle. NIXL's stock connector cannot validate
`kv_transfer_params`, so for NIXL the proxy's stripping and the engine key are
the defence; the socket connector's own validation is tested with the key in
tests/e2e/test_socket_conformance.py.
"""

from __future__ import annotations

import pytest

from harness.engines import Running
from tests.e2e.crafted import cases, engines_idle_and_alive, send
from tests.e2e.front_door import large_batch_memory, served_during_slowloris, unserved_paths_reaching_engines
from tests.e2e.shared_deployment import NIXL

pytestmark = pytest.mark.e2e
SHARED_DEPLOYMENT = NIXL

CASES = cases()


def test_there_are_at_least_twenty_cases() -> None:
    assert len(CASES) >= 20
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_crafted_input_gets_a_clear_answer(pd: Running, case) -> None:
    answer = send(pd.proxy_url, case)
    assert answer.status in case.proxy_status, (case.name, answer.status, answer.body[:300])
    for name, url in pd.engines.items():
        direct = send(url, case)
        assert direct.status in case.engine_status, (case.name, name, direct.status, direct.body[:300])


def test_no_dot_segment_or_unserved_path_reaches_an_engine(pd: Running) -> None:
    statuses, reached = unserved_paths_reaching_engines(pd)
    assert set(statuses.values()) <= {404, 405}, statuses
    assert reached == 0, f"the engines' request counters grew by {reached:.0f}"


def test_a_large_batch_costs_the_proxy_bounded_memory(pd: Running) -> None:
    """100 prompts beside a 1 MB field: every prompt answered, the proxy's RSS grows by well
    under 100 MiB (one full copy of the body per prompt was once 100 MB more)."""
    got = large_batch_memory(pd, prompts=100, shared_bytes=1024 * 1024)
    assert got.status == 200 and got.choices == 100, got
    assert got.rss_growth_mib < 100, got
    print(f"\nproxy RSS growth for 100 prompts x 1 MB through NIXL 1P1D: {got.rss_growth_mib:.0f} MiB "
          f"({got.seconds:.1f} s)")


def test_legitimate_requests_are_served_during_slowloris(pd: Running) -> None:
    flood = served_during_slowloris(pd)
    assert flood.served == flood.sent, flood
    print(f"\nserved {flood.served}/{flood.sent} beside 64 unfinished heads and 16 unfinished bodies")


def test_engines_alive_and_idle_after_crafted_inputs(pd: Running) -> None:
    assert engines_idle_and_alive(pd.engines) == []

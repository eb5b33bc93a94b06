"""Crafted inputs against the NIXL 1P1D (`pd`): no request can harm an engine.

Each case of tests/e2e/crafted.py goes to the proxy (a clear answer, never a
5xx, within its timeout) and straight to both engines without the engine key
(refused: 4xx, or the connection closed on an oversized request). Afterwards
every engine is healthy and idle. NIXL's stock connector cannot validate
`kv_transfer_params`, so for NIXL the proxy's stripping and the engine key are
the defence; the socket connector's own validation is tested with the key in
tests/e2e/test_socket_conformance.py.

The file name sorts after the modules that start engines of their own (test_emulated_link,
test_launch_failures: `pd` must not run then) and before test_pd.py, whose last tests stop `pd`.
"""

from __future__ import annotations

import pytest

from tests.e2e.crafted import cases, engines_idle_and_alive, send
from tests.e2e.engines import Running

pytestmark = pytest.mark.e2e

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


def test_engines_alive_and_idle_after_crafted_inputs(pd: Running) -> None:
    assert engines_idle_and_alive(pd.engines) == []

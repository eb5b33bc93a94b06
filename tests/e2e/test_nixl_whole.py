"""The routing's ``whole`` path on NIXL: the session's prefill engine (a kv_producer) answers the
client's own request alone, like one vLLM server, streamed or not, and stays usable for the handoff.
"""

from __future__ import annotations

import pytest

from harness.engines import Running, plain_answer, post_json
from tests.e2e.shared_deployment import NIXL

pytestmark = pytest.mark.e2e
SHARED_DEPLOYMENT = NIXL


def test_prefill_engine_serves_a_plain_request_alone(pd: Running, reference: dict[str, str],
                                                    requests_: dict[str, dict]) -> None:
    prefill = pd.engines["prefill[0]"]
    for name in ("whole-completion", "whole-chat"):
        assert plain_answer(prefill, requests_[name]) == reference[name]
    streamed = {**requests_["whole-stream"], "stream": True}
    assert plain_answer(prefill, streamed) == reference["whole-stream"]
    # the handoff still works through that engine afterwards
    reply = post_json(pd.proxy_url + "/v1/completions", requests_["whole-after"])
    assert reply["choices"][0]["text"] == reference["whole-after"]

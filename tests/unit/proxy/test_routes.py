"""Per-prompt routes and the merge of a batch's replies (pure functions)."""

from __future__ import annotations

import json

import pytest
from multidict import CIMultiDict

from disagg.proxy.merge import merge_replies, merge_usage_chunks, reindex
from disagg.proxy.routes import (
    CHAT,
    COMPLETIONS,
    GenerationRequest,
    RoutePath,
    batch_prompts,
    local_reason,
    plan_request,
    strip_kv_params,
)


def request(body: dict, endpoint: str = COMPLETIONS) -> GenerationRequest:
    return GenerationRequest(endpoint, body, json.dumps(body).encode(), CIMultiDict({"X-Request-Id": "r"}), "r")


@pytest.mark.parametrize(("prompt", "expected"), [
    ("one", None), ([1, 2, 3], None), (["only"], None), ([[1, 2]], None),
    (["a", "b"], ["a", "b"]), ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_batch_prompts(prompt: object, expected: object) -> None:
    assert batch_prompts({"prompt": prompt}) == expected


@pytest.mark.parametrize("prompt", [5, [], ["a", [1]], [[1], "a"], [[]], [True, 1], {"a": 1}, [1.5], [["a"]]])
def test_unrecognised_prompt_shapes(prompt: object) -> None:
    with pytest.raises(ValueError):
        batch_prompts({"prompt": prompt})


@pytest.mark.parametrize(("body", "reason"), [
    ({"n": 2}, "n"), ({"n": "2"}, "n"), ({"use_beam_search": True}, "n"), ({"prompt_logprobs": 0}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 0}, "prompt_logprobs"), ({"max_tokens": 0}, "max_tokens_0"),
    ({"prompt_embeds": "AAAA"}, "prompt_embeds"), ({"n": 1, "echo": True}, None), ({"logprobs": 2}, None),
    # fields the proxy reads, with values vLLM refuses (pydantic, lax): decode answers its own 400
    ({"stream": "abc"}, "invalid_field"), ({"n": "two"}, "invalid_field"), ({"max_tokens": [1]}, "invalid_field"),
    ({"echo": 2}, "invalid_field"),
    # ... and values vLLM coerces, read as it reads them
    ({"stream": "false"}, None), ({"max_tokens": "0"}, "max_tokens_0"), ({"n": "1"}, None),
    ({"use_beam_search": "yes"}, "n"),
])
def test_local_reasons(body: dict, reason: str | None) -> None:
    assert local_reason(COMPLETIONS, body) == reason


def test_chat_echo_with_logprobs_still_splits() -> None:
    assert local_reason(CHAT, {"echo": True, "logprobs": True}) is None


def test_strip_kv_params_everywhere_a_client_can_put_them() -> None:
    body = {"prompt": "p", "kv_transfer_params": {"do_remote_prefill": True},
            "vllm_xargs": {"kv_transfer_params": "x", "keep": 1}}
    out, changed = strip_kv_params(body)
    assert changed and out == {"prompt": "p", "vllm_xargs": {"keep": 1}}
    assert "kv_transfer_params" in body, "the client's body is not changed"
    assert strip_kv_params({"prompt": "p", "kv_transfer_params": None}) == ({"prompt": "p"}, True)
    assert strip_kv_params({"prompt": "p"}) == ({"prompt": "p"}, False)
    # not an object: the engine refuses it with 400, as a single server does
    assert strip_kv_params({"prompt": "p", "kv_transfer_params": "x"}) == (
        {"prompt": "p", "kv_transfer_params": "x"}, False)


def test_batch_becomes_one_route_per_prompt_with_its_own_request_id() -> None:
    plan = plan_request(request({"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 4}), split=True)
    assert plan.batched
    assert [r.path for r in plan.routes] == [RoutePath.SPLIT] * 3
    assert [r.request.body["prompt"] for r in plan.routes] == ["a", "b", "c"]
    assert [r.request.request_id for r in plan.routes] == ["r-0", "r-1", "r-2"]
    assert [r.request.headers["X-Request-Id"] for r in plan.routes] == ["r-0", "r-1", "r-2"]
    assert json.loads(plan.routes[1].request.raw) == {"model": "m", "prompt": "b", "max_tokens": 4}


def test_a_batch_reads_stream_as_vllm_does() -> None:
    assert not plan_request(request({"prompt": ["a", "b"], "stream": "false"}), split=True).request.stream
    assert plan_request(request({"prompt": ["a", "b"], "stream": "true"}), split=True).request.stream


def test_sub_request_bodies_share_the_fields_serialised_once() -> None:
    body = {"model": "m", "prompt": [[1, 2], [3]], "user": "u" * 1000, "stream": True}
    plan = plan_request(request(body), split=True)
    shared = {id(r.request.shared) for r in plan.routes}
    assert len(shared) == 1 and None not in {r.request.shared for r in plan.routes}
    assert [json.loads(r.request.raw) for r in plan.routes] == [{**body, "prompt": [1, 2]}, {**body, "prompt": [3]}]
    lone = plan_request(request({"prompt": ["a", "b"]}), split=True)
    assert json.loads(lone.routes[1].request.raw) == {"prompt": "b"}


def test_single_prompt_keeps_the_clients_bytes() -> None:
    req = request({"prompt": "a"})
    plan = plan_request(req, split=True)
    assert not plan.batched and plan.routes[0].request is req and plan.routes[0].path is RoutePath.SPLIT


@pytest.mark.parametrize(("body", "reason"), [
    ({"prompt": ["a", "b"], "n": 2}, "n"), ({"prompt": ["a", 5]}, "prompt_shape"),
    ({"prompt": "a", "prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_local_requests_stay_whole(body: dict, reason: str) -> None:
    plan = plan_request(request(body), split=True)
    assert [(r.path, r.reason, r.request.body) for r in plan.routes] == [(RoutePath.LOCAL, reason, body)]


def test_colocated_and_engines_without_local_serving() -> None:
    body = {"prompt": ["a", "b"], "n": 2}
    assert plan_request(request(body), split=False).routes[0].reason == "colocated"
    [route] = plan_request(request(body), split=True, local=False).routes
    assert route.path is RoutePath.SPLIT


def test_merge_replies_like_vllm() -> None:
    def reply(text: str, prompt: int, completion: int) -> dict:
        return {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "tiny",
                "choices": [{"index": 0, "text": text, "finish_reason": "length", "logprobs": None}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion, "prompt_tokens_details": None},
                "kv_transfer_params": None, "metrics": {"ttft": 1}}
    merged = merge_replies([reply("a", 3, 2), reply("b", 5, 4), reply("c", 1, 1)], "req")
    assert merged["id"] == "cmpl-req"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "a"), (1, "b"), (2, "c")]
    assert merged["usage"] == {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16,
                               "prompt_tokens_details": None}
    assert merged["metrics"] is None and merged["object"] == "text_completion"


def test_stream_chunks_reindexed_and_usage_summed() -> None:
    chunk = reindex({"id": "cmpl-r-2", "choices": [{"index": 0, "text": "x"}]}, 2, "cmpl-r")
    assert chunk == {"id": "cmpl-r", "choices": [{"index": 2, "text": "x"}]}
    usage = merge_usage_chunks([{"id": "a", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1,
                                                                       "total_tokens": 3}},
                                {"id": "b", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2,
                                                                       "total_tokens": 6}}], "r")
    assert usage == {"id": "cmpl-r", "choices": [],
                     "usage": {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}}

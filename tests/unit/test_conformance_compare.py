"""The conformance suite's helpers (tests/e2e/conformance.py) on hand-made replies: no engines."""

from __future__ import annotations

import json

import pytest

from disagg.modelgen import build_model
from disagg.prompts import load_tokenizer
from tests.e2e.conformance import (
    CASE_NAMES,
    CHAT,
    KV_CASE,
    KV_CASE_TOKENS,
    MAX_MODEL_LEN,
    Reply,
    SSEReader,
    build_cases,
    claim_problems,
    compare,
    kv_moved_problems,
    normalise,
    pick_stop,
    record,
    request_flags,
)

SSE = "text/event-stream; charset=utf-8"


def event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk(index: int, text: str, finish: str | None = None, logprobs: dict | None = None,
          stop_reason: object = None) -> dict:
    return {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "tiny",
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                         "stop_reason": stop_reason}]}


def usage_chunk(prompt: int, completion: int) -> dict:
    return {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "tiny", "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def lp(tokens: list[str], values: list[float], offset: int = 0) -> dict:
    return {"text_offset": list(range(offset, offset + len(tokens))), "token_logprobs": values, "tokens": tokens,
            "top_logprobs": [{t: v} for t, v in zip(tokens, values, strict=True)]}


DONE = b"data: [DONE]\n\n"


def two_choice_stream() -> list[bytes]:
    return [event(chunk(0, "Hel", logprobs=lp(["Hel"], [-0.5]))),
            event(chunk(1, "Wo", logprobs=lp(["Wo"], [-1.0]))),
            event(chunk(0, "lo", "length", lp(["lo"], [-0.25], 1))),
            event(chunk(1, "rld", "stop", lp(["rld"], [-2.0], 1), stop_reason="!")),
            event(usage_chunk(10, 4)), DONE]


def completion(choices: list[dict], **extra: object) -> bytes:
    body = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "tiny", "choices": choices,
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            "system_fingerprint": None, "kv_transfer_params": None, **extra}
    return json.dumps(body).encode()


def choice(index: int, text: str, logprob: float = -0.5, token: str = "a") -> dict:
    return {"index": index, "text": text, "finish_reason": "length", "stop_reason": None,
            "logprobs": {"tokens": [token], "token_logprobs": [logprob], "text_offset": [0],
                         "top_logprobs": [{token: logprob, "b": -3.0}]},
            "prompt_logprobs": [None, {"17": {"logprob": -4.5, "rank": 2, "decoded_token": "x"}}]}


# ---------------------------------------------------------------------------- streams

def test_sse_reader_keeps_an_event_split_across_reads() -> None:
    data = b"".join(two_choice_stream()) + event(chunk(2, "caf\u00e9 \u2603"))
    for size in (1, 2, 3, 7, 64):
        reader = SSEReader()
        for i in range(0, len(data), size):
            reader.feed(data[i:i + size])
        assert len(reader.events) == 7, size
        assert reader.events[-1].endswith('"stop_reason": null}]}')
        assert "caf\u00e9 \u2603" in json.loads(reader.events[-1][6:])["choices"][0]["text"]
        assert reader.leftover() == b""


def test_stream_joined_per_choice_index_whatever_the_reads() -> None:
    data = b"".join(two_choice_stream())
    whole = normalise(200, SSE, [data], expect_usage=True)
    split = normalise(200, SSE, [data[:5], data[5:41], data[41:42], data[42:]], expect_usage=True)
    assert whole.problems == [] and split.problems == []
    assert whole.kind == "stream" and whole.body == split.body
    c0, c1 = whole.body["choices"][0], whole.body["choices"][1]
    assert (c0["text"], c0["finish_reason"], c0["stop_reason"]) == ("Hello", "length", None)
    assert (c1["text"], c1["finish_reason"], c1["stop_reason"]) == ("World", "stop", "!")
    assert c0["logprobs"]["tokens"] == ["Hel", "lo"] and c0["logprobs"]["token_logprobs"] == [-0.5, -0.25]
    assert c0["logprobs"]["top_logprobs"] == [{"Hel": -0.5}, {"lo": -0.25}]
    assert whole.body["usage"] == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
    assert whole.body["object"] == ["text_completion"] and whole.body["model"] == ["tiny"]


def test_chat_stream_joins_deltas() -> None:
    def chat_chunk(delta: dict, finish: str | None = None) -> dict:
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    events = [chat_chunk({"role": "assistant", "content": ""}), chat_chunk({"content": "Hi"}),
              chat_chunk({"content": " there"}), chat_chunk({"content": "!"}, "length")]
    reply = normalise(200, SSE, [b"".join(event(e) for e in events) + DONE])
    assert reply.problems == []
    assert reply.body["choices"][0]["delta"] == {"role": "assistant", "content": "Hi there!"}
    assert reply.body["choices"][0]["finish_reason"] == "length" and reply.body["usage"] is None


@pytest.mark.parametrize(("chunks", "usage", "problem"), [
    (two_choice_stream()[:-1], True, "no data: [DONE]"),
    ([*two_choice_stream(), DONE], True, "data: [DONE] 2 times"),
    ([*two_choice_stream()[:-1], DONE, event(usage_chunk(1, 1))], True, "data: [DONE] is not the last event"),
    ([*two_choice_stream()[:3], *two_choice_stream()[4:]], True, "choice 1: finish_reason 0 times"),
    ([*two_choice_stream()[:4], event(chunk(1, "", "stop")), *two_choice_stream()[4:]], True,
     "choice 1: finish_reason 2 times"),
    ([*two_choice_stream()[:4], DONE], True, "include_usage asked, no usage chunk"),
    (two_choice_stream(), False, "a usage chunk without include_usage"),
    ([two_choice_stream()[4], *two_choice_stream()[:4], DONE], True,
     "the usage chunk is not the last event before data: [DONE]"),
    ([b": keep-alive\n\n", *two_choice_stream()], True, "event 0 is not one `data: ` line"),
    ([b"data: {nope\n\n", *two_choice_stream()], True, "event 0 is not JSON"),
    ([b"data: [1]\n\n", *two_choice_stream()], True, "event 0 is not a JSON object"),
    ([*two_choice_stream(), b"data: [DO"], True, "stream ends inside an event"),
    ([b'data: {"id": "x"}\n\n', *two_choice_stream()], True, "event 0 has no choices list"),
    ([*two_choice_stream()[:2], event(chunk(0, "x")), *two_choice_stream()[2:]], True, None),
    ([*two_choice_stream()[:3], event(chunk(0, "x")), *two_choice_stream()[3:]], True,
     "choice 0 continues after its finish_reason"),
])
def test_malformed_streams_are_reported(chunks: list[bytes], usage: bool, problem: str | None) -> None:
    reply = normalise(200, SSE, chunks, expect_usage=usage)
    if problem is None:
        assert reply.problems == []
    else:
        assert any(problem in p for p in reply.problems), reply.problems


def test_in_stream_error_events_are_joined() -> None:
    err = {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}
    reply = normalise(200, SSE, [event(chunk(0, "a")), event(err), DONE])
    assert reply.body["errors"] == ["InternalServerError"]
    assert "choice 0: finish_reason 0 times" in reply.problems


# ---------------------------------------------------------------------------- comparison

def test_equal_replies_ignore_ids_times_fingerprint_and_choice_order() -> None:
    ref = normalise(200, "application/json", [completion([choice(0, "x"), choice(1, "y")])])
    body = json.loads(completion([choice(1, "y"), choice(0, "x")]))
    body.update(id="cmpl-other", created=99, system_fingerprint="fp", metrics={"ttft": 1.0})
    got = normalise(200, "application/json", [json.dumps(body).encode()])
    assert compare(ref, got) == []


def test_logprobs_within_tolerance_pass_beyond_fail() -> None:
    ref = normalise(200, "application/json", [completion([choice(0, "x", -0.5)])])
    close = normalise(200, "application/json", [completion([choice(0, "x", -0.5009)])])
    far = normalise(200, "application/json", [completion([choice(0, "x", -0.502)])])
    assert compare(ref, close) == []
    diffs = compare(ref, far)
    assert any(".choices.0.logprobs.token_logprobs[0]" in d for d in diffs), diffs


def test_different_tokens_text_usage_finish_and_extra_fields_are_differences() -> None:
    ref = normalise(200, "application/json", [completion([choice(0, "x")])])

    def diffs_of(**changes: object) -> list[str]:
        body = json.loads(completion([choice(0, "x")]))
        for key, value in changes.items():
            if key in body:
                body[key] = value
            else:
                body["choices"][0][key] = value
        return compare(ref, normalise(200, "application/json", [json.dumps(body).encode()]))

    assert diffs_of(text="y")
    assert diffs_of(finish_reason="stop")
    assert diffs_of(stop_reason=7)
    assert diffs_of(usage={"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6})
    assert diffs_of(kv_transfer_params={"do_remote_prefill": True})
    assert diffs_of(logprobs={"tokens": ["b"], "token_logprobs": [-0.5], "text_offset": [0],
                              "top_logprobs": [{"b": -0.5, "a": -3.0}]})
    assert diffs_of(prompt_logprobs=None)
    assert diffs_of(prompt_logprobs=[None, {"17": {"logprob": -4.5, "rank": 3, "decoded_token": "x"}}])
    assert diffs_of(prompt_logprobs=[None, {"17": {"logprob": -4.5004, "rank": 2, "decoded_token": "x"}}]) == []
    two = json.loads(completion([choice(0, "x"), choice(1, "x")]))
    assert any("choices.1: unexpected" in d
               for d in compare(ref, normalise(200, "application/json", [json.dumps(two).encode()])))


def test_errors_compare_status_and_type_not_message() -> None:
    def error(status: int, type_: str, message: str) -> Reply:
        body = {"error": {"message": message, "type": type_, "param": None, "code": status}}
        return normalise(status, "application/json", [json.dumps(body).encode()])

    ref = error(400, "BadRequestError", "max_tokens: Input should be a valid integer")
    assert compare(ref, error(400, "BadRequestError", "something else entirely")) == []
    assert compare(ref, error(400, "Bad Request", "x")) == [".type: 'Bad Request', reference 'BadRequestError'"]
    assert compare(ref, error(500, "BadRequestError", "x")) == [
        "status 500 error type 'BadRequestError', reference 400 (reference error type 'BadRequestError')"]
    plain = normalise(500, "text/plain", [b"Internal Server Error"])
    assert plain.kind == "error" and plain.body["type"].startswith("<not JSON")
    assert compare(ref, normalise(200, "application/json", [completion([choice(0, "x")])]))[0].startswith("status 200")


def test_stream_against_json_and_malformed_proxy_stream() -> None:
    ref = normalise(200, SSE, two_choice_stream(), expect_usage=True)
    assert compare(ref, normalise(200, "application/json", [completion([])])) == ["reply kind json, reference stream"]
    bad = normalise(200, SSE, [*two_choice_stream(), DONE], expect_usage=True)
    assert compare(ref, bad) == ["malformed: data: [DONE] 2 times"]
    other_text = two_choice_stream()
    other_text[0] = event(chunk(0, "HeL", logprobs=lp(["HeL"], [-0.5])))
    diffs = compare(ref, normalise(200, SSE, other_text, expect_usage=True))
    assert ".choices.0.text: 'HeLlo', reference 'Hello'" in diffs
    assert any("logprobs.tokens[0]" in d for d in diffs) and any("top_logprobs[0].HeL" in d for d in diffs)


# ---------------------------------------------------------------------------- cases, stop, recording, metrics

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return load_tokenizer(build_model("tiny", tmp_path_factory.mktemp("m") / "tiny"))


def test_cases_have_exact_lengths_and_prompts_of_their_own(tokenizer) -> None:  # type: ignore[no-untyped-def]
    cases = build_cases(tokenizer)
    assert list(cases) == [*CASE_NAMES, KV_CASE]
    prompts: list[str] = []
    for case in cases.values():
        body = case.body or {}
        for p in (body.get("prompt"), *[m["content"] for m in body.get("messages", [])]):
            if isinstance(p, str):
                prompts.append(p)
            elif isinstance(p, list) and p and isinstance(p[0], str):
                prompts += p
            elif isinstance(p, list) and p and isinstance(p[0], list):
                prompts += [tokenizer.decode(ids[1:], skip_special_tokens=False) for ids in p]
            elif isinstance(p, list) and p:
                prompts.append(tokenizer.decode(p[1:], skip_special_tokens=False))
    tags = [p.split("]")[0] for p in prompts]
    assert len(tags) == len(set(tags)), "two prompts share a tag"
    kv = cases[KV_CASE].body
    assert kv is not None and [len(tokenizer.encode(p).ids) for p in kv["prompt"]] == list(KV_CASE_TOKENS)
    over = cases["over-context"].body
    assert over is not None
    n = len(tokenizer.encode(over["prompt"]).ids)
    assert n <= MAX_MODEL_LEN < n + over["max_tokens"]
    over_in = cases["over-input-batch-second"].body
    assert over_in is not None and len(tokenizer.encode(over_in["prompt"][1]).ids) > MAX_MODEL_LEN
    assert cases["deeply-nested-json"].payload().count(b"[") == 100_000
    assert cases["empty-body"].payload() == b""
    assert cases["chat-single"].endpoint == CHAT
    assert request_flags(cases["stream-n2"].payload()) == (True, True)
    assert request_flags(cases["n2"].payload()) == (False, False)
    assert request_flags(cases["deeply-nested-json"].payload()) == (False, False)


def test_pick_stop_takes_a_substring_after_the_start() -> None:
    text = " mill and the river runs"
    stop = pick_stop(text)
    assert stop.strip() and text.find(stop) > 0
    with pytest.raises(AssertionError):
        pick_stop("ab")


def test_record_derives_the_stop_case_from_the_reference_reply(monkeypatch: pytest.MonkeyPatch,
                                                               tokenizer) -> None:  # type: ignore[no-untyped-def]
    import tests.e2e.conformance as conformance

    sent: list[bytes] = []

    def fake_send(base_url: str, endpoint: str, payload: bytes, key: str | None = None, timeout: float = 300) -> Reply:
        sent.append(payload)
        return normalise(200, "application/json", [completion([choice(0, " the mill and the river")])])

    monkeypatch.setattr(conformance, "send", fake_send)
    case = build_cases(tokenizer)["stop-string"]
    recorded = record("http://ref", {"stop-string": case}, key="k")["stop-string"]
    assert len(sent) == 2 and "stop" not in json.loads(sent[0])
    final = json.loads(recorded.payload)
    assert final["stop"] == [pick_stop(" the mill and the river")] and recorded.payload == sent[1]


def metrics(nixl_bytes: float, external: float, local: float, failed: float = 0, fetches: float = 0) -> str:
    return f"""# HELP vllm:nixl_bytes_transferred x
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_sum{{engine="0"}} {nixl_bytes}
vllm:nixl_bytes_transferred_count{{engine="0"}} 1
# HELP vllm:nixl_num_failed_transfers x
# TYPE vllm:nixl_num_failed_transfers counter
vllm:nixl_num_failed_transfers_total{{engine="0"}} {failed}
# HELP vllm:socket_kv_bytes_received x
# TYPE vllm:socket_kv_bytes_received counter
vllm:socket_kv_bytes_received_total{{engine="0"}} {nixl_bytes}
# HELP vllm:socket_kv_transfers x
# TYPE vllm:socket_kv_transfers counter
vllm:socket_kv_transfers_total{{engine="0"}} {fetches}
# HELP vllm:socket_kv_failed_transfers x
# TYPE vllm:socket_kv_failed_transfers counter
vllm:socket_kv_failed_transfers_total{{engine="0"}} {failed}
# HELP vllm:prompt_tokens_by_source x
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{{engine="0",source="external_kv_transfer"}} {external}
vllm:prompt_tokens_by_source_total{{engine="0",source="local_compute"}} {local}
"""


def test_kv_moved_for_every_prompt_or_not() -> None:
    tokens = [64, 128, 192]
    before = metrics(1000, 10, 5)
    whole = metrics(1000 + 384 * 1024, 10 + 381, 5 + 3, fetches=3)
    assert kv_moved_problems(before, whole, "nixl", tokens, 16) == []
    assert kv_moved_problems(before, whole, "socket", tokens, 16) == []
    only_first = metrics(1000 + 64 * 1024, 10 + 63, 5 + 1 + 128 + 192, fetches=1)
    problems = kv_moved_problems(before, only_first, "socket", tokens, 16)
    assert len(problems) == 4, problems
    assert any("external_kv_transfer grew by 63, expected 381..384" in p for p in problems)
    failed = metrics(1000 + 384 * 1024, 10 + 381, 5 + 3, failed=1, fetches=3)
    assert kv_moved_problems(before, failed, "nixl", tokens, 16) == ["vllm:nixl_num_failed_transfers_total grew by 1"]


def test_claims_tell_whether_the_reference_reply_exercises_the_case() -> None:
    def reply(text: str, finish: str, stop_reason: object, prompt: int = 5, generated: int = 3) -> Reply:
        body = {"object": "text_completion", "model": "tiny",
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "stop_reason": stop_reason}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": generated,
                          "total_tokens": prompt + generated}}
        return normalise(200, "application/json", [json.dumps(body).encode()])

    def error(status: int) -> Reply:
        return normalise(status, "application/json", [b'{"error": {"type": "x"}}'])

    stop_body = json.dumps({"prompt": "p", "max_tokens": 16, "stop": ["mil"]}).encode()
    assert claim_problems("stop-string", stop_body, reply(" the ", "stop", "mil")) == []
    assert claim_problems("stop-string", stop_body, reply(" the mill", "length", None))
    over = json.dumps({"prompt": "p", "max_tokens": 16}).encode()
    assert claim_problems("over-context", over, reply("x", "length", None, MAX_MODEL_LEN - 12, 12)) == []
    assert claim_problems("over-context", over, reply("x", "length", None, MAX_MODEL_LEN - 20, 16))
    assert claim_problems("unknown-model", b"{}", error(404)) == []
    assert claim_problems("unknown-model", b"{}", error(400)) == ["status 400, meant 404"]
    assert claim_problems("deeply-nested-json", b"[[", normalise(500, "text/plain", [b"oops"])) == []
    two = json.dumps({"prompt": ["a", "b"], "max_tokens": 4}).encode()
    assert claim_problems("batch-strings-equal", two, reply("x", "length", None)) == [
        "choices [0] for 2 prompt(s), n=1"]

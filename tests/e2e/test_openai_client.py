"""The official `openai` client against the proxy over real 1P1D gives the same
greedy text as against a colocated vLLM server: sync and async, streaming and
not, completions and chat."""

from __future__ import annotations

import openai
import pytest

from harness.engines import Running
from tests.e2e.shared_deployment import NIXL

pytestmark = pytest.mark.e2e
SHARED_DEPLOYMENT = NIXL


@pytest.mark.parametrize("stream", [False, True])
def test_sync_completions(pd: Running, reference: dict[str, str], requests_: dict[str, dict], stream: bool) -> None:
    name = "sync-completion-stream" if stream else "sync-completion"
    client = openai.OpenAI(base_url=pd.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(**requests_[name], stream=True)
                       if c.choices)
    else:
        text = client.completions.create(**requests_[name]).choices[0].text
    assert text == reference[name]


@pytest.mark.parametrize("stream", [False, True])
def test_sync_chat(pd: Running, reference: dict[str, str], requests_: dict[str, dict], stream: bool) -> None:
    name = "sync-chat-stream" if stream else "sync-chat"
    client = openai.OpenAI(base_url=pd.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    if stream:
        chunks = client.chat.completions.create(**requests_[name], stream=True,
                                                stream_options={"include_usage": True})
        parts, usage = [], None
        for chunk in chunks:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        text = "".join(parts)
        assert usage is not None and usage.completion_tokens == 24
    else:
        text = client.chat.completions.create(**requests_[name]).choices[0].message.content
    assert text == reference[name]


@pytest.mark.parametrize("stream", [False, True])
async def test_async_completions(pd: Running, reference: dict[str, str], requests_: dict[str, dict],
                                 stream: bool) -> None:
    name = "async-completion-stream" if stream else "async-completion"
    client = openai.AsyncOpenAI(base_url=pd.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        if stream:
            parts = [c.choices[0].text async for c in
                     await client.completions.create(**requests_[name], stream=True) if c.choices]
            text = "".join(parts)
        else:
            text = (await client.completions.create(**requests_[name])).choices[0].text
    finally:
        await client.close()
    assert text == reference[name]


@pytest.mark.parametrize("stream", [False, True])
async def test_async_chat(pd: Running, reference: dict[str, str], requests_: dict[str, dict], stream: bool) -> None:
    name = "async-chat-stream" if stream else "async-chat"
    client = openai.AsyncOpenAI(base_url=pd.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        if stream:
            parts = [c.choices[0].delta.content or "" async for c in
                     await client.chat.completions.create(**requests_[name], stream=True) if c.choices]
            text = "".join(parts)
        else:
            text = (await client.chat.completions.create(**requests_[name])).choices[0].message.content
    finally:
        await client.close()
    assert text == reference[name]


def test_models_lists_the_served_name(pd: Running) -> None:
    client = openai.OpenAI(base_url=pd.proxy_url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]

"""The official `openai` client (sync and async, streaming and not) against the real gateway server."""

from __future__ import annotations

import asyncio

import openai
import pytest

from gateway.harness import MODEL_NAME

MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture
def oai(gateway):
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def spec(obj) -> dict:
    """TIDE's extra `speculation` field (kept by the client's models as an extra attribute)."""
    value = obj.model_extra["speculation"]
    assert {"accept_length", "draft_tokens", "accepted_tokens", "draft_version"} <= set(value)
    return value


def test_models(oai):
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert oai.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")


def test_chat_sync(oai):
    response = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0, n=2)
    assert response.object == "chat.completion" and len(response.choices) == 2
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 16
    spec(response)


def test_chat_sync_stream_with_usage(oai):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=8, temperature=0)
    full = oai.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(oai.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    spec(chunks[-1])


def test_completion_sync_and_stream(oai):
    response = oai.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert response.object == "text_completion" and response.choices[0].text
    stream = oai.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == response.choices[0].text
    spec(chunks[-1])


def test_a_resent_conversation_is_served_from_the_prefix_cache(oai):
    """OpenAI's `usage.prompt_tokens_details.cached_tokens`: a second turn that resends a long system
    message finds it cached, and the same request again gives the same answer from the cache. (The
    test worker computes in float32, where the cache reuses whole 256-token prefill chunks.)"""
    system = "You are a terse assistant. " + " ".join(f"Rule {i}: answer in plain words only." for i in range(80))
    ask = [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]
    kwargs = dict(model=MODEL_NAME, max_tokens=8, temperature=0)
    first = oai.chat.completions.create(messages=ask, **kwargs)
    again = oai.chat.completions.create(messages=ask, **kwargs)
    turn2 = [*ask, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Another one."}]
    second = oai.chat.completions.create(messages=turn2, **kwargs)
    assert first.usage.prompt_tokens > 512
    assert again.choices[0].message.content == first.choices[0].message.content
    for response in (again, second):
        cached = response.usage.prompt_tokens_details.cached_tokens
        assert cached >= 512 and cached % 256 == 0 and cached < response.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < 256


def test_extra_body_speculative_false(oai):
    response = oai.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"speculative": False}
    )
    assert spec(response)["draft_tokens"] == 0


def test_errors_raise_the_clients_exceptions(oai):
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=3)
    assert err.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, web_search_options={})
    assert err.value.code == "unsupported_parameter" and err.value.param == "web_search_options"
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, extra_body={"use_beam_search": True})
    assert err.value.code == "unknown_parameter" and err.value.param == "use_beam_search"
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL_NAME, messages=[])
    assert err.value.param == "messages"


def test_async_client_stream_and_not(gateway):
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0) as client:
            kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=0)
            full, stream = await asyncio.gather(
                client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs, stream=True)
            )
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            completion = await client.completions.create(model=MODEL_NAME, prompt=[1, 2, 3], max_tokens=4)
            return full, text, chunks, completion

    full, text, chunks, completion = asyncio.run(run())
    assert text == full.choices[0].message.content
    spec(full)
    spec(chunks[-1])
    assert completion.usage.prompt_tokens == 3 and completion.usage.completion_tokens <= 4

"""Anthropic's Messages API (`/v1/messages`) through the official `anthropic` client (sync, async, streamed,
and its stream helper) against the real stack (real worker, real gateway): the text equals chat's for the
same conversation, a stream gives the same blocks as a whole message, a tool round trip works, stop
sequences, prefill, structured output, token counting, `x-api-key` auth, greedy output identical with
speculation on and off, and errors in Anthropic's shape."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema_rs
import openai
import pytest

from gateway.harness import MODEL_NAME, serve_gateway

MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                       "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


@pytest.fixture
def claude(gateway):
    with anthropic.Anthropic(base_url=gateway, api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture
def oai(gateway):
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def message(claude, speculative: bool | None = None, **kwargs):
    options = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=16)
    extra = {"temperature": 0, **({} if speculative is None else {"speculative": speculative})}
    return claude.messages.create(**{**options, **kwargs}, extra_body=extra)


def chat_text(oai, messages, max_tokens=16, **kwargs) -> str:
    r = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0,
                                    **kwargs)
    return r.choices[0].message.content


def text_of(m) -> str:
    return "".join(b.text for b in m.content if b.type == "text")


def test_text_is_chats_with_usage_and_speculation(claude, oai):
    m = message(claude, system="Be brief.")
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL_NAME
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert text_of(m) == chat_text(oai, [{"role": "system", "content": "Be brief."}, *MESSAGES]) and text_of(m)
    assert m.usage.output_tokens == 16 and m.usage.input_tokens + m.usage.cache_read_input_tokens > 0
    assert {"accept_length", "draft_tokens", "accepted_tokens"} <= set(m.model_extra["speculation"])
    blocks = [{"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]}]
    assert text_of(message(claude, messages=blocks, system=[{"type": "text", "text": "Be brief."}])) == text_of(m)


def test_speculation_on_and_off_give_the_same_text(claude):
    on, off = message(claude, True, max_tokens=48), message(claude, False, max_tokens=48)
    assert off.model_extra["speculation"]["draft_tokens"] == 0 < on.model_extra["speculation"]["draft_tokens"]
    assert text_of(on) == text_of(off)


def test_stream_gives_the_same_blocks(claude):
    whole = message(claude, max_tokens=24)
    with claude.messages.stream(model=MODEL_NAME, messages=MESSAGES, max_tokens=24,
                                extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(final) == text_of(whole)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 24
    raw = claude.messages.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, stream=True,
                                 extra_body={"temperature": 0})
    kinds = [e.type for e in raw]
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_tool_round_trip(claude):
    kwargs = dict(tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True}, max_tokens=64)
    first = message(claude, **kwargs)
    assert first.stop_reason == "tool_use"
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema_rs.validate(WEATHER["input_schema"], call.input)
    with claude.messages.stream(model=MODEL_NAME, messages=MESSAGES, extra_body={"temperature": 0},
                                **kwargs) as stream:
        final = stream.get_final_message()
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (call.name, call.input) and final.stop_reason == "tool_use"
    history = [*MESSAGES, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": json.dumps({"temperature": 18})}]}]
    second = message(claude, messages=history, tools=[WEATHER])
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use") and second.content


def test_stop_sequences(claude):
    text = text_of(message(claude, max_tokens=24))
    stop = text[8:12]
    assert stop.strip()
    m = message(claude, max_tokens=24, stop_sequences=["NEVER-THERE", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert text_of(m) == text[: text.index(stop)]


def test_prefill_continues_the_assistant_turn(claude, oai):
    prefill = [*MESSAGES, {"role": "assistant", "content": "Once upon a time"}]
    m = message(claude, messages=prefill)
    assert text_of(m) == chat_text(oai, prefill, extra_body={"continue_final_message": True})


def test_output_format_json_schema(claude):
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green"]}},
              "required": ["color"], "additionalProperties": False}
    m = message(claude, max_tokens=32, output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema_rs.validate(schema, json.loads(text_of(m)))


def test_count_tokens_is_the_prompt_size(claude):
    counted = claude.messages.count_tokens(model=MODEL_NAME, messages=MESSAGES, system="Be brief.")
    m = message(claude, system="Be brief.", max_tokens=1)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_async_client(gateway):
    async def run():
        async with anthropic.AsyncAnthropic(base_url=gateway, api_key="unused", max_retries=0) as client:
            kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, extra_body={"temperature": 0})
            whole = await client.messages.create(**kwargs)
            async with client.messages.stream(**kwargs) as stream:
                streamed = "".join([t async for t in stream.text_stream])
            return text_of(whole), streamed

    whole, streamed = asyncio.run(run())
    assert whole == streamed and whole


@pytest.mark.parametrize("body", [
    {"frobnicate": 1},
    {"temperature": 1.5},
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
    {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]},
])
def test_errors_have_anthropics_shape(claude, gateway, body):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, extra_body=body)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-sonnet-4-5", messages=MESSAGES, max_tokens=4)
    raw = httpx.post(f"{gateway}/v1/messages", json={"model": MODEL_NAME, "messages": MESSAGES})  # no max_tokens
    assert raw.status_code == 400 and raw.json()["error"]["message"] == "Missing required parameter: 'max_tokens'."


def test_x_api_key_authenticates(tokenizer, worker):
    with serve_gateway(tokenizer, (worker.address,), api_keys=frozenset({"sk-local"})) as url:
        with anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0) as bad:
            with pytest.raises(anthropic.AuthenticationError) as err:
                bad.messages.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
            assert err.value.body["error"]["type"] == "authentication_error"
        with anthropic.Anthropic(base_url=url, api_key="sk-local", max_retries=0) as good:
            assert good.messages.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2).usage.output_tokens == 2

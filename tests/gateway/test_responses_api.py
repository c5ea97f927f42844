"""OpenAI's Responses API (`/v1/responses`) through the official `openai` client (sync, async, streamed)
against the real stack (real worker, real gateway): the text equals chat's for the same conversation,
streams give the same items as whole responses (and the client's own stream accumulator agrees),
function tools make a round trip, `text.format` json_schema constrains the output, a second turn
continues by `previous_response_id`, stored responses can be retrieved and deleted, and greedy output is
identical with speculation on and off. Strictness as the client's errors."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema_rs
import openai
import pytest

from gateway.harness import MODEL_NAME, serve_gateway
from services.gateway.response_store import ResponseStore

PROMPT = "Tell me a story about a cat."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                       "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
COLOR = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
         "required": ["color"], "additionalProperties": False}


@pytest.fixture
def oai(gateway):
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def respond(oai, speculative: bool | None = None, **kwargs):
    options = dict(model=MODEL_NAME, input=PROMPT, max_output_tokens=16, temperature=0)
    extra = {} if speculative is None else {"speculative": speculative}
    return oai.responses.create(**{**options, **kwargs}, extra_body=extra)


def chat_text(oai, messages, max_tokens=16, **kwargs) -> str:
    r = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0,
                                    **kwargs)
    return r.choices[0].message.content


def test_text_is_chats_with_usage_and_speculation(oai):
    r = respond(oai, instructions="Be brief.")
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL_NAME
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    assert r.output_text == chat_text(oai, messages) and r.output_text
    assert r.usage.output_tokens == 16 and r.usage.total_tokens == r.usage.input_tokens + 16
    assert r.instructions == "Be brief." and r.max_output_tokens == 16 and r.store is True
    assert {"accept_length", "draft_tokens", "accepted_tokens"} <= set(r.model_extra["speculation"])
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": PROMPT}]}]
    assert respond(oai, input=items).output_text == r.output_text  # the same conversation as items


def test_speculation_on_and_off_give_the_same_text(oai):
    on, off = respond(oai, True, max_output_tokens=48), respond(oai, False, max_output_tokens=48)
    assert off.model_extra["speculation"]["draft_tokens"] == 0 < on.model_extra["speculation"]["draft_tokens"]
    assert on.output_text == off.output_text


def events_of(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_stream_gives_the_same_items(oai):
    whole = respond(oai, max_output_tokens=24)
    events = events_of(respond(oai, max_output_tokens=24, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[0].response.status == "in_progress" and events[-1].response.usage.output_tokens == 24
    assert "speculation" in events[-1].response.model_extra


def test_function_tool_round_trip_streamed_and_whole(oai):
    kwargs = dict(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_output_tokens=64)
    first = respond(oai, **kwargs)
    assert first.status == "completed"
    [call] = [i for i in first.output if i.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema_rs.validate(WEATHER["parameters"], json.loads(call.arguments))
    # the client's stream helper reassembles the same call from the events
    with oai.responses.stream(model=MODEL_NAME, input=PROMPT, temperature=0, **kwargs) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    [streamed] = [i for i in final.output if i.type == "function_call"]
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    # the result goes back by previous_response_id...
    output = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature": 18})}
    second = respond(oai, previous_response_id=first.id, input=[output], tools=[WEATHER])
    assert second.previous_response_id == first.id and second.output_text
    # ...or with the whole conversation, unstored: the same prompt
    items = [{"role": "user", "content": PROMPT}, *[i.model_dump() for i in first.output], output]
    alone = respond(oai, input=items, tools=[WEATHER], store=False)
    assert alone.output_text == second.output_text and alone.usage.input_tokens == second.usage.input_tokens


def test_text_format_json_schema(oai):
    fmt = {"format": {"type": "json_schema", "name": "color", "schema": COLOR, "strict": True}}
    for speculative in (True, False):
        r = respond(oai, speculative, text=fmt, max_output_tokens=32, temperature=1.0)
        jsonschema_rs.validate(COLOR, json.loads(r.output_text))
        assert r.text.format.type == "json_schema"
    obj = respond(oai, text={"format": {"type": "json_object"}}, max_output_tokens=64)
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def test_previous_response_id_continues_the_conversation(oai):
    first = respond(oai, instructions="Be brief.")
    second = respond(oai, previous_response_id=first.id, input="And then?")
    history = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}]
    assert second.output_text == chat_text(oai, history)  # instructions are not carried over (OpenAI's rule)
    assert oai.responses.retrieve(second.id).output_text == second.output_text
    [listed] = oai.responses.input_items.list(second.id).data
    assert listed.type == "message" and listed.role == "user" and listed.content[0].text == "And then?"
    oai.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(second.id)
    unstored = respond(oai, store=False)
    with pytest.raises(openai.BadRequestError) as err:
        respond(oai, previous_response_id=unstored.id, input="More.")
    assert err.value.code == "previous_response_not_found" and err.value.param == "previous_response_id"


def test_async_client_whole_and_streamed(gateway):
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0) as client:
            kwargs = dict(model=MODEL_NAME, input=PROMPT, max_output_tokens=12, temperature=0)
            whole = await client.responses.create(**kwargs)
            deltas = [e.delta async for e in await client.responses.create(**kwargs, stream=True)
                      if e.type == "response.output_text.delta"]
            return whole.output_text, "".join(deltas)

    whole, streamed = asyncio.run(run())
    assert whole == streamed and whole


@pytest.mark.parametrize(("body", "param"), [
    ({"temperature": 3}, "temperature"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"background": True}, "background"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
])
def test_refusals_name_the_parameter(oai, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL_NAME, input=PROMPT, extra_body=body)
    assert err.value.param == param, err.value.body
    with pytest.raises(openai.NotFoundError):
        respond(oai, model="gpt-5")


def test_truncation_auto_drops_the_oldest_turns(tokenizer, short_worker):
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}: a few words about cats."}
             for i in range(9)]
    with serve_gateway(tokenizer, (short_worker.address,)) as url:
        body = {"model": MODEL_NAME, "input": turns, "max_output_tokens": 4, "temperature": 0}
        refused = httpx.post(f"{url}/v1/responses", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
        assert refused.json()["error"]["param"] == "input"
        kept = httpx.post(f"{url}/v1/responses", json={**body, "truncation": "auto"})
        assert kept.status_code == 200 and kept.json()["usage"]["input_tokens"] + 4 <= 64


def test_store_is_bounded_and_expires():
    now = [0.0]
    store = ResponseStore(max_bytes=1000, ttl_s=10, clock=lambda: now[0])
    for i in range(20):
        assert store.put(f"r{i}", {"id": f"r{i}", "pad": "x" * 100}, [])
    assert store.bytes <= 1000 and store.get("r0") is None and store.get("r19") is not None
    assert not store.put("big", {"pad": "x" * 2000}, [])
    now[0] = 11
    assert store.get("r19") is None and len(store) == 0


def test_store_false_is_not_trained_on(gateway):
    """`store: false` is passed on as chat's: the worker captures nothing of it (docs/data-handling.md)."""
    body = {"model": MODEL_NAME, "input": PROMPT, "max_output_tokens": 2}
    stored = httpx.post(f"{gateway}/v1/responses", json=body)
    unstored = httpx.post(f"{gateway}/v1/responses", json={**body, "store": False})
    assert stored.headers["x-tide-training"] == "eligible"
    assert unstored.headers["x-tide-training"] == "excluded; reason=store_false"

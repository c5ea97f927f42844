"""Tool calls in OpenAI's shapes through the official `openai` client.

- The parser (services/gateway/tool_calls.py) on its own: any split of a text into stream pieces gives
  the events the whole text gives; the prompt rendering; the forcing schema.
- `tool_choice: "auto"` against a scripted engine (the gateway app with an EngineClient that replays
  a text, as a model that writes tool calls would): calls parsed out, streamed deltas reassemble to
  the non-streamed calls, `parallel_tool_calls: false`, unknown functions stay content.
- `"required"` and a named function against the real stack (a real worker whose engine constrains
  the output to the call schema): every seeded sampled run parses and validates, streaming equals
  non-streaming, speculation on and off agree, and a `role: "tool"` round trip.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator

import jsonschema_rs
import openai
import pytest
from starlette.testclient import TestClient

from gateway.harness import MODEL_NAME
from services.gateway.app import create_app
from services.gateway.engine_client import EngineClient, GenerationFinal, GenerationRequest, TokenDelta
from services.gateway.protocol import ChatCompletionTool, ChatMessage
from services.gateway.serving_engine import build_version
from services.gateway.settings import GatewaySettings
from services.gateway.tool_calls import ToolCallParser, collect, forced_call_schema, render_messages
from services.gateway.worker_pool import WorkerInfo
from tide.speculation import SpeculationStats

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["utc_offset"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: jsonschema_rs.validator_for(t["function"]["parameters"]) for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]


def assert_valid_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        assert SCHEMAS[name].is_valid(json.loads(arguments)), (name, arguments)


def reassemble(chunks) -> tuple[str | None, list[tuple[str, str]], list[str], list[str | None]]:
    """A streamed choice 0 as the client rebuilds it: content, calls (name, arguments), ids, finish reasons."""
    content, calls, ids, reasons = None, {}, [], []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for d in choice.delta.tool_calls or ():
            if d.id is not None:
                assert d.type == "function" and d.function.name and d.function.arguments == ""
                assert d.index not in calls
                calls[d.index] = [d.function.name, ""]
                ids.append(d.id)
            else:
                assert d.function.name is None
                calls[d.index][1] += d.function.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)], ids, [r for r in reasons if r]


# ---------------------------------------------------------------------------------- the parser alone

OUTPUTS = [
    ("tagged", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
               "</tool_call>"),
    ("tagged", '<tool_call>\n{"arguments": {"utc_offset": 2}, "name": "get_time"}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_weather", "arguments": "{\\"city\\": \\"Lima\\", \\"unit\\": \\"f\\"}"}\n</tool_call>'),
    ("tagged", "No calls <tool here, only < text and a trailing space "),
    ("tagged", 'x <tool_call>{"name": "send_email", "arguments": {}}</tool_call> y'),
    ("tagged", '<tool_call>{"name": "get_time", "arguments": {"utc_offset": '),
    ("json", '{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "c"}}'),
    ("json", '[{"name": "get_time", "arguments": {"utc_offset": -3}}, '
             '{"name": "get_time", "arguments": {"utc_offset": 1}}]'),
]
EXPECTED = [
    ("Let me check.", [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    (None, [("get_time", '{"utc_offset": 2}'), ("get_weather", '{"city": "Lima", "unit": "f"}')]),
    ("No calls <tool here, only < text and a trailing space ", []),
    ('x <tool_call>{"name": "send_email", "arguments": {}}</tool_call> y', []),
    (None, [("get_time", '{"utc_offset": ')]),
    (None, [("get_weather", '{"city": "Tokyo", "unit": "c"}')]),
    (None, [("get_time", '{"utc_offset": -3}'), ("get_time", '{"utc_offset": 1}')]),
]


def parse(mode: str, pieces: list[str]):
    parser = ToolCallParser(mode, frozenset(t["function"]["name"] for t in TOOLS))
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    parsed = collect(events)
    return parsed.content, [(name, args) for _, name, args in parsed.calls]


@pytest.mark.parametrize(("output", "expected"), list(zip(OUTPUTS, EXPECTED, strict=True)))
def test_parser_any_split_gives_the_same_result(output, expected):
    mode, text = output
    assert parse(mode, [text]) == expected
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert parse(mode, pieces) == expected
    assert parse(mode, list(text)) == expected  # a character at a time


def test_render_messages():
    tools = [ChatCompletionTool.model_validate(t) for t in TOOLS]
    messages = [
        ChatMessage(role="developer", content="Be brief."),
        ChatMessage(role="user", content="Weather in Paris, and the time?"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
                ],
            }
        ),
        ChatMessage(role="tool", content="18 C, sunny", tool_call_id="call_1"),
        ChatMessage(role="tool", content="14:02", tool_call_id="call_2"),
    ]
    rendered = render_messages(messages, tools)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    system = rendered[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in system and "<tool_call>" in system
    assert rendered[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    results = "<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n14:02\n</tool_response>"
    assert rendered[3]["content"] == results
    plain = render_messages(messages[1:2], None)
    assert plain == [{"role": "user", "content": "Weather in Paris, and the time?"}]


def test_forced_call_schema():
    tools = [ChatCompletionTool.model_validate(t) for t in TOOLS]
    one = jsonschema_rs.validator_for(forced_call_schema(tools, None, parallel=False))
    many = jsonschema_rs.validator_for(forced_call_schema(tools, None, parallel=True))
    named = jsonschema_rs.validator_for(forced_call_schema(tools, "get_time", parallel=True))
    call = {"name": "get_weather", "arguments": {"city": "Lima", "unit": "c"}}
    clock = {"name": "get_time", "arguments": {"utc_offset": 3}}
    assert one.is_valid(call) and not one.is_valid([call]) and not one.is_valid({**call, "name": "get_time"})
    assert many.is_valid([call, clock]) and not many.is_valid([]) and not many.is_valid(call)
    assert named.is_valid(clock) and not named.is_valid(call)
    assert not one.is_valid({"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}})


# ---------------------------------------------------------------------------------- auto, scripted engine


class ScriptedEngine(EngineClient):
    """Answers every request with `self.text`, a few characters per delta, as a model would stream it."""

    def __init__(self) -> None:
        self.text = ""
        self.requests: list[GenerationRequest] = []

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta | GenerationFinal]:
        self.requests.append(request)
        for i in range(0, len(self.text), 3):
            yield TokenDelta((1,), self.text[i : i + 3])
        stats = SpeculationStats(drafter="eagle3", draft_version="v8")  # what served it (the workers say v7)
        yield GenerationFinal("stop", len(request.prompt_token_ids), max(1, len(self.text) // 3), stats)

    def is_ready(self) -> bool:
        return True

    def workers(self) -> list[WorkerInfo]:
        return [WorkerInfo("scripted", True, MODEL_NAME, 0.0, 0, 0, 8, 0, "v7", "eagle3", "", 4096)]


@pytest.fixture(scope="module")
def scripted(tokenizer):
    engine = ScriptedEngine()
    settings = GatewaySettings(max_model_len=4096, served_model_name=MODEL_NAME)
    with TestClient(create_app(settings, engine, tokenizer)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        yield engine, client


def both(client, **kwargs):
    """The non-streamed response and the streamed chunks of the same request."""
    args = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=64, **kwargs)
    return client.chat.completions.create(**args), list(client.chat.completions.create(**args, stream=True))


def test_auto_parses_the_calls_the_model_wrote(scripted):
    engine, client = scripted
    engine.text = OUTPUTS[1][1]
    full, chunks = both(client)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert calls_of(choice.message) == EXPECTED[1][1]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == 2
    content, calls, ids, reasons = reassemble(chunks)
    assert (content, calls, reasons) == (None, EXPECTED[1][1], ["tool_calls"])
    assert all(i.startswith("call_") for i in ids) and len(ids) == 2
    # the request: tools in the prompt, no constraint (the model may answer in text)
    request = engine.requests[-1]
    assert request.sampling.constraint is None


def test_system_fingerprint_names_the_build_and_draft(scripted):
    """A response's fingerprint is the draft that served it (its stats); a stream's chunks before the
    last name the draft the workers serve when it starts, its last chunk the one that served it."""
    engine, client = scripted
    engine.text = "Hello there"
    full, chunks = both(client)
    assert full.system_fingerprint == f"tide-{build_version()}-eagle3-v8"
    assert all(c.system_fingerprint == f"tide-{build_version()}-eagle3-v7" for c in chunks[:-1])
    assert chunks[-1].system_fingerprint == full.system_fingerprint
    completion = client.completions.create(model=MODEL_NAME, prompt="Hi")
    assert completion.system_fingerprint == full.system_fingerprint


def test_auto_content_and_call(scripted):
    engine, client = scripted
    engine.text = OUTPUTS[0][1]
    full, chunks = both(client, tool_choice="auto")
    assert full.choices[0].message.content == "Let me check."
    assert calls_of(full.choices[0].message) == EXPECTED[0][1]
    assert reassemble(chunks)[:2] == ("Let me check.", EXPECTED[0][1])


def test_auto_without_calls_is_plain_content(scripted):
    engine, client = scripted
    for text in (OUTPUTS[2][1], OUTPUTS[3][1]):
        engine.text = text
        full, chunks = both(client)
        assert full.choices[0].message.content == text and full.choices[0].message.tool_calls is None
        assert full.choices[0].finish_reason == "stop"
        assert reassemble(chunks)[0] == text and reassemble(chunks)[3] == ["stop"]


def test_no_parallel_calls_keeps_the_first(scripted):
    engine, client = scripted
    engine.text = OUTPUTS[1][1]
    full, chunks = both(client, parallel_tool_calls=False)
    assert calls_of(full.choices[0].message) == EXPECTED[1][1][:1]
    assert reassemble(chunks)[1] == EXPECTED[1][1][:1]


def test_tool_choice_none_offers_no_tools(scripted, tokenizer):
    engine, client = scripted
    engine.text = OUTPUTS[0][1]
    full = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="none")
    assert full.choices[0].message.content == OUTPUTS[0][1] and full.choices[0].message.tool_calls is None
    assert engine.requests[-1].prompt_token_ids == tokenizer.encode_chat(MESSAGES)


def test_required_and_named_send_the_call_schema(scripted):
    engine, client = scripted
    engine.text = OUTPUTS[5][1]
    full = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False)
    assert calls_of(full.choices[0].message) == EXPECTED[5][1] and full.choices[0].finish_reason == "tool_calls"
    constraint = engine.requests[-1].sampling.constraint
    tools = [ChatCompletionTool.model_validate(t) for t in TOOLS]
    assert constraint.kind == "json_schema"
    assert json.loads(constraint.value) == forced_call_schema(tools, None, parallel=False)
    named = {"type": "function", "function": {"name": "get_weather"}}
    full, chunks = both(client, tool_choice=named)
    assert json.loads(engine.requests[-1].sampling.constraint.value) == forced_call_schema(tools, "get_weather", True)
    assert reassemble(chunks)[1] == calls_of(full.choices[0].message) == EXPECTED[5][1]


# ---------------------------------------------------------------------------------- required / named, real stack


@pytest.fixture
def oai(gateway):
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def test_required_always_yields_a_valid_call(oai):
    """50 seeded sampled runs (5 requests of n=10: choice i samples with seed + i) all parse and validate
    (one call: the random test model, unlike a trained one, would add calls to an array until max_tokens)."""
    for seed in range(0, 50, 10):
        r = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, temperature=1.0, seed=seed, n=10, max_tokens=96)
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content is None
            assert_valid_calls(calls_of(choice.message))


def test_named_choice_streams_like_it_answers(oai):
    named = {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=64)
    results = {}
    for speculative in (True, False):
        full = oai.chat.completions.create(**kwargs, extra_body={"speculative": speculative})
        calls = calls_of(full.choices[0].message)
        assert len(calls) == 1 and calls[0][0] == "get_time" and full.choices[0].finish_reason == "tool_calls"
        assert_valid_calls(calls)
        content, streamed, ids, reasons = reassemble(
            oai.chat.completions.create(**kwargs, stream=True, extra_body={"speculative": speculative})
        )
        assert (content, streamed, reasons) == (None, calls, ["tool_calls"]) and ids[0].startswith("call_")
        results[speculative] = calls
    assert results[True] == results[False]  # greedy: identical with and without speculation


def test_parallel_required_stream(oai):
    """An array of calls, streamed as it is written: the same calls as the full response (the random test
    model may fill the array until max_tokens: every call but a cut last one is complete and valid)."""
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0,
                  max_tokens=128)
    full = oai.chat.completions.create(**kwargs)
    calls = calls_of(full.choices[0].message)
    complete = calls if full.choices[0].finish_reason == "tool_calls" else calls[:-1]
    assert_valid_calls(complete)
    content, streamed, ids, reasons = reassemble(oai.chat.completions.create(**kwargs, stream=True))
    assert (content, streamed, reasons) == (None, calls, [full.choices[0].finish_reason]) and len(set(ids)) == len(ids)


def test_tool_round_trip(oai, tokenizer):
    first = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, temperature=0, max_tokens=64)
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = [
        *MESSAGES,
        message.model_dump(exclude_none=True),  # the assistant turn as the client got it (content null)
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18})},
    ]
    r = oai.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tools = [ChatCompletionTool.model_validate(t) for t in TOOLS]
    rendered = render_messages([ChatMessage.model_validate(m) for m in history], tools)
    assert r.usage.prompt_tokens == len(tokenizer.encode_chat(rendered))
    assert "<tool_response>" in rendered[-1]["content"] and call.function.name in rendered[-2]["content"]

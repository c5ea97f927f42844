"""OpenAI's sampling controls and structured outputs through the official `openai` client against the real
stack (real worker, real gateway): logit_bias bans and forces tokens, penalties change repetitive output,
response_format json_schema / json_object outputs parse and validate, each greedy output identical with
speculation on and off; strictness (unknown fields, OpenAI's limits) as the client's BadRequestError.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema_rs
import openai
import pytest

from gateway.harness import MODEL_NAME
from services.gateway.protocol import TIDE_EXTENSIONS
from services.gateway.serving_engine import _byte_decoder

MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]
ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["answer", "confidence", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}


@pytest.fixture
def oai(gateway):
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def chat(oai, speculative: bool | None = None, **kwargs):
    args = {**dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=16, temperature=0), **kwargs}
    extra = {**args.pop("extra_body", {}), **({} if speculative is None else {"speculative": speculative})}
    return oai.chat.completions.create(**args, extra_body=extra)


def token_ids(tokenizer, response) -> list[int]:
    """The generated token ids, from the logprobs entries' exact bytes."""
    encoder = {b: c for c, b in _byte_decoder().items()}
    pieces = ["".join(encoder[b] for b in e.bytes) for e in response.choices[0].logprobs.content]
    return tokenizer.tokenizer.convert_tokens_to_ids(pieces)


def same_greedy_with_and_without_speculation(oai, drafts: bool = True, **kwargs) -> str:
    """The greedy output with speculation forced on and off (`drafts`: the n-gram drafter, which drafts from
    repeats, found some: penalties leave it none to find)."""
    on, off = chat(oai, True, **kwargs), chat(oai, False, **kwargs)
    assert off.model_extra["speculation"]["draft_tokens"] == 0
    assert on.model_extra["speculation"]["draft_tokens"] > 0 or not drafts
    assert on.choices[0].message.content == off.choices[0].message.content
    return on.choices[0].message.content


# ---------------------------------------------------------------------------------- logit_bias, penalties


def test_logit_bias_bans_and_forces_tokens(oai, tokenizer):
    base = chat(oai, logprobs=True)
    ids = token_ids(tokenizer, base)
    first = ids[0]
    banned = chat(oai, logprobs=True, logit_bias={str(first): -100})
    assert first not in token_ids(tokenizer, banned)  # banned everywhere, not only first
    assert banned.choices[0].message.content != base.choices[0].message.content
    forced_id = tokenizer.tokenizer.convert_tokens_to_ids("Ġcat")
    for kwargs in (dict(temperature=0), dict(temperature=1.0, seed=5)):
        forced = chat(oai, logprobs=True, logit_bias={str(forced_id): 100}, **kwargs)
        assert token_ids(tokenizer, forced) == [forced_id] * 16
        assert forced.choices[0].message.content == " cat" * 16
    # the target's logprobs are the raw distribution's, before the bias (as OpenAI and vLLM report them)
    assert all(e.logprob < 0 for e in forced.choices[0].logprobs.content)
    # lossless under speculation, and the same through /v1/completions
    same_greedy_with_and_without_speculation(oai, logit_bias={str(first): -100, str(ids[1]): 5})
    completion = oai.completions.create(
        model=MODEL_NAME, prompt="Once", max_tokens=4, temperature=0, logit_bias={str(forced_id): 100}
    )
    assert completion.choices[0].text == " cat" * 4


def test_penalties_change_repetitive_output(oai, tokenizer):
    base = chat(oai, logprobs=True, max_tokens=32)
    ids = token_ids(tokenizer, base)
    assert len(set(ids)) < len(ids)  # the tiny random model repeats itself
    for penalty in ("frequency_penalty", "presence_penalty"):
        penalized = chat(oai, logprobs=True, max_tokens=32, **{penalty: 2.0})
        pids = token_ids(tokenizer, penalized)
        assert pids != ids and len(set(pids)) > len(set(ids)), penalty
        same_greedy_with_and_without_speculation(oai, drafts=False, max_tokens=32, **{penalty: 2.0})
    rewarded = token_ids(tokenizer, chat(oai, logprobs=True, max_tokens=32, presence_penalty=-2.0))
    assert len(set(rewarded)) <= len(set(ids))


# ---------------------------------------------------------------------------------- structured outputs


def test_json_schema_outputs_validate(oai):
    validator = jsonschema_rs.validator_for(ANSWER)
    for seed in (0, 10):
        r = chat(oai, response_format=JSON_SCHEMA, temperature=1.0, seed=seed, n=10, max_tokens=64)
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice
            assert validator.is_valid(json.loads(choice.message.content)), choice.message.content
    text = same_greedy_with_and_without_speculation(oai, response_format=JSON_SCHEMA, max_tokens=64)
    assert validator.is_valid(json.loads(text))
    streamed = oai.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=64, temperature=0, response_format=JSON_SCHEMA, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text


def test_json_object(oai):
    for seed in range(3):
        r = chat(oai, response_format={"type": "json_object"}, temperature=0.7, seed=seed, max_tokens=128)
        text = r.choices[0].message.content
        assert text.startswith("{")
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
    same_greedy_with_and_without_speculation(oai, drafts=False, response_format={"type": "json_object"}, max_tokens=32)
    plain = chat(oai, response_format={"type": "text"})
    assert plain.choices[0].message.content == chat(oai).choices[0].message.content


def test_schema_the_grammar_engine_refuses_is_a_400(oai):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "$ref": "#/nowhere"}}}
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, response_format=bad)
    assert err.value.param == "response_format" and "constraint" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "an object"}})
    assert err.value.param == "response_format.json_schema.schema"


def test_async_client_with_structured_output(gateway):
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0) as client:
            kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=64, temperature=0)
            kwargs["response_format"] = JSON_SCHEMA
            full, stream = await asyncio.gather(
                client.chat.completions.create(**kwargs), client.chat.completions.create(**kwargs, stream=True)
            )
            return full, "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    full, text = asyncio.run(run())
    assert full.choices[0].message.content == text and jsonschema_rs.is_valid(ANSWER, json.loads(text))


# ---------------------------------------------------------------------------------- strictness


@pytest.mark.parametrize(
    ("kwargs", "param", "code"),
    [
        (dict(extra_body={"grammar": "root ::= x"}), "grammar", "unknown_parameter"),
        (dict(extra_body={"not_a_parameter": 0.1}), "not_a_parameter", "unknown_parameter"),
        (dict(stop=["a", "b", "c", "d", "e"]), "stop", "invalid_value"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
        (dict(logit_bias={"5": 100.5}), "logit_bias.5", "invalid_value"),
        (dict(logit_bias={"49152": 1}), "logit_bias", "invalid_value"),
        (dict(logit_bias={"-1": 1}), "logit_bias", "invalid_value"),
        (dict(presence_penalty=2.1), "presence_penalty", "invalid_value"),
        (dict(frequency_penalty=-2.1), "frequency_penalty", "invalid_value"),
        (dict(n=17), "n", "invalid_value"),
        (dict(audio={"voice": "alloy", "format": "wav"}), "audio", "unsupported_parameter"),
    ],
)
def test_strictness(oai, kwargs, param, code):
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, **kwargs)
    assert err.value.param == param and err.value.code == code
    assert err.value.body["type"] == "invalid_request_error"
    if code == "unknown_parameter":
        assert err.value.body["message"] == f"Unrecognized request argument supplied: {param}"


def test_tide_extensions_are_accepted(oai):
    extensions = {"speculative": False, "workload": "test", "top_k": 4, "ignore_eos": True, "stop_token_ids": [0]}
    assert set(extensions) == set(TIDE_EXTENSIONS)
    assert chat(oai, extra_body=extensions).choices[0].message.content
    assert oai.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, extra_body=extensions).choices


FIVE_SCHEMAS = {  # nested objects, arrays, enums, required fields; strings and arrays bounded
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["id", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
                  "maxItems": 4}}, "required": ["items"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]},
        "ok": {"type": "boolean"}}, "required": ["color", "size", "ok"], "additionalProperties": False},
    "array_of_objects": {"type": "object", "properties": {
        "rows": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"k": {"enum": ["a", "b"]},
                                             "v": {"type": "number", "minimum": -1000, "maximum": 1000}},
            "required": ["k"], "additionalProperties": False}}},
        "required": ["rows"], "additionalProperties": False},
}


@pytest.mark.parametrize("name", list(FIVE_SCHEMAS))
def test_fifty_seeded_sampled_runs_per_schema_all_parse_and_validate(oai, name):
    schema = FIVE_SCHEMAS[name]
    validator = jsonschema_rs.validator_for(schema)
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    outputs = []
    for seed in range(5):  # 5 seeded requests of n = 10 (the gateway allows n <= 16): 50 sampled runs
        r = chat(oai, response_format=fmt, temperature=1.0, seed=seed, n=10, max_tokens=160)
        outputs += [c.message.content for c in r.choices if c.finish_reason == "stop"]
        assert all(c.finish_reason == "stop" for c in r.choices), [c.finish_reason for c in r.choices]
    assert len(outputs) == 50
    assert all(validator.is_valid(json.loads(text)) for text in outputs), outputs

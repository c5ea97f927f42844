"""Every bad input gets an OpenAI error body with the right status (real gateway, real worker, httpx).

Each case checks the status, the body's exact shape ({"error": {message, type, param, code}}), the
parameter it names and its code; harmless variants of refused parameters are checked to pass.
"""

from __future__ import annotations

import pytest

from gateway.harness import MAX_MODEL_LEN, MODEL_NAME

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hello"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, **fields}


def assert_error(
    response, status: int, param: str | None = None, code: str | None = None, type_: str = "invalid_request_error"
) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert "Traceback" not in response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == type_
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


LONG_TEXT = "hello " * (MAX_MODEL_LEN + 10)

# (id, path, body, status, param, code)
CASES = [
    ("chat-missing-messages", CHAT, {"model": MODEL_NAME}, 400, "messages", "missing_required_parameter"),
    ("chat-empty-messages", CHAT, chat(messages=[]), 400, "messages", "invalid_value"),
    ("chat-messages-not-list", CHAT, chat(messages="hi"), 400, "messages", "invalid_value"),
    ("chat-missing-model", CHAT, {"messages": MESSAGES}, 400, "model", "missing_required_parameter"),
    ("chat-null-model", CHAT, chat(model=None), 400, "model", "missing_required_parameter"),
    ("chat-unknown-model", CHAT, chat(model="gpt-5"), 404, "model", "model_not_found"),
    ("chat-bad-role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role", None),
    (
        "chat-tool-message-without-id",
        CHAT,
        chat(messages=[{"role": "tool", "content": "x"}]),
        400,
        "messages[0]",
        None,
    ),
    ("chat-function-role", CHAT, chat(messages=[{"role": "function", "content": "x"}]), 400, "messages[0].role", None),
    (
        "chat-image-part",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
        400,
        "messages[0].content",
        None,
    ),
    ("chat-user-without-content", CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0]", None),
    (
        "chat-prompt-over-context",
        CHAT,
        chat(messages=[{"role": "user", "content": LONG_TEXT}]),
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("chat-max-tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("chat-max-tokens-negative", CHAT, chat(max_tokens=-5), 400, "max_tokens", "invalid_value"),
    (
        "chat-max-tokens-over-context",
        CHAT,
        chat(max_tokens=MAX_MODEL_LEN),
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    ("chat-max-completion-tokens-zero", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens", None),
    (
        "chat-max-completion-tokens-over-context",
        CHAT,
        chat(max_completion_tokens=10**6),
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    ("chat-temperature-negative", CHAT, chat(temperature=-0.1), 400, "temperature", "invalid_value"),
    ("chat-temperature-too-high", CHAT, chat(temperature=2.5), 400, "temperature", "invalid_value"),
    ("chat-temperature-not-number", CHAT, chat(temperature="hot"), 400, "temperature", "invalid_value"),
    ("chat-top-p-too-high", CHAT, chat(top_p=1.5), 400, "top_p", "invalid_value"),
    ("chat-top-p-negative", CHAT, chat(top_p=-0.1), 400, "top_p", "invalid_value"),
    ("chat-n-zero", CHAT, chat(n=0), 400, "n", "invalid_value"),
    ("chat-n-too-large", CHAT, chat(n=17), 400, "n", "invalid_value"),
    ("chat-seed-too-large", CHAT, chat(seed=2**70), 400, "seed", "invalid_value"),
    ("chat-top-logprobs-without-logprobs", CHAT, chat(top_logprobs=3), 400, "top_logprobs", "invalid_value"),
    ("chat-top-logprobs-too-many", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "invalid_value"),
    (
        "chat-tools-bad-name",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "a b", "parameters": {}}}]),
        400,
        "tools[0].function.name",
        "invalid_value",
    ),
    ("chat-tool-choice-without-tools", CHAT, chat(tool_choice="required"), 400, "tool_choice", "invalid_value"),
    (
        "chat-tool-choice-unknown-function",
        CHAT,
        chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
        "tool_choice",
        "invalid_value",
    ),
    ("chat-functions", CHAT, chat(functions=[{"name": "f"}]), 400, "functions", "unsupported_parameter"),
    (
        "chat-json-schema-not-an-object",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
        400,
        "response_format.json_schema.schema",
        "invalid_value",
    ),
    ("chat-response-format-unknown", CHAT, chat(response_format={"type": "xml"}), 400, "response_format", None),
    ("chat-logit-bias-value", CHAT, chat(logit_bias={"50": 101}), 400, "logit_bias.50", "invalid_value"),
    ("chat-logit-bias-key", CHAT, chat(logit_bias={"hello": 1}), 400, "logit_bias", "invalid_value"),
    ("chat-logit-bias-vocab", CHAT, chat(logit_bias={"49152": 1}), 400, "logit_bias", "invalid_value"),
    ("chat-presence-penalty", CHAT, chat(presence_penalty=2.5), 400, "presence_penalty", "invalid_value"),
    ("chat-frequency-penalty", CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty", "invalid_value"),
    ("chat-stop-too-many", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", "invalid_value"),
    ("chat-audio", CHAT, chat(modalities=["text", "audio"]), 400, "modalities", "unsupported_parameter"),
    ("chat-vllm-beam-search", CHAT, chat(use_beam_search=True), 400, "use_beam_search", "unknown_parameter"),
    ("chat-unknown-field", CHAT, chat(some_future_field={"x": 1}), 400, "some_future_field", "unknown_parameter"),
    (
        "chat-stream-options-without-stream",
        CHAT,
        chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
        "invalid_value",
    ),
    ("chat-stop-token-out-of-vocab", CHAT, chat(stop_token_ids=[10**7]), 400, "stop_token_ids", "invalid_value"),
    ("completion-missing-prompt", COMPLETIONS, {"model": MODEL_NAME}, 400, "prompt", "missing_required_parameter"),
    ("completion-empty-prompt", COMPLETIONS, completion(prompt=""), 400, "prompt", "invalid_value"),
    ("completion-empty-list", COMPLETIONS, completion(prompt=[]), 400, "prompt", "invalid_value"),
    ("completion-unknown-model", COMPLETIONS, completion(model="davinci-002"), 404, "model", "model_not_found"),
    ("completion-token-out-of-vocab", COMPLETIONS, completion(prompt=[1, 2, 10**6]), 400, "prompt", "invalid_value"),
    (
        "completion-ids-over-context",
        COMPLETIONS,
        completion(prompt=[5] * MAX_MODEL_LEN),
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "completion-max-tokens-over-context",
        COMPLETIONS,
        completion(max_tokens=MAX_MODEL_LEN),
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    ("completion-max-tokens-zero", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("completion-suffix", COMPLETIONS, completion(suffix="!"), 400, "suffix", "unsupported_parameter"),
    ("completion-best-of", COMPLETIONS, completion(best_of=3), 400, "best_of", "unsupported_parameter"),
    ("completion-logprobs-too-many", COMPLETIONS, completion(logprobs=6), 400, "logprobs", "invalid_value"),
    ("completion-logit-bias-vocab", COMPLETIONS, completion(logit_bias={"10000000": -1}), 400, "logit_bias", None),
    ("completion-unknown-field", COMPLETIONS, completion(unknown_knob=3), 400, "unknown_knob", "unknown_parameter"),
    ("completion-n-too-large", COMPLETIONS, completion(n=100), 400, "n", "invalid_value"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(client, path, body, status, param, code):
    assert_error(client.post(path, json=body), status, param, code)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'"text"', b"null"])
def test_not_a_json_object(client, path, raw):
    assert_error(
        client.post(path, content=raw, headers={"content-type": "application/json"}), 400, None, "invalid_json"
    )


def test_streaming_request_errors_before_the_stream_starts(client):
    """A bad streaming request gets a JSON error status, not a 200 event stream."""
    assert_error(client.post(CHAT, json=chat(stream=True, temperature=9)), 400, "temperature")
    assert_error(client.post(CHAT, json=chat(stream=True, model="nope")), 404, "model", "model_not_found")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            CHAT,
            chat(
                logprobs=False,
                tools=[],
                tool_choice="none",
                response_format={"type": "text"},
                logit_bias={},
                presence_penalty=0,
                frequency_penalty=0.0,
                top_logprobs=0,
                modalities=["text"],
            ),
        ),
        (
            CHAT,
            chat(
                user="u1",
                metadata={"a": "b"},
                store=False,
                service_tier="auto",
                parallel_tool_calls=False,
                prediction={"type": "content", "content": "x"},
                prompt_cache_key="k",
                safety_identifier="s",
                reasoning_effort="low",
                verbosity="medium",
                speculative=False,
                workload="w",
                top_k=5,
                ignore_eos=False,
                stop_token_ids=[2],
            ),
        ),
        (
            COMPLETIONS,
            completion(
                echo=False, best_of=1, logprobs=None, suffix=None, user="u1", logit_bias={"50": -1}, stop=["a"] * 4
            ),
        ),
        (CHAT, chat(n=None, stream=None, temperature=None, top_p=None, stop=None, seed=None, stream_options=None)),
    ],
)
def test_harmless_parameters_are_accepted(client, path, body):
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text


def test_unknown_route_and_method(client):
    assert_error(client.get("/v1/nothing"), 404, type_="not_found_error")
    assert_error(client.get(CHAT), 405)

"""vLLM's /tokenize, /detokenize and /version against a real gateway: the ids are those the completion
endpoints feed the worker (their usage.prompt_tokens), the text round-trips, bad bodies are OpenAI 4xx."""

from __future__ import annotations

import pytest

from gateway.harness import MAX_MODEL_LEN, MODEL_NAME
from gateway.test_openai_params import MESSAGES


def test_tokenize_a_prompt_and_detokenize_it(client, tokenizer):
    r = client.post("/tokenize", json={"model": MODEL_NAME, "prompt": "Hello world, the cat sat."})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode("Hello world, the cat sat.")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    back = client.post("/detokenize", json={"model": MODEL_NAME, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello world, the cat sat."}
    completion = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello world, the cat sat.",
                                                      "max_tokens": 1})
    assert completion.json()["usage"]["prompt_tokens"] == body["count"]


def test_tokenize_messages_as_the_chat_endpoint_renders_them(client, tokenizer):
    body = client.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES}).json()
    assert body["tokens"] == tokenizer.encode_chat(MESSAGES)
    chat = client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == body["count"]
    closed = client.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES,
                                            "add_generation_prompt": False}).json()
    assert closed["count"] < body["count"] and body["tokens"][:closed["count"]] == closed["tokens"]
    long = client.post("/tokenize", json={"model": MODEL_NAME, "prompt": "cat " * (2 * MAX_MODEL_LEN)}).json()
    assert long["count"] > MAX_MODEL_LEN  # counted, not refused


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": MODEL_NAME}, 400, None),  # neither prompt nor messages
        ("/tokenize", {"model": MODEL_NAME, "prompt": "a", "messages": MESSAGES}, 400, None),
        ("/tokenize", {"model": MODEL_NAME, "prompt": "a", "bogus": 1}, 400, "bogus"),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
        ("/detokenize", {"model": MODEL_NAME, "tokens": [49152]}, 400, "tokens"),
        ("/detokenize", {"model": MODEL_NAME, "tokens": [-1]}, 400, "tokens[0]"),
        ("/detokenize", {"model": MODEL_NAME}, 400, "tokens"),
    ],
)
def test_bad_bodies(client, path, body, status, param):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] in ("invalid_request_error",) and error["message"]
    if param is not None:
        assert error["param"] == param


def test_version(client):
    r = client.get("/version")
    assert r.status_code == 200 and isinstance(r.json()["version"], str) and r.json()["version"]

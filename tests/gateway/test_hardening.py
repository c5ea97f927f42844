"""Malformed and hostile requests get a 4xx OpenAI error, quickly, never a 500, and never stall the gateway.

- JSON nested deeper than MAX_JSON_DEPTH: 400 before the body is parsed (brackets inside strings
  do not count);
- integers and floats that the worker's protobuf fields cannot hold: 400 naming the parameter;
- strings that are not valid Unicode (lone surrogates such as \\ud800): 400 naming where they are;
- a body over the size cap: 413 from its Content-Length alone; a prompt whose UTF-8 size alone
  proves it cannot fit the context: 400 without tokenizing it; tokenizing over its time budget:
  503; small requests are answered promptly while big ones are being refused;
- the context is the workers' real limit (WorkerStatus.max_model_len); the configured
  max_model_len is only an upper bound;
- the size bound (bytes per token) is used only for tokenizers where it holds, and is a true lower
  bound on the token count of the target's tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import httpx
import pytest

from gateway.harness import MAX_MODEL_LEN, MODEL_NAME, SHORT_CONTEXT, serve_gateway
from gateway.test_errors import CHAT, COMPLETIONS, assert_error, chat, completion
from services.gateway.errors import OpenAIError
from services.gateway.protocol import MAX_JSON_DEPTH
from services.gateway.tokenizer import _size_bounded


def post_raw(client: httpx.Client, path: str, text: str) -> httpx.Response:
    """POST a JSON text as it is (json.dumps writes lone surrogates as \\ud800 escapes, as a client may)."""
    return client.post(path, content=text.encode(), headers={"content-type": "application/json"})


def post(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    return post_raw(client, path, json.dumps(body))


# ---------------------------------------------------------------------------------- JSON depth


def nested(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_deeply_nested_json_is_refused(client, path):
    body = json.dumps(chat() if path == CHAT else completion())[:-1] + f', "metadata": {nested(5000)}}}'
    error = assert_error(post_raw(client, path, body), 400, None, "invalid_json")
    assert f"{MAX_JSON_DEPTH} levels" in error["message"]


def test_json_depth_limit_is_exact(client):
    """The body object is level 1: MAX_JSON_DEPTH levels in all pass, one more is refused."""
    ok = json.dumps(chat())[:-1] + f', "metadata": {nested(MAX_JSON_DEPTH - 1)}}}'
    assert post_raw(client, CHAT, ok).status_code == 200
    too_deep = json.dumps(chat())[:-1] + f', "metadata": {nested(MAX_JSON_DEPTH)}}}'
    assert_error(post_raw(client, CHAT, too_deep), 400, None, "invalid_json")
    deep_object = (
        json.dumps(chat())[:-1] + ', "metadata": ' + '{"a": ' * MAX_JSON_DEPTH + "1" + "}" * MAX_JSON_DEPTH + "}"
    )
    assert_error(post_raw(client, CHAT, deep_object), 400, None, "invalid_json")


def test_brackets_inside_strings_do_not_count(client):
    content = '"[{\\' * 500 + "]" * 100  # quotes and backslashes are escaped in the JSON text
    response = post(client, CHAT, chat(messages=[{"role": "user", "content": content}], metadata={"k": "[" * 500}))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity"])
def test_non_standard_json_constants_are_refused(client, raw):
    body = json.dumps(chat())[:-1] + f', "temperature": {raw}}}'
    assert_error(post_raw(client, CHAT, body), 400, None, "invalid_json")


# ---------------------------------------------------------------------------------- numeric ranges

U32, U64 = 2**32, 2**64
RANGE_CASES = [  # (path, field, value, the param named)
    (CHAT, "top_k", U32, "top_k"),
    (CHAT, "top_k", 2**70, "top_k"),
    (CHAT, "top_k", -2, "top_k"),
    (CHAT, "max_tokens", U32, "max_tokens"),
    (CHAT, "max_completion_tokens", U32, "max_completion_tokens"),
    (CHAT, "n", U64, "n"),
    (CHAT, "seed", U64, "seed"),
    (CHAT, "seed", -(2**63) - 1, "seed"),
    (CHAT, "top_logprobs", 2**40, "top_logprobs"),
    (CHAT, "top_logprobs", -1, "top_logprobs"),
    (CHAT, "stop_token_ids", [U32], "stop_token_ids[0]"),
    (CHAT, "stop_token_ids", [1, -1], "stop_token_ids[1]"),
    (CHAT, "temperature", 10**400, "temperature"),
    (CHAT, "top_p", 1e308, "top_p"),
    (CHAT, "frequency_penalty", -1e308, "frequency_penalty"),
    (COMPLETIONS, "top_k", U32, "top_k"),
    (COMPLETIONS, "max_tokens", U32, "max_tokens"),
    (COMPLETIONS, "max_tokens", U64, "max_tokens"),
    (COMPLETIONS, "n", U32, "n"),
    (COMPLETIONS, "seed", U64 + 1, "seed"),
    (COMPLETIONS, "logprobs", 2**40, "logprobs"),
    (COMPLETIONS, "best_of", 2**40, "best_of"),
    (COMPLETIONS, "prompt", [1, U32], "prompt[1]"),
    (COMPLETIONS, "prompt", [[1], [2, -1]], "prompt[1][1]"),
    (COMPLETIONS, "stop_token_ids", [U64], "stop_token_ids[0]"),
]


@pytest.mark.parametrize(
    ("path", "field", "value", "param"), RANGE_CASES, ids=[f"{c[0][4:]}-{c[1]}-{c[2]}"[:60] for c in RANGE_CASES]
)
def test_out_of_range_numbers_are_refused(client, path, field, value, param):
    body = (chat if path == CHAT else completion)(**{field: value})
    error = assert_error(post(client, path, body), 400, param, "invalid_value")
    assert f"'{param}'" in error["message"], error


# ---------------------------------------------------------------------------------- invalid Unicode

BAD = "\ud800"
UNICODE_CASES = [
    ("content", CHAT, chat(messages=[{"role": "user", "content": f"hi {BAD}"}]), "messages[0].content"),
    ("low-surrogate", CHAT, chat(messages=[{"role": "user", "content": "\udc00"}]), "messages[0].content"),
    ("swapped-pair", CHAT, chat(messages=[{"role": "user", "content": "\ude00\ud83d"}]), "messages[0].content"),
    (
        "content-part",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": BAD}]}]),
        "messages[0].content[0].text",
    ),
    ("name", CHAT, chat(messages=[{"role": "user", "content": "hi", "name": BAD}]), "messages[0].name"),
    (
        "system",
        CHAT,
        chat(messages=[{"role": "system", "content": BAD}, {"role": "user", "content": "x"}]),
        "messages[0].content",
    ),
    ("stop", CHAT, chat(stop=BAD), "stop"),
    ("stop-list", CHAT, chat(stop=["ok", BAD]), "stop[1]"),
    ("model", CHAT, chat(model=BAD), "model"),
    ("user", CHAT, chat(user=BAD), "user"),
    ("workload", CHAT, chat(workload=BAD), "workload"),
    ("metadata-value", CHAT, chat(metadata={"k": BAD}), "metadata.k"),
    ("metadata-key", CHAT, chat(metadata={BAD: "v"}), "metadata"),
    ("unknown-field", CHAT, {**chat(), BAD: 1}, None),
    ("prompt", COMPLETIONS, completion(prompt=BAD), "prompt"),
    ("prompt-list", COMPLETIONS, completion(prompt=["fine", f"x{BAD}"]), "prompt[1]"),
    ("completion-stop", COMPLETIONS, completion(stop=[BAD]), "stop[0]"),
    ("completion-model", COMPLETIONS, completion(model=BAD), "model"),
]


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in UNICODE_CASES], ids=[c[0] for c in UNICODE_CASES])
def test_invalid_unicode_is_refused(client, path, body, param):
    error = assert_error(post(client, path, body), 400, param, "invalid_value")
    assert "Unicode" in error["message"]


def test_valid_surrogate_pairs_pass(client):
    response = post(client, CHAT, chat(messages=[{"role": "user", "content": "\ud83d\ude00 ok"}]))  # an emoji
    assert response.status_code == 200, response.text


# ---------------------------------------------------------------------------------- size and time


class SpyTokenizer:
    """The HF tokenizer, counting how often text is tokenized."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def spy_gateway(tokenizer, worker):
    spy = SpyTokenizer(tokenizer.tokenizer)
    with serve_gateway(dataclasses.replace(tokenizer, tokenizer=spy), (worker.address,)) as url:
        yield url, spy


def test_body_over_the_cap_is_refused_from_its_length(client):
    started = time.perf_counter()
    response = post(client, COMPLETIONS, completion(prompt="hello " * 900_000))  # 5.4 MB
    error = assert_error(response, 413, None, "request_too_large")
    assert "bytes" in error["message"]
    assert time.perf_counter() - started < 5


def test_streamed_body_over_the_cap_is_refused(client):
    """Without a Content-Length (chunked), the body is counted as it arrives."""

    def chunks():
        yield json.dumps(completion())[:-1].encode() + b', "metadata": "'
        for _ in range(600):
            yield b"x" * 10_000
        yield b'"}'

    response = client.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
    assert_error(response, 413, None, "request_too_large")


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_prompt_too_big_to_fit_is_refused_without_tokenizing(spy_gateway, path):
    url, spy = spy_gateway
    text = "hello " * 60_000  # 360 kB: over 4096 tokens x the longest token's 81 bytes, whatever it says
    body = chat(messages=[{"role": "user", "content": text}]) if path == CHAT else completion(prompt=text)
    before = spy.calls
    with httpx.Client(base_url=url, timeout=60) as c:
        error = assert_error(
            post(c, path, body), 400, "messages" if path == CHAT else "prompt", "context_length_exceeded"
        )
    assert spy.calls == before, "the prompt was tokenized"
    assert f"{MAX_MODEL_LEN} tokens" in error["message"]


def test_prompt_of_long_tokens_that_fits_is_served(client, tokenizer):
    """The size bound is the longest token's bytes, not an average: a prompt of long tokens that fits passes."""
    text = ("#" * 80 + "\n") * 1800
    assert len(tokenizer.encode(text)) < MAX_MODEL_LEN - 2 and len(text) / len(tokenizer.encode(text)) > 30
    response = post(client, COMPLETIONS, completion(prompt=text, max_tokens=1))
    assert response.status_code == 200, response.text


def test_tokenizing_over_its_time_budget_is_refused(tokenizer, worker):
    with (
        serve_gateway(tokenizer, (worker.address,), tokenize_timeout_s=0.001) as url,
        httpx.Client(base_url=url, timeout=60) as c,
    ):
        text = "hello " * 50_000  # just under the size bound: it must be tokenized to be judged
        error = assert_error(
            post(c, COMPLETIONS, completion(prompt=text)), 503, None, "tokenize_timeout", "server_error"
        )
        assert "tokenizing" in error["message"].lower()
        assert post(c, COMPLETIONS, completion()).status_code in (200, 503)  # the gateway still answers


def test_small_requests_are_answered_while_big_ones_are_refused(gateway):
    """Big prompts (tokenized then refused, or refused by size) never stall the event loop for the others."""
    stop = threading.Event()
    outcomes: list[int] = []

    def hammer(text: str) -> None:
        with httpx.Client(base_url=gateway, timeout=120) as c:
            while not stop.is_set():
                outcomes.append(post(c, COMPLETIONS, completion(prompt=text)).status_code)

    threads = [
        threading.Thread(target=hammer, args=("hello " * 50_000,)),  # tokenized (300 kB), then refused
        threading.Thread(target=hammer, args=("hello " * 50_000,)),
        threading.Thread(target=hammer, args=("hello " * 300_000,)),  # 1.8 MB: refused by its size
    ]
    for t in threads:
        t.start()
    latencies = []
    try:
        time.sleep(0.5)
        with httpx.Client(base_url=gateway, timeout=60) as c:
            for _ in range(10):
                started = time.perf_counter()
                response = post(c, CHAT, chat(max_tokens=1))
                latencies.append(time.perf_counter() - started)
                assert response.status_code == 200, response.text
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert outcomes and set(outcomes) == {400}, outcomes
    assert sorted(latencies)[len(latencies) // 2] < 1.0, latencies
    assert max(latencies) < 5.0, latencies


# ---------------------------------------------------------------------------------- the context


def models_context(url: str) -> int:
    return httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]


def test_context_is_the_workers_limit(tokenizer, short_worker, worker):
    """The gateway is configured for MAX_MODEL_LEN; the worker holds only SHORT_CONTEXT tokens."""
    with serve_gateway(tokenizer, (short_worker.address,)) as url, httpx.Client(base_url=url, timeout=60) as c:
        assert models_context(url) == SHORT_CONTEXT
        assert c.get(f"/v1/models/{MODEL_NAME}").json()["max_model_len"] == SHORT_CONTEXT
        ready = c.get("/ready").json()
        assert [w["max_model_len"] for w in ready["workers"]] == [SHORT_CONTEXT]
        long_prompt = "hello " * (SHORT_CONTEXT + 10)
        error = assert_error(
            post(c, COMPLETIONS, completion(prompt=long_prompt)), 400, "prompt", "context_length_exceeded"
        )
        assert f"{SHORT_CONTEXT} tokens" in error["message"]
        error = assert_error(
            post(c, CHAT, chat(max_tokens=SHORT_CONTEXT)), 400, "max_tokens", "context_length_exceeded"
        )
        assert f"{SHORT_CONTEXT} tokens" in error["message"]
        assert post(c, CHAT, chat(max_tokens=8)).status_code == 200
    with serve_gateway(tokenizer, (worker.address, short_worker.address)) as url:
        assert models_context(url) == SHORT_CONTEXT  # the smallest healthy worker's


def test_configured_context_is_an_upper_bound(tokenizer, short_worker):
    with serve_gateway(tokenizer, (short_worker.address,), max_model_len=SHORT_CONTEXT // 2) as url:
        assert models_context(url) == SHORT_CONTEXT // 2


# ---------------------------------------------------------------------------------- the size bound

BYTE_LEVEL_BPE = {
    "model": {"type": "BPE", "byte_fallback": False},
    "normalizer": None,
    "pre_tokenizer": {"type": "ByteLevel"},
    "added_tokens": [{"content": "<|im_start|>", "lstrip": False, "rstrip": False}],
}
SENTENCEPIECE_BPE = {
    "model": {"type": "BPE", "byte_fallback": True},
    "normalizer": {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    },
    "pre_tokenizer": None,
    "added_tokens": [],
}
SIZE_BOUND_CASES = [
    ("byte-level-bpe", BYTE_LEVEL_BPE, True),
    ("sentencepiece-byte-fallback", SENTENCEPIECE_BPE, True),
    ("wordpiece-unk", {**BYTE_LEVEL_BPE, "model": {"type": "WordPiece"}}, False),
    ("bpe-without-bytes", {**BYTE_LEVEL_BPE, "pre_tokenizer": {"type": "Metaspace"}}, False),
    ("nfkc-shrinks", {**BYTE_LEVEL_BPE, "normalizer": {"type": "NFKC"}}, False),
    (
        "replace-shrinks",
        {**SENTENCEPIECE_BPE, "normalizer": {"type": "Replace", "pattern": {"String": "  "}, "content": " "}},
        False,
    ),
    (
        "whitespace-dropped",
        {
            **BYTE_LEVEL_BPE,
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [{"type": "WhitespaceSplit"}, {"type": "ByteLevel"}],
            },
        },
        False,
    ),
    ("split-removed", {**BYTE_LEVEL_BPE, "pre_tokenizer": {"type": "Split", "behavior": "Removed"}}, False),
    ("lstrip-token", {**BYTE_LEVEL_BPE, "added_tokens": [{"content": "<mask>", "lstrip": True}]}, False),
]


@pytest.mark.parametrize(("spec", "bounded"), [c[1:] for c in SIZE_BOUND_CASES], ids=[c[0] for c in SIZE_BOUND_CASES])
def test_size_bound_only_where_it_holds(spec, bounded):
    """The bound is used only when no input byte can vanish and no token covers more than its own text."""
    assert _size_bounded(spec) is bounded


def test_size_bound_is_a_lower_bound_on_tokens(tokenizer):
    per_token = tokenizer.max_token_bytes
    assert per_token == 81  # SmolLM2's longest token: a newline and 80 spaces
    texts = [
        "hello world",
        "\n" + " " * 80,
        ("\n" + " " * 80) * 40,
        "#" * 80 * 40,
        "<|im_start|>assistant" * 50,
        "é漢🙂" * 300,
        "".join(chr(i) for i in range(32, 3000)),
        " " * 5000,
    ]
    for text in texts:
        assert len(tokenizer.encode(text)) >= len(text.encode()) / per_token, text[:40]
    limit = 10
    tokenizer.check_size("a" * (limit * per_token), limit, "prompt")  # as many bytes as 10 tokens can hold: kept
    with pytest.raises(OpenAIError) as refused:
        tokenizer.check_size("a" * (limit * per_token + 1), limit, "prompt")
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "prompt"

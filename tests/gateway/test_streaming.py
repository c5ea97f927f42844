"""SSE format and generation semantics through the real gateway and a real engine worker (httpx).

Format: role first (chat), exactly one finish_reason per choice, `usage` only when asked (a last
chunk with empty choices), `speculation` on the last chunk, [DONE] last. Semantics: streamed text
equals the non-streamed text (greedy), stop strings, seeds, `speculative: false`, usage counts.
"""

from __future__ import annotations

import json

import pytest

from gateway.harness import MODEL_NAME

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SPEC_KEYS = {"accept_length", "draft_tokens", "accepted_tokens", "draft_version"}
# Repetition gives the worker's n-gram drafter something to propose.
REPETITIVE = [{"role": "user", "content": "1 2 3 1 2 3 1 2 3"}]


def read_sse(client, path: str, body: dict) -> list:
    """The stream's `data:` payloads in order: dicts, and the literal "[DONE]"."""
    events = []
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
            else:
                assert line == "", f"unexpected SSE line {line!r}"
    return events


def chat(**fields) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 12,
        "temperature": 0,
        **fields,
    }


def check_stream(events: list, n: int, kind: str, include_usage: bool) -> dict[int, str]:
    """Assert the OpenAI stream rules; returns each choice's text."""
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    assert {c["object"] for c in chunks} == {obj}
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    texts: dict[int, str] = {i: "" for i in range(n)}
    finishes: dict[int, list] = {i: [] for i in range(n)}
    seen_role: set[int] = set()
    for chunk in chunks:
        assert ("usage" in chunk) == include_usage
        for choice in chunk["choices"]:
            i = choice["index"]
            assert not finishes[i], f"choice {i} has content after its finish_reason"
            if kind == "chat":
                delta = choice["delta"]
                if i not in seen_role:  # the first chunk of a choice carries the role
                    assert delta == {"role": "assistant", "content": ""}
                    seen_role.add(i)
                    continue
                assert "role" not in delta
                texts[i] += delta.get("content", "")
            else:
                texts[i] += choice["text"]
            if choice["finish_reason"] is not None:
                finishes[i].append(choice["finish_reason"])
    assert all(len(f) == 1 for f in finishes.values()), finishes
    last = chunks[-1]
    assert set(last["speculation"]) >= SPEC_KEYS
    assert all("speculation" not in c for c in chunks[:-1])
    if include_usage:
        assert last["choices"] == [] and last["usage"]["total_tokens"] > 0
        assert all(c["usage"] is None for c in chunks[:-1])
    return texts


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_chat_stream_format_matches_non_streaming(client, n, include_usage):
    body = chat(n=n)
    full = client.post(CHAT, json=body).json()
    stream_body = {**body, "stream": True, **({"stream_options": {"include_usage": True}} if include_usage else {})}
    events = read_sse(client, CHAT, stream_body)
    texts = check_stream(events, n, "chat", include_usage)
    for choice in full["choices"]:  # greedy: every choice, streamed or not, is the same text
        assert texts[choice["index"]] == choice["message"]["content"] == full["choices"][0]["message"]["content"]
    if include_usage:
        assert events[-2]["usage"] == full["usage"]


@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_stream_with_several_prompts(client, include_usage):
    body = {
        "model": MODEL_NAME,
        "prompt": ["Once upon a time", "The capital of France"],
        "n": 2,
        "max_tokens": 8,
        "temperature": 0,
    }
    full = client.post(COMPLETIONS, json=body).json()
    assert [c["index"] for c in full["choices"]] == [0, 1, 2, 3]
    stream_body = {**body, "stream": True, **({"stream_options": {"include_usage": True}} if include_usage else {})}
    texts = check_stream(read_sse(client, COMPLETIONS, stream_body), 4, "completion", include_usage)
    assert texts == {c["index"]: c["text"] for c in full["choices"]}
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]


def test_usage_counts(client, tokenizer):
    messages = [{"role": "user", "content": "Count my tokens, please."}]
    body = chat(messages=messages, max_tokens=7, ignore_eos=True)
    response = client.post(CHAT, json=body).json()
    prompt = tokenizer.encode_chat(messages)
    # OpenAI's shape; the test worker (float32) reuses whole 256-token chunks only, so none of these
    assert response["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 7, "total_tokens": len(prompt) + 7,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    assert response["choices"][0]["finish_reason"] == "length"
    completion = client.post(
        COMPLETIONS, json={"model": MODEL_NAME, "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3, "ignore_eos": True}
    ).json()
    assert completion["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                                   "prompt_tokens_details": {"cached_tokens": 0}}


def test_stop_string_ends_the_choice(client):
    text = client.post(CHAT, json=chat(max_tokens=24)).json()["choices"][0]["message"]["content"]
    stop = text[len(text) // 2 :][:4]
    assert stop.strip(), text
    response = client.post(CHAT, json=chat(max_tokens=24, stop=[stop])).json()
    choice = response["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text[: text.index(stop)]
    events = read_sse(client, CHAT, chat(max_tokens=24, stop=stop, stream=True))
    assert check_stream(events, 1, "chat", False)[0] == text[: text.index(stop)]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_seed_makes_sampling_reproducible(client):
    body = chat(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16)
    first = client.post(CHAT, json=body).json()["choices"][0]["message"]["content"]
    assert client.post(CHAT, json=body).json()["choices"][0]["message"]["content"] == first
    many = client.post(CHAT, json={**body, "n": 3}).json()["choices"]
    texts = [c["message"]["content"] for c in many]
    assert texts[0] == first  # choice i samples with seed + i
    assert len(set(texts)) == 3  # per-choice seeds: the choices differ
    other = client.post(CHAT, json={**body, "seed": 99}).json()["choices"][0]["message"]["content"]
    assert other != first


def test_speculative_false_is_plain_decode_with_the_same_greedy_output(client):
    body = chat(messages=REPETITIVE, max_tokens=64, ignore_eos=True)
    # speculative=true drafts every step; left out, the worker's γ policy decides from measured step
    # costs (on a busy machine it may rightly not draft at all), so only the text is compared there
    spec = client.post(CHAT, json={**body, "speculative": True}).json()
    default = client.post(CHAT, json=body).json()
    plain = client.post(CHAT, json={**body, "speculative": False}).json()
    text = plain["choices"][0]["message"]["content"]
    assert spec["choices"][0]["message"]["content"] == text == default["choices"][0]["message"]["content"]
    assert spec["speculation"]["draft_tokens"] > 0 and spec["speculation"]["accept_length"] >= 1.0
    assert plain["speculation"]["draft_tokens"] == 0 and plain["speculation"]["accepted_tokens"] == 0
    assert plain["speculation"]["accept_length"] == 0.0
    assert spec["speculation"]["draft_version"] == "ngram"
    last = read_sse(client, CHAT, {**body, "speculative": False, "stream": True})[-2]
    assert last["speculation"]["draft_tokens"] == 0


def test_developer_role_and_text_parts_render_like_system_and_string(client, tokenizer):
    parts = [
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "Hi"},
    ]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    a = client.post(CHAT, json=chat(messages=parts)).json()
    b = client.post(CHAT, json=chat(messages=plain)).json()
    assert a["usage"]["prompt_tokens"] == len(tokenizer.encode_chat(plain))
    assert a["choices"][0]["message"] == b["choices"][0]["message"]

"""Log probabilities through the official `openai` client (sync, async, streaming) against a real worker
and gateway: OpenAI's shapes, the target's values with speculation on and off, entries that match the
returned text token for token (stop strings included), `echo`, and the 400s for bad values."""

from __future__ import annotations

import asyncio

import openai
import pytest

from gateway.harness import MODEL_NAME

MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]
TOL = 1e-3


@pytest.fixture
def oai(gateway):
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def chat(oai, speculative: bool, **kwargs):
    args = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3)
    args = {k: v for k, v in {**args, **kwargs}.items() if v is not None}
    return oai.chat.completions.create(**args, extra_body={"speculative": speculative})


def text_of(content) -> str:
    """The text the entries stand for: their tokens' bytes, concatenated."""
    return bytes(b for e in content for b in e.bytes).decode("utf-8", errors="replace")


def assert_tokens_of(content, text: str) -> None:
    """The entries are exactly the tokens whose text is (at least partly) returned: the last one may
    run past the end of `text` (a stop string starting inside it), the one before may not."""
    assert text_of(content).startswith(text) and len(text_of(content[:-1])) < len(text)


def assert_close(a, b) -> None:
    assert [e.token for e in a] == [e.token for e in b]
    assert all(abs(x.logprob - y.logprob) < TOL for x, y in zip(a, b, strict=True))
    for x, y in zip(a, b, strict=True):
        assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
        assert all(abs(s.logprob - t.logprob) < TOL for s, t in zip(x.top_logprobs, y.top_logprobs, strict=True))


def test_chat_logprobs_lossless_under_speculation(oai):
    on, off = chat(oai, True), chat(oai, False)
    assert on.model_extra["speculation"]["draft_tokens"] > 0 and off.model_extra["speculation"]["draft_tokens"] == 0
    a, b = on.choices[0], off.choices[0]
    assert a.message.content == b.message.content  # greedy output identical with logprobs requested
    assert a.logprobs.refusal is None
    content = a.logprobs.content
    assert len(content) == on.usage.completion_tokens == 16 and text_of(content) == a.message.content
    assert_close(content, b.logprobs.content)
    for e in content:
        assert e.logprob <= 0 and e.bytes == list(e.token.encode()) or "\ufffd" in e.token
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6  # greedy


def test_chat_logprobs_without_top_and_not_requested(oai):
    r = chat(oai, False, top_logprobs=None, max_tokens=4)
    assert len(r.choices[0].logprobs.content) == 4 and all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    plain = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


def test_chat_stream_carries_each_chunks_entries(oai):
    full = chat(oai, True)
    for speculative in (True, False):
        stream = oai.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=16,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            extra_body={"speculative": speculative},
        )
        entries, text = [], ""
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                entries += chunk.choices[0].logprobs.content
                assert text_of(entries).startswith(text) or text.startswith(text_of(entries[:-1]))
        assert text == full.choices[0].message.content
        assert_close(entries, full.choices[0].logprobs.content)


def test_stop_string_entries_match_the_returned_text(oai):
    free = chat(oai, False, max_tokens=24).choices[0].message.content
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    for speculative in (True, False):
        r = chat(oai, speculative, max_tokens=24, stop=[stop])
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content == free[: free.index(stop)]
        assert_tokens_of(choice.logprobs.content, choice.message.content)
        streamed = oai.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=24,
            temperature=0,
            logprobs=True,
            stop=[stop],
            stream=True,
            extra_body={"speculative": speculative},
        )
        entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        assert_tokens_of(entries, choice.message.content)


def test_sampled_tokens_have_logprobs(oai):
    r = chat(oai, True, temperature=0.9, seed=3, top_logprobs=0, max_tokens=8)
    assert len(r.choices[0].logprobs.content) == 8
    assert all(e.logprob <= 0 for e in r.choices[0].logprobs.content)


def test_completion_logprobs_0_gives_the_sampled_tokens_logprob(oai):
    """`logprobs: 0`: top_logprobs holds the sampled token alone, with its logprob (OpenAI, vLLM)."""
    r = oai.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, temperature=0.9, seed=5,
                               logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 8 and "".join(lp.tokens) == r.choices[0].text
    assert lp.top_logprobs == [{tok: value} for tok, value in zip(lp.tokens, lp.token_logprobs, strict=True)]
    assert all(v <= 0 for v in lp.token_logprobs)


def test_completion_logprobs_and_echo(oai):
    prompt = "Once upon a time"
    kwargs = dict(model=MODEL_NAME, max_tokens=8, temperature=0, logprobs=3)
    on = oai.completions.create(prompt=prompt, **kwargs, extra_body={"speculative": True})
    off = oai.completions.create(prompt=prompt, **kwargs, extra_body={"speculative": False})
    lp, lp_off = on.choices[0].logprobs, off.choices[0].logprobs
    assert on.choices[0].text == off.choices[0].text and lp.tokens == lp_off.tokens and len(lp.tokens) == 8
    assert all(abs(x - y) < TOL for x, y in zip(lp.token_logprobs, lp_off.token_logprobs, strict=True))
    assert "".join(lp.tokens) == on.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for tok, top, value in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs, strict=True):
        assert len(top) == 3 and max(top, key=top.get) == tok and abs(top[tok] - value) < 1e-6

    # echo: the prompt's tokens first (the first without a logprob), then the completion's.
    echo = oai.completions.create(prompt=prompt, echo=True, **kwargs)
    e = echo.choices[0]
    assert e.text == prompt + on.choices[0].text
    n_prompt = echo.usage.prompt_tokens
    assert len(e.logprobs.tokens) == n_prompt + 8 and "".join(e.logprobs.tokens) == e.text
    assert e.logprobs.token_logprobs[0] is None and e.logprobs.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in e.logprobs.token_logprobs[1:])
    # The 3 most likely and the prompt's own token (OpenAI: up to logprobs + 1 entries).
    for tok, top, value in zip(e.logprobs.tokens[1:], e.logprobs.top_logprobs[1:], e.logprobs.token_logprobs[1:],
                               strict=True):
        assert len(top) in (3, 4) and abs(top[tok] - value) < 1e-6 and (len(top) == 3 or top[tok] <= min(top.values()))
    assert e.logprobs.tokens[n_prompt:] == lp.tokens


def test_echo_scores_a_chat_completion_as_it_was_generated(oai, tokenizer):
    """Prompt logprobs (prefill rows) of chat prompt + completion ids = the completion's logprobs (verify
    rows when speculating): the completion's ids come back from the entries' exact bytes."""
    from services.gateway.serving_engine import _byte_decoder

    encoder = {b: c for c, b in _byte_decoder().items()}
    r = chat(oai, True, max_tokens=12, top_logprobs=None)
    content = r.choices[0].logprobs.content
    ids = tokenizer.tokenizer.convert_tokens_to_ids(["".join(encoder[b] for b in e.bytes) for e in content])
    prompt = tokenizer.encode_chat(MESSAGES)
    scored = (
        oai.completions.create(
            model=MODEL_NAME, prompt=prompt + ids, echo=True, max_tokens=1, temperature=0, logprobs=0
        )
        .choices[0]
        .logprobs
    )
    got = scored.token_logprobs[len(prompt) : len(prompt) + len(ids)]
    assert all(abs(x - e.logprob) < TOL for x, e in zip(got, content, strict=True))
    assert scored.tokens[len(prompt) : len(prompt) + len(ids)] == [e.token for e in content]


def test_completion_stream_with_echo(oai):
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2, echo=True)
    full = oai.completions.create(**kwargs).choices[0]
    chunks = [c for c in oai.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == full.text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == full.logprobs.tokens and offsets == full.logprobs.text_offset
    assert values[0] is None and all(
        abs(x - y) < TOL for x, y in zip(values[1:], full.logprobs.token_logprobs[1:], strict=True)
    )


def test_async_client(gateway):
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0) as client:
            kwargs = dict(
                model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
            )
            full, stream = await asyncio.gather(
                client.chat.completions.create(**kwargs, extra_body={"speculative": True}),
                client.chat.completions.create(**kwargs, stream=True, extra_body={"speculative": False}),
            )
            entries = [
                e async for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
            ]
            completion = await client.completions.create(
                model=MODEL_NAME, prompt="Hi", max_tokens=4, logprobs=1, temperature=0
            )
            return full, entries, completion

    full, entries, completion = asyncio.run(run())
    assert_close(full.choices[0].logprobs.content, entries)
    assert len(completion.choices[0].logprobs.tokens) == 4


@pytest.mark.parametrize(
    ("endpoint", "kwargs", "param"),
    [
        ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        ("chat", dict(top_logprobs=2), "top_logprobs"),
        ("chat", dict(logprobs=False, top_logprobs=2), "top_logprobs"),
        ("completions", dict(logprobs=6), "logprobs"),
        ("completions", dict(logprobs=-1), "logprobs"),
    ],
)
def test_bad_values_are_400(oai, endpoint, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        if endpoint == "chat":
            oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, **kwargs)
        else:
            oai.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, **kwargs)
    assert err.value.param == param


def test_completion_stream_echo_without_any_completion_text(oai):
    """A completion cut to nothing by a stop string still streams the echoed prompt (with the finish)."""
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, temperature=0)
    first = oai.completions.create(**kwargs).choices[0].text[:1]
    chunks = [c for c in oai.completions.create(**kwargs, echo=True, stop=[first], stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == "Once upon a time"
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]

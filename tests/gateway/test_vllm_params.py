"""vLLM's extensions (`min_tokens`, `repetition_penalty`, `min_p`, `include_stop_str_in_output`,
`skip_special_tokens`, ...) through the official `openai` client's `extra_body` against the real stack
(real worker, real gateway): each accepted and applied, on both endpoints, greedy output identical with
speculation on and off; bad values a 400 naming the parameter.
"""

from __future__ import annotations

from collections import Counter

import openai
import pytest

from gateway.harness import MODEL_NAME
from gateway.test_openai_params import MESSAGES, chat, oai, token_ids  # noqa: F401 - oai is a fixture
from services.gateway.protocol import VLLM_EXTENSIONS


def test_min_tokens_holds_back_stop_tokens(oai, tokenizer):  # noqa: F811
    first = token_ids(tokenizer, chat(oai, logprobs=True))[0]
    stopped = chat(oai, max_tokens=16, extra_body={"stop_token_ids": [first]})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    for speculative in (False, True):
        held = chat(oai, speculative, max_tokens=16, extra_body={"stop_token_ids": [first], "min_tokens": 6})
        assert held.usage.completion_tokens >= 6
        if held.choices[0].finish_reason == "length":
            assert held.usage.completion_tokens == 16
    completion = oai.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=8, temperature=0,
                                        extra_body={"min_tokens": 8})
    assert completion.usage.completion_tokens == 8


def test_repetition_penalty_changes_repetitive_output(oai, tokenizer):  # noqa: F811
    ids = token_ids(tokenizer, chat(oai, logprobs=True, max_tokens=32))
    assert len(set(ids)) < len(ids)  # the tiny random model repeats itself
    penalized = chat(oai, logprobs=True, max_tokens=32, extra_body={"repetition_penalty": 2.0})
    pids = token_ids(tokenizer, penalized)
    assert pids != ids and max(Counter(pids).values()) < max(Counter(ids).values())
    on, off = (chat(oai, s, max_tokens=32, extra_body={"repetition_penalty": 1.5}) for s in (True, False))
    assert off.model_extra["speculation"]["draft_tokens"] == 0
    assert on.choices[0].message.content == off.choices[0].message.content


def test_min_p_one_keeps_only_the_most_likely_token(oai):  # noqa: F811
    greedy = chat(oai, max_tokens=16).choices[0].message.content
    for seed in (1, 2):  # sampling at temperature 1, but only the most probable token survives
        sampled = chat(oai, max_tokens=16, temperature=1.0, seed=seed, extra_body={"min_p": 1.0})
        assert sampled.choices[0].message.content == greedy
    loose = chat(oai, max_tokens=16, temperature=1.0, seed=1, extra_body={"min_p": 0.0})
    assert loose.choices[0].message.content != greedy  # without min_p the sample differs
    completion = oai.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=4, temperature=1.0, seed=3,
                                        extra_body={"min_p": 1.0})
    assert completion.choices[0].text == oai.completions.create(
        model=MODEL_NAME, prompt="Once", max_tokens=4, temperature=0).choices[0].text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # more than max_tokens (16)
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": 1e-30}, "repetition_penalty"),  # would overflow float32 logits
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
    ],
)
def test_bad_values_are_a_400_naming_the_parameter(oai, extra, param):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, max_tokens=16, extra_body=extra)
    assert err.value.param == param and err.value.code == "invalid_value"


def test_include_stop_str_in_output(oai):  # noqa: F811
    text = chat(oai, max_tokens=32).choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = text[:text.index(stop)]
    assert chat(oai, max_tokens=32, stop=[stop]).choices[0].message.content == cut
    kept = chat(oai, max_tokens=32, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == cut + stop and kept.choices[0].finish_reason == "stop"
    streamed = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=32, temperature=0,
                                           stop=[stop], stream=True, extra_body={"include_stop_str_in_output": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut + stop
    args = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=32, temperature=0)
    full = oai.completions.create(**args).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    done = oai.completions.create(**args, stop=stop, extra_body={"include_stop_str_in_output": True})
    assert done.choices[0].text == full[:full.index(stop)] + stop
    pieces = oai.completions.create(**args, stop=stop, stream=True, extra_body={"include_stop_str_in_output": True})
    assert "".join(c.choices[0].text for c in pieces if c.choices) == full[:full.index(stop)] + stop
    # no stop string matched (max_tokens ended it): nothing added
    assert chat(oai, max_tokens=4, extra_body={"include_stop_str_in_output": True}).choices[0].message.content \
        == chat(oai, max_tokens=4).choices[0].message.content


@pytest.mark.parametrize("name", ["skip_special_tokens", "spaces_between_special_tokens"])
def test_special_token_decoding_takes_only_true(oai, name):  # noqa: F811
    assert chat(oai, extra_body={name: True}).choices[0].message.content == chat(oai).choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, extra_body={name: False})
    assert err.value.param == name and err.value.code == "unsupported_parameter"


def test_every_vllm_extension_is_accepted_on_both_endpoints(oai):  # noqa: F811
    extensions = {"min_tokens": 1, "repetition_penalty": 1.1, "min_p": 0.05, "include_stop_str_in_output": True,
                  "skip_special_tokens": True, "spaces_between_special_tokens": True}
    assert set(extensions) == set(VLLM_EXTENSIONS)
    assert chat(oai, extra_body=extensions).choices[0].message.content
    assert oai.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, extra_body=extensions).choices

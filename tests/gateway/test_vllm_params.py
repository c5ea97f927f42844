"""vLLM's extensions (`min_tokens`, `repetition_penalty`, `min_p`, `include_stop_str_in_output`,
`skip_special_tokens`, ...) through the official `openai` client's `extra_body` against the real stack
(real worker, real gateway): each accepted and applied, on both endpoints, greedy output identical with
speculation on and off; bad values a 400 naming the parameter.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import jsonschema_rs
import openai
import pytest

from gateway.harness import MAX_MODEL_LEN, MODEL_NAME
from gateway.test_openai_params import ANSWER, MESSAGES, chat, oai, token_ids  # noqa: F401 - oai is a fixture
from services.gateway.protocol import VLLM_EXTENSIONS
from services.gateway.tokenizer import ChatTemplateOptions, TargetTokenizer


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


CHOICES = ["yes", "no (really)", "maybe.", "a|b"]  # regex metacharacters are matched literally


def test_guided_choice_regex_json_and_grammar(oai):  # noqa: F811
    for seed in range(4):
        r = chat(oai, temperature=1.0, seed=seed, n=4, max_tokens=16, extra_body={"guided_choice": CHOICES})
        assert all(c.message.content in CHOICES and c.finish_reason == "stop" for c in r.choices)
    on, off = (chat(oai, s, max_tokens=16, extra_body={"guided_choice": CHOICES}) for s in (True, False))
    assert on.choices[0].message.content == off.choices[0].message.content in CHOICES
    regex = r"[a-c]{2,4}-[0-9]{2}"
    text = chat(oai, max_tokens=16, extra_body={"guided_regex": regex}).choices[0].message.content
    assert re.fullmatch(regex, text), text
    for schema in (ANSWER, json.dumps(ANSWER)):  # an object or its JSON text
        text = chat(oai, max_tokens=64, extra_body={"guided_json": schema}).choices[0].message.content
        assert jsonschema_rs.is_valid(ANSWER, json.loads(text))
    text = chat(oai, max_tokens=16, extra_body={"guided_grammar": 'start: "x" ("y" | "z")+'}).choices[0].message.content
    assert re.fullmatch("x[yz]+", text), text
    for so, check in (({"choice": CHOICES}, lambda t: t in CHOICES),
                      ({"regex": regex}, lambda t: re.fullmatch(regex, t)),
                      ({"json": ANSWER}, lambda t: jsonschema_rs.is_valid(ANSWER, json.loads(t))),
                      ({"json_object": True}, lambda t: isinstance(json.loads(t), dict))):
        text = chat(oai, max_tokens=64, extra_body={"structured_outputs": so}).choices[0].message.content
        assert check(text), (so, text)
    for stream in (False, True):
        r = oai.completions.create(model=MODEL_NAME, prompt="Is it?", max_tokens=16, temperature=0, stream=stream,
                                   extra_body={"guided_choice": CHOICES})
        text = "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
        assert text in CHOICES


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(extra_body={"guided_regex": "a", "guided_choice": ["b"]}), "guided_choice"),
        (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs.choice"),
        (dict(extra_body={"guided_regex": "a"}, response_format={"type": "json_object"}), "guided_regex"),
        (dict(extra_body={"guided_json": "[1, 2]"}), "guided_json"),
        (dict(extra_body={"guided_json": "not json"}), "guided_json"),
        (dict(extra_body={"guided_choice": []}), "guided_choice"),
        (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex"),
        (dict(extra_body={"guided_grammar": "start: undefined_rule"}), "guided_grammar"),
    ],
)
def test_bad_constraints_are_a_400_naming_the_parameter(oai, kwargs, param):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, **kwargs)
    assert err.value.param == param, err.value.message


def test_every_vllm_extension_is_accepted_on_both_endpoints(oai):  # noqa: F811
    extensions = {"min_tokens": 1, "repetition_penalty": 1.1, "min_p": 0.05, "include_stop_str_in_output": True,
                  "skip_special_tokens": True, "spaces_between_special_tokens": True, "truncate_prompt_tokens": 64,
                  "prompt_logprobs": 1}
    guided = {"guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"}
    assert set(extensions) | guided == set(VLLM_EXTENSIONS)  # (the constraints are exclusive: tested above)
    assert chat(oai, extra_body=extensions).choices[0].message.content
    assert oai.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, extra_body=extensions).choices


# ---------------------------------------------------------------------------------- chat template options


def test_generation_prompt_and_continued_final_message(oai, tokenizer):  # noqa: F811
    convo = [*MESSAGES, {"role": "assistant", "content": "Once upon a time, the cat"}]
    opened = tokenizer.encode_chat(convo)
    closed = tokenizer.encode_chat(convo, template=ChatTemplateOptions(add_generation_prompt=False))
    open_last = tokenizer.encode_chat(convo, template=ChatTemplateOptions(False, True))
    assert len(closed) < len(opened) and opened[:len(closed)] == closed
    assert tokenizer.tokenizer.decode(open_last).endswith("the cat")  # no end-of-turn after it
    for body, expected in (({}, opened), ({"add_generation_prompt": False}, closed),
                           ({"continue_final_message": True}, open_last),
                           ({"continue_final_message": True, "add_generation_prompt": False}, open_last)):
        r = chat(oai, messages=convo, max_tokens=4, extra_body=body)
        assert r.usage.prompt_tokens == len(expected), body
    for body in ({"continue_final_message": True, "add_generation_prompt": True},  # both: a 400
                 {"chat_template_kwargs": {"tokenize": True}}):
        with pytest.raises(openai.BadRequestError) as err:
            chat(oai, messages=convo, extra_body=body)
        assert err.value.param == next(iter(body)), body
    with pytest.raises(openai.BadRequestError) as err:  # the last message is the user's
        chat(oai, extra_body={"continue_final_message": True})
    assert err.value.param == "continue_final_message"
    assert chat(oai, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message.content


def test_echo_prepends_the_continued_assistant_message(oai):  # noqa: F811
    prefix = "Once upon a time, the cat"
    convo = [*MESSAGES, {"role": "assistant", "content": prefix}]
    plain = chat(oai, messages=convo, max_tokens=8, extra_body={"continue_final_message": True})
    added = plain.choices[0].message.content
    for speculative in (True, False):
        echoed = chat(oai, speculative, messages=convo, max_tokens=8,
                      extra_body={"continue_final_message": True, "echo": True})
        assert echoed.choices[0].message.content == prefix + added
        stream = chat(oai, speculative, messages=convo, max_tokens=8, stream=True,
                      extra_body={"continue_final_message": True, "echo": True})
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == prefix + added
    # the last message is the user's: nothing to echo (vLLM's rule: only a message of the answer's role)
    assert chat(oai, max_tokens=8, extra_body={"echo": True}).choices[0].message.content == chat(
        oai, max_tokens=8).choices[0].message.content


def test_chat_template_kwargs_reach_the_template(chat_target):
    tok = TargetTokenizer.load(str(chat_target))
    tok.tokenizer.chat_template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    options = ChatTemplateOptions(kwargs={"greeting": "Hi"})
    ids = tok.encode_chat([{"role": "user", "content": " world"}], template=options)
    assert tok.tokenizer.decode(ids) == "Hi world"


def test_truncate_prompt_tokens_keeps_the_last_tokens(oai, tokenizer):  # noqa: F811
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    args = dict(model=MODEL_NAME, max_tokens=6, temperature=0)
    tail = oai.completions.create(prompt=ids[-5:], **args)
    cut = oai.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": 5}, **args)
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == tail.choices[0].text
    text = oai.completions.create(prompt=tokenizer.tokenizer.decode(ids), extra_body={"truncate_prompt_tokens": 5},
                                  echo=True, **args)
    assert text.usage.prompt_tokens == 5 and text.choices[0].text.startswith(tokenizer.tokenizer.decode(ids[-5:]))
    # longer than the context: kept whole it is a 400, truncated it is served
    long = ids * (MAX_MODEL_LEN // len(ids) + 1)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(prompt=long, **args)
    served = oai.completions.create(prompt=long, extra_body={"truncate_prompt_tokens": -1}, max_tokens=1,
                                    model=MODEL_NAME, temperature=0)
    assert served.usage.prompt_tokens == MAX_MODEL_LEN - 1
    prompt = tokenizer.encode_chat(MESSAGES)
    r = chat(oai, max_tokens=4, extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3 and len(prompt) > 3
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, extra_body={"truncate_prompt_tokens": 0})
    assert err.value.param == "truncate_prompt_tokens"


# ---------------------------------------------------------------------------------- prompt_logprobs


def _check_prompt_logprobs(entries, prompt: list[int], top: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for token, position in zip(prompt[1:], entries[1:], strict=True):
        assert str(token) in position and top <= len(position) <= top + 1
        ranks = [e["rank"] for t, e in position.items() if t != str(token) or e["rank"] is not None]
        assert sorted(ranks) == list(range(1, top + 1))
        assert all(e["logprob"] <= 0 and isinstance(e["decoded_token"], str) for e in position.values())


def test_prompt_logprobs_on_both_endpoints(client, tokenizer):
    prompt = tokenizer.encode("The cat sat on the mat.")
    r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2,
                                             "prompt_logprobs": 3}).json()
    _check_prompt_logprobs(r["choices"][0]["prompt_logprobs"], prompt, 3)
    # with echo's logprobs (a different count) both come from one request to the worker
    both = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "echo": True,
                                                "logprobs": 1, "prompt_logprobs": 4}).json()["choices"][0]
    _check_prompt_logprobs(both["prompt_logprobs"], prompt, 4)
    assert all(t is None or len(t) <= 2 for t in both["logprobs"]["top_logprobs"])  # echo's: 1 (+ the token)
    zero = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1,
                                                "prompt_logprobs": 0}).json()["choices"][0]["prompt_logprobs"]
    assert [list(p) for p in zero[1:]] == [[str(t)] for t in prompt[1:]]
    messages = [{"role": "user", "content": "Hi there"}]
    chat = client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, "max_tokens": 2,
                                                     "prompt_logprobs": 2}).json()
    _check_prompt_logprobs(chat["prompt_logprobs"], tokenizer.encode_chat(messages), 2)
    plain = client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, "max_tokens": 2})
    assert "prompt_logprobs" not in plain.json()
    streamed = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "stream": True,
                                                    "prompt_logprobs": 1})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_min_tokens_holds_back_stop_strings(oai):  # noqa: F811
    text = chat(oai, max_tokens=32).choices[0].message.content
    stop = text[1:3]  # occurs early
    cut = chat(oai, max_tokens=32, stop=[stop])
    assert len(cut.choices[0].message.content) <= 1
    held = chat(oai, max_tokens=32, stop=[stop], extra_body={"min_tokens": 10, "include_stop_str_in_output": True})
    content = held.choices[0].message.content
    assert held.usage.completion_tokens >= 10 and text.startswith(content)
    assert held.choices[0].finish_reason == "length" or content.endswith(stop)

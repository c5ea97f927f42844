"""Speculation never changes what a client receives: the text, through the HTTP API, in many scripts.

A real worker serving the reference model (SmolLM2-135M-Instruct, the product's dtype) with prompt
lookup drafting at a fixed γ of 6: where the output repeats the prompt or itself (the "repeat" and
translation prompts below, and this small model's own loops) whole copies are accepted in one step,
so steps commit many tokens at once, across the bytes of multi-byte characters. Every answer is
compared with the same request sent with `speculative: false`, streamed with non-streamed, and
with the decode of its own token ids (from the logprobs' bytes); greedy and seeded sampling, alone
and under load, chat and completions (and the Responses and Messages APIs against chat), n > 1, stop
strings, logprobs and JSON mode.

Each of these failed before the detokenizer decoded the tail of a request whose last commit ended
inside a character (greedy: the speculative text lost whole runs of CJK text) and before seeded
requests drew their tokens from (seed, position) (seeded: three sends, three texts).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import anthropic
import pytest
from openai import OpenAI

from gateway.harness import MODEL_NAME, serve_gateway, start_worker
from services.gateway.serving_engine import _byte_decoder
from services.gateway.tokenizer import TargetTokenizer
from tide.target import resolve_target

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
# Scripts whose characters are several bytes and often several tokens in a byte-level BPE vocabulary
# trained mostly on English: CJK, kana, hangul, emoji with ZWJ sequences and skin tones, combining
# accents, and characters the vocabulary only has as byte pieces.
PROMPTS = [
    "Translate to Japanese: Good morning, my friend.",
    "写一首关于春天的短诗。",
    "用中文解释什么是机器学习。",
    "日本の首都はどこですか？ひらがなで答えてください。",
    "カタカナで「コンピューター」と「インターネット」を書いてください。",
    "한국어로 자기소개를 해 주세요.",
    "서울의 날씨는 어때요? 한국어로 대답해 주세요.",
    "Write three emoji sequences with skin tones: 👍🏽 👋🏿 🙌🏻",
    "Describe this family emoji: 👨‍👩‍👧‍👦 and this one: 👩🏽‍💻",
    "Repeat exactly: 🏳️‍🌈 🧑🏾‍🚀 👨‍👨‍👦 🫶🏼 ❤️‍🔥",
    "Repeat exactly: 春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。",
    "Repeat exactly: いろはにほへと ちりぬるを わかよたれそ つねならむ",
    "Repeat exactly: 다람쥐 헌 쳇바퀴에 타고파 다람쥐 헌 쳇바퀴에 타고파",
    "Repeat exactly: Ångström, naïve café, façade, coöperate, São Paulo, Zürich",
    "Repeat exactly with the accents: e\u0301 a\u0300 o\u0302 n\u0303 u\u0308 c\u0327",
    "Repeat exactly: ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀𓁐 ☃ ♞ ⚡ 𝄞",
    "Repeat exactly: Привет, как дела? Привет, как дела? Привет!",
    "Repeat exactly: مرحبا بالعالم، مرحبا بالعالم",
    "Repeat exactly: नमस्ते दुनिया, नमस्ते दुनिया",
    "Repeat exactly: สวัสดีครับ สวัสดีครับ",
    "Translate to Chinese: The weather is nice today, let's go for a walk.",
    "Translate to Korean: Thank you very much for your help.",
    "Translate to French: I would like a coffee with milk, please.",
    "List five Japanese foods in Japanese script.",
    "Write the word 'hello' in Chinese, Japanese, Korean, Greek and Russian.",
    "Γράψε μια πρόταση στα ελληνικά για τη θάλασσα.",
    "Écris une phrase sur l'été en français, avec des accents.",
    "Schreibe einen Satz über Bäume und Flüsse auf Deutsch.",
    "Give me a JSON object with a greeting in Japanese.",
    "Write a Python string containing the emoji 🐍 and the text 'こんにちは'.",
    "What does 😂 mean? Answer with more emoji.",
    "Count from one to ten in Chinese characters.",
]
ALONE = PROMPTS[:16:2] + PROMPTS[16::4]  # the ones also sent one at a time (the longest runs)


@pytest.fixture(scope="module")
def ref_tokenizer() -> TargetTokenizer:
    return TargetTokenizer.load(str(resolve_target("ref").path))


@pytest.fixture(scope="module")
def oai(ref_tokenizer, tmp_path_factory) -> Iterator[OpenAI]:
    # Prompt lookup at γ 6 every step (no registry: the n-gram drafter), batches of up to 16.
    env = {"TIDE_DTYPE": "auto", "TIDE_MAX_BATCH": "16", "TIDE_POLICY": "static",
           "TIDE_POLICY_PARAMS": json.dumps({"gamma": 6}), "OMP_NUM_THREADS": "2"}
    worker = start_worker(resolve_target("ref").path, tmp_path_factory.mktemp("ref-worker"), max_seq_len=1024,
                          timeout_s=300, env=env)
    try:
        with serve_gateway(ref_tokenizer, (worker.address,), max_model_len=1024) as url:
            yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    finally:
        worker.kill()


def _messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def chat(oai: OpenAI, prompt: str, speculative: bool, stream: bool = False, **kw) -> str:
    args = dict(model=MODEL_NAME, messages=_messages(prompt), max_tokens=MAX_TOKENS,
                extra_body={"speculative": speculative}, **{"temperature": 0, **kw})
    if not stream:
        return oai.chat.completions.create(**args).choices[0].message.content
    chunks = oai.chat.completions.create(stream=True, **args)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def completion(oai: OpenAI, prompt: str, speculative: bool, stream: bool = False, **kw) -> str:
    args = dict(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                extra_body={"speculative": speculative}, **{"temperature": 0, **kw})
    if not stream:
        return oai.completions.create(**args).choices[0].text
    return "".join(c.choices[0].text for c in oai.completions.create(stream=True, **args) if c.choices)


def _parallel(fn, jobs: list, workers: int = 16) -> list:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda job: fn(*job[0], **job[1]), jobs))


def _decoded(ref_tokenizer: TargetTokenizer, entries) -> str:
    """The text of the tokens a response's logprobs name (their exact bytes -> ids -> decode)."""
    encoder = {b: c for c, b in _byte_decoder().items()}
    hf = ref_tokenizer.tokenizer
    ids = hf.convert_tokens_to_ids(["".join(encoder[b] for b in e.bytes) for e in entries])
    return hf.decode(ids, skip_special_tokens=True)


def test_greedy_chat_text_is_the_same_with_and_without_speculation(oai, ref_tokenizer):
    alone = {p: chat(oai, p, True) for p in ALONE}
    jobs = ([((oai, p, True), {}) for p in PROMPTS] + [((oai, p, False), {}) for p in PROMPTS]
            + [((oai, p, True), {"stream": True}) for p in PROMPTS])
    results = _parallel(chat, jobs)  # 16 at a time: under load
    spec, plain, streamed = (results[i * len(PROMPTS):(i + 1) * len(PROMPTS)] for i in range(3))
    mismatches = [(p, a, b, c) for p, a, b, c in zip(PROMPTS, spec, plain, streamed, strict=True)
                  if not a == b == c == alone.get(p, a)]
    assert not mismatches, mismatches
    assert sum(any(ord(ch) > 0x2E80 for ch in text) for text in spec) >= 10  # CJK, hangul, emoji came out
    # The text is the decode of the tokens: no character lost or replaced where its bytes came.
    def with_logprobs(p):
        return oai.chat.completions.create(model=MODEL_NAME, messages=_messages(p), max_tokens=MAX_TOKENS,
                                           temperature=0, logprobs=True, extra_body={"speculative": True})
    for p, text, r in zip(PROMPTS, spec, _parallel(with_logprobs, [((p,), {}) for p in PROMPTS]), strict=True):
        content = r.choices[0].message.content
        assert content == text, p
        assert content == _decoded(ref_tokenizer, r.choices[0].logprobs.content), p


def test_greedy_completion_text_is_the_same_with_and_without_speculation(oai):
    prompts = [f"Q: {p}\nA:" for p in PROMPTS[::2]]
    jobs = ([((oai, p, True), {}) for p in prompts] + [((oai, p, False), {}) for p in prompts]
            + [((oai, p, True), {"stream": True}) for p in prompts])
    results = _parallel(completion, jobs)
    spec, plain, streamed = (results[i * len(prompts):(i + 1) * len(prompts)] for i in range(3))
    assert [(p, s) for p, s, q, t in zip(prompts, spec, plain, streamed, strict=True) if not s == q == t] == []


def test_seeded_sampling_gives_one_text_with_speculation_on_or_off_alone_or_under_load(oai):
    cases = [(p, 0.7 + 0.5 * (i % 3) / 2, 1000 + i) for i, p in enumerate(PROMPTS)]  # temperatures 0.7-1.2
    def sampled(prompt, temperature, seed, speculative, stream=False):
        return chat(oai, prompt, speculative, stream, temperature=temperature, seed=seed)
    alone = {c: sampled(*c, True) for c in cases[:16:3]}
    jobs = ([((*c, True), {}) for c in cases] + [((*c, False), {}) for c in cases]
            + [((*c, True), {"stream": True}) for c in cases])
    results = _parallel(sampled, jobs)
    spec, plain, streamed = (results[i * len(cases):(i + 1) * len(cases)] for i in range(3))
    assert [c for c, a, b, d in zip(cases, spec, plain, streamed, strict=True) if not a == b == d == alone.get(c, a)] \
        == []
    assert len(set(spec)) > len(cases) // 2  # the seeds gave their own samples
    # One request repeated 5 times alone and 5 times among 11 others (other seeds, unseeded).
    case = cases[1]
    repeats = [sampled(*case, True) for _ in range(5)]
    load = [((*case, True), {}) for _ in range(5)] + [((p, 1.0, None if i % 2 else 7 + i, True), {})
                                                       for i, p in enumerate(PROMPTS[10:21])]
    under_load = _parallel(sampled, load)[:5]
    assert set(repeats) == set(under_load) == {spec[1]}


def test_n_choices_reproduce_single_seeded_requests(oai):
    """Choice i of a seeded n-choice request samples as a single request with seed + i."""
    prompt = PROMPTS[3]
    r = oai.chat.completions.create(model=MODEL_NAME, messages=_messages(prompt), max_tokens=MAX_TOKENS, n=3,
                                    temperature=1.0, seed=42, extra_body={"speculative": True})
    singles = [chat(oai, prompt, False, temperature=1.0, seed=42 + i) for i in range(3)]
    assert [c.message.content for c in sorted(r.choices, key=lambda c: c.index)] == singles


def test_stop_strings_logprobs_and_json_mode_keep_the_text(oai, ref_tokenizer):
    # A multi-byte character the text reaches past its start, as the stop string.
    prompt, free, stop = next((p, free, ch) for p in PROMPTS[:12] for free in [chat(oai, p, False)]
                              for ch in free[6:] if ord(ch) > 0x2E80)
    for stream in (False, True):
        assert chat(oai, prompt, True, stream, stop=[stop]) == chat(oai, prompt, False, stream, stop=[stop]) \
            == free[:free.index(stop)]
    for p in (PROMPTS[28], PROMPTS[3]):
        kw = dict(response_format={"type": "json_object"})
        assert chat(oai, p, True, **kw) == chat(oai, p, False, **kw) == chat(oai, p, True, True, **kw)
    # A forced tool call's arguments (the constrained JSON, in Japanese) and a seeded one.
    tools = [{"type": "function", "function": {"name": "translate", "parameters": {
        "type": "object", "properties": {"japanese": {"type": "string"}}, "required": ["japanese"]}}}]
    def call(speculative, **kw):
        r = oai.chat.completions.create(model=MODEL_NAME, messages=_messages(PROMPTS[0]), max_tokens=48, tools=tools,
                                        tool_choice="required", extra_body={"speculative": speculative}, **kw)
        return [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 9}):
        assert call(True, **kw) == call(False, **kw) != []


def test_responses_and_messages_apis_give_chats_text(oai):
    """The Responses and Anthropic Messages endpoints run the same chat choice: greedy, their text is
    chat's with speculation on or off, streamed or not, in every script."""
    base = str(oai.base_url).removesuffix("/").removesuffix("/v1")
    claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=300)
    prompts = PROMPTS[1::2]

    def response(prompt, speculative, stream=False):
        args = dict(model=MODEL_NAME, input=prompt, max_output_tokens=MAX_TOKENS, temperature=0,
                    extra_body={"speculative": speculative})
        if not stream:
            return oai.responses.create(**args).output_text
        events = oai.responses.create(stream=True, **args)
        return "".join(e.delta for e in events if e.type == "response.output_text.delta")

    def message(prompt, speculative, stream=False):
        args = dict(model=MODEL_NAME, messages=_messages(prompt), max_tokens=MAX_TOKENS,
                    extra_body={"temperature": 0, "speculative": speculative})
        if not stream:
            return "".join(b.text for b in claude.messages.create(**args).content)
        with claude.messages.stream(**args) as s:
            return "".join(s.text_stream)

    expected = _parallel(chat, [((oai, p, False), {}) for p in prompts])
    for fn in (response, message):
        jobs = [((p, s), {"stream": st}) for st in (False, True) for s in (True, False) for p in prompts]
        results = _parallel(fn, jobs)
        runs = [results[i * len(prompts):(i + 1) * len(prompts)] for i in range(4)]
        mismatches = [(fn.__name__, p, e, *r) for p, e, *r in zip(prompts, expected, *runs, strict=True)
                      if any(x != e for x in r)]
        assert not mismatches, mismatches

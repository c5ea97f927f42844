"""The text a request streams is the decode of its tokens, however many tokens a step commits.

Property tests of tide.engine.detokenizer.IncrementalText on the reference tokenizer: token ids of
texts in many scripts, spelt with the tokenizer's own pieces and with byte-level pieces (one token
per byte: every multi-byte character split across tokens), fed in random commits of 1..12 tokens
(a plain step commits one, a speculative step several): the deltas joined equal decode(ids), with
or without stop strings (then cut at the first one), and no delta holds U+FFFD where the bytes
of a whole character came. Then the engine on the reference model with drafters that know the
target's own continuation (chains and trees: the longest accepted runs), greedy and seeded: the
speculative text equals the plain text, and both equal decode(output ids).
"""

from __future__ import annotations

import random

import pytest
from support.engine import ScriptedDrafter, ScriptedTreeDrafter

from tide.engine.detokenizer import IncrementalText
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.sequence import SamplingParams
from tide.policies import FixedGamma, FixedTree
from tide.target import load_tokenizer

TEXTS = [
    "おやしくはどわでなくはどわでなくはどわでなくはど",
    "春天是一种独若若，意味着独若若，意味着独",
    "안녕하세요 세계, 다람쥐 헌 쳇바퀴에 타고파",
    "👩🏽‍💻 family 👨‍👩‍👧‍👦 ok 🏳️‍🌈 🫶🏼 ❤️‍🔥 👍🏿",
    "café naïve e\u0301 a\u0300 o\u0302 n\u0303 Ångström Zürich",
    "ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀𓁐 ☃ ♞ ⚡ 𝄞 \ufffd literal",
    "Привет мир! مرحبا بالعالم नमस्ते दुनिया สวัสดีครับ",
    "def f(x):\n    return '日本語' + \"🐍\"  # コメント\n",
]


@pytest.fixture(scope="module")
def tokenizer(ref_target):
    return load_tokenizer(ref_target)


def _byte_ids(tokenizer, text: str) -> list[int]:
    from services.gateway.serving_engine import _byte_decoder

    vocab = tokenizer.get_vocab()
    encoder = {b: c for c, b in _byte_decoder().items()}
    return [vocab[encoder[b]] for b in text.encode("utf-8")]


def _spellings(tokenizer, text: str, rng: random.Random) -> list[list[int]]:
    """The tokenizer's encoding, all bytes, and a mix: words alternately encoded and spelt in bytes."""
    mixed: list[int] = []
    for k, word in enumerate(text.split(" ")):
        piece = word if k == 0 else " " + word
        spelt = _byte_ids(tokenizer, piece) if rng.random() < 0.5 else None
        mixed += spelt if spelt is not None else tokenizer.encode(piece, add_special_tokens=False)
    return [tokenizer.encode(text, add_special_tokens=False), _byte_ids(tokenizer, text), mixed]


def _stream(tokenizer, ids: list[int], rng: random.Random, stop: tuple[str, ...] = ()) -> tuple[str, list[str]]:
    inc = IncrementalText(tokenizer, stop)
    deltas, n, hit = [], 0, False
    while n < len(ids) and not hit:
        n = min(len(ids), n + rng.randint(1, 12))
        delta, hit = inc.update(ids[:n])
        deltas.append(delta)
    deltas.append(inc.flush())
    return "".join(deltas), deltas


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_the_decode_of_the_ids_in_any_commit_sizes(tokenizer, text):
    rng = random.Random(text)
    for ids in _spellings(tokenizer, text, rng):
        full = tokenizer.decode(ids, skip_special_tokens=True)
        for cut in (len(ids), len(ids) - 1):  # the last token cut: the text ends inside a character
            want = tokenizer.decode(ids[:cut], skip_special_tokens=True)
            for _ in range(25):
                got, deltas = _stream(tokenizer, ids[:cut], rng)
                assert got == want
                # U+FFFD only where the text itself has one (a literal one, or bytes cut at the end)
                assert "".join(deltas[:-1]).count("\ufffd") <= full.count("\ufffd")


@pytest.mark.parametrize("text", TEXTS)
def test_stop_strings_cut_the_text_at_their_first_occurrence(tokenizer, text):
    rng = random.Random(text + "stop")
    for ids in _spellings(tokenizer, text, rng):
        full = tokenizer.decode(ids, skip_special_tokens=True)
        chars = [c for c in full if not c.isspace()]
        for stop in (rng.choice(chars), full[len(full) // 2:len(full) // 2 + 2]):
            for _ in range(10):
                got, _ = _stream(tokenizer, ids, rng, (stop, "never-there"))
                assert got == full[:full.index(stop)], (stop, got)


# ---- the engine on the reference model ----------------------------------------------------------

PROMPTS = ["Translate to Japanese: Good morning, my friend.", "写一首关于春天的短诗。",
           "한국어로 자기소개를 해 주세요.", "Repeat exactly: 👩🏽‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️‍🔥"]


def _ids(tokenizer, prompt: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(out if isinstance(out, list) else out["input_ids"])


def _run(model, tokenizer, prompts, params, drafter=None, policy=None) -> list[tuple[str, list[int]]]:
    engine = LLMEngine(model, EngineConfig(max_batch=4, max_seq_len=512), tokenizer=tokenizer, drafter=drafter,
                       policy=policy)
    seqs = [engine.add_request(f"r{i}", p, params[i]) for i, p in enumerate(prompts)]
    texts = {s.request_id: "" for s in seqs}
    while engine.has_work():
        for out in engine.step():
            texts[out.request_id] += out.text_delta
    return [(texts[s.request_id], s.output_ids) for s in seqs]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}, {"stop": ("。", "\n\n")}])
def test_reference_model_speculative_text_equals_plain_text(ref_model_bf16, tokenizer, extra):
    prompts = [_ids(tokenizer, p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=40, **extra),
              SamplingParams(max_tokens=40, temperature=1.0, seed=3, **extra),
              SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=11, **extra),
              SamplingParams(max_tokens=40, **extra)]
    plain = _run(ref_model_bf16, tokenizer, prompts, params)
    known = {f"r{i}": ids for i, (_, ids) in enumerate(plain)}
    for drafter, policy in ((ScriptedDrafter(known, 49152), FixedGamma(8)),
                            (ScriptedDrafter(known, 49152, corrupt_every=3), FixedGamma(5)),
                            (ScriptedTreeDrafter(known, 49152, corrupt_every=4), FixedTree(6, 3, 12))):
        spec = _run(ref_model_bf16, tokenizer, prompts, params, drafter, policy)
        assert spec == plain
    for text, ids in plain:
        if "stop" not in extra:
            assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert sum(any(ord(c) > 0x2E80 for c in text) for text, _ in plain) >= 2

"""Stop conditions and streamed text: EOS, stop token ids, max_tokens, stop strings (real tokenizer)."""

from __future__ import annotations

import pytest

from tide.engine.detokenizer import IncrementalText
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.sequence import SamplingParams
from tide.target import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(ref_target):
    return load_tokenizer(ref_target)


def test_incremental_text_equals_full_decode_and_holds_back_stop_prefixes(tokenizer):
    text = "Hello wörld — naïve café 🍵! The answer is 42.\n\nDone."
    ids = tokenizer.encode(text)
    inc = IncrementalText(tokenizer, stop=("\n\n",))
    out, hit = "", False
    for i in range(1, len(ids) + 1):
        delta, hit = inc.update(ids[:i])
        out += delta
        assert "\ufffd" not in delta
        if hit:
            break
    assert hit and inc.matched == "\n\n"
    assert out == "Hello wörld — naïve café 🍵! The answer is 42."


def test_engine_stops_on_stop_token_and_max_tokens(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(max_batch=2, max_seq_len=128))
    free = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop_tok = free.output_ids[4]
    first = free.output_ids.index(stop_tok)
    seq = LLMEngine(tiny_model, EngineConfig(max_batch=2, max_seq_len=128)).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(stop_tok,)))[0]
    assert seq.output_ids == free.output_ids[:first + 1]
    assert seq.finish_reason.value == "stop" and seq.matched_stop == stop_tok
    assert free.finish_reason.value == "length" and free.num_output == 30


def test_engine_stops_on_eos_unless_ignored(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(max_batch=2, max_seq_len=128))
    free = engine.generate([[9, 3, 9]], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    # Declare a token the random model actually emits as its EOS, to exercise the path deterministically.
    engine2 = LLMEngine(tiny_model, EngineConfig(max_batch=2, max_seq_len=128))
    engine2.eos_ids = {free.output_ids[3]}
    seq = engine2.generate([[9, 3, 9]], SamplingParams(max_tokens=40))[0]
    assert seq.output_ids[-1] == free.output_ids[3] and seq.finish_reason.value == "stop"
    assert len(seq.output_ids) <= 4


def test_min_tokens_holds_back_stop_strings(tokenizer):
    ids = tokenizer.encode("one, two, three, four, five")
    early = IncrementalText(tokenizer, stop=(",",))
    held = IncrementalText(tokenizer, stop=(",",), min_tokens=4)
    for n in range(1, len(ids) + 1):
        if not early.matched:
            early.update(ids[:n])
        if not held.matched:
            held.update(ids[:n])
    assert early.text == "one" and held.matched == ","
    # the commas within the first 4 tokens' text do not stop it; the first one after them does
    first4 = tokenizer.decode(ids[:4])
    assert held.text.startswith(first4) and "," not in held.text[len(first4):] and len(held.text) > len(first4)

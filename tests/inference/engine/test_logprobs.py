"""Log-probabilities are the target's, lossless under speculation.

Every emitted token's reported logprob (and its top-N alternatives) must equal log_softmax of a plain
HF forward's logits over the whole sequence at that position, whether the token came from plain
decoding, an accepted draft or a correction / bonus token (n-gram, EAGLE-3 and scripted drafts, γ
changing mid-request), greedy or sampled (raw distribution: no temperature / top-k / top-p). Prompt
logprobs (for `echo`) come from the prefill's rows, across prefill chunks. With a tokenizer, entries
follow the text: tokens whose text is not returned (a stop string's, EOS) get none.
"""

from __future__ import annotations

import pytest
import torch
from support.engine import CyclingGamma, ScriptedDrafter, tiny_eagle3_drafter

from tide.engine.drafters import NgramDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.sequence import SamplingParams
from tide.policies import FixedGamma
from tide.target import load_tokenizer

VOCAB = 96
TOP = 5
TOL = 1e-4  # fp32 tiny model: the engine's rows and HF's agree to ~1e-6


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(3, VOCAB, (max(2, n // 3),), generator=g).tolist() * 3)[:n] for n in (6, 19, 11, 40)]


@pytest.fixture(scope="module")
def hf_model(tiny_target):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_target.path, torch_dtype=torch.float32).eval()


def _reference(hf_model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain forward over the whole sequence: row i = distribution of token i + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _check(seq, ref: torch.Tensor, top: int, start: int) -> None:
    """Entries of seq's tokens from position `start` on against the reference rows."""
    entries = seq.prompt_logprobs if start == 1 else seq.logprobs
    tokens = seq.token_ids[start:start + len(entries)]
    assert len(entries) == len(tokens) and entries
    for k, (entry, tok) in enumerate(zip(entries, tokens, strict=True)):
        row = ref[start + k - 1]
        assert entry.token_id == tok
        assert abs(entry.logprob - row[tok].item()) < TOL, (k, entry.logprob, row[tok].item())
        values, ids = torch.topk(row, top)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert all(abs(v - r) < TOL for (_, v), r in zip(entry.top, values.tolist(), strict=True))
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)


def _engine(model, drafter=None, policy=None, **config) -> LLMEngine:
    cfg = dict(max_batch=4, max_seq_len=256, max_tokens_per_step=64, prefill_chunk=16)
    return LLMEngine(model, EngineConfig(**{**cfg, **config}), drafter=drafter, policy=policy)


@pytest.fixture(scope="module")
def plain(tiny_model):
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=TOP, prompt_logprobs=3)
    return _engine(tiny_model).generate(_prompts(), params, speculative=False)


def test_plain_decoding_reports_the_targets_logprobs(plain, hf_model):
    for seq in plain:
        ref = _reference(hf_model, seq.token_ids)
        _check(seq, ref, TOP, seq.num_prompt)
        assert len(seq.logprobs) == seq.num_output
        # Prompt logprobs: every prompt token after the first, across prefill chunks of 16.
        assert len(seq.prompt_logprobs) == seq.num_prompt - 1
        _check(seq, ref, 3, 1)
        # Greedy: the chosen token is the most likely one.
        assert all(e.top[0][0] == e.token_id for e in seq.logprobs)


@pytest.mark.parametrize("drafter_kind", ["ngram", "eagle3", "good", "cycling"])
def test_speculation_reports_the_same_logprobs(tiny_model, plain, hf_model, drafter_kind):
    prompts = _prompts()
    policy = FixedGamma(3)
    if drafter_kind == "ngram":
        drafter = NgramDrafter()
    elif drafter_kind == "eagle3":
        drafter = tiny_eagle3_drafter(tiny_model, max_batch=4)
    else:
        drafter = ScriptedDrafter({f"gen-0-{i}": s.output_ids for i, s in enumerate(plain)}, VOCAB, corrupt_every=3)
        if drafter_kind == "cycling":
            policy = CyclingGamma([3, 0, 1, 5, 0, 2])
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=TOP, prompt_logprobs=3)
    seqs = _engine(tiny_model, drafter, policy).generate(prompts, params, speculative=True)
    assert sum(s.draft_tokens for s in seqs) > 0
    if drafter_kind in ("good", "cycling"):
        assert sum(s.accepted_tokens for s in seqs) > 0
    for seq, base in zip(seqs, plain, strict=True):
        assert seq.output_ids == base.output_ids  # greedy, logprobs requested: lossless
        for a, b in zip(seq.logprobs, base.logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-5
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        for a, b in zip(seq.prompt_logprobs, base.prompt_logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-5
        _check(seq, _reference(hf_model, seq.token_ids), TOP, seq.num_prompt)


def test_sampled_tokens_report_the_raw_distribution(tiny_model, hf_model):
    """temperature / top-k / top-p change what is sampled, not the reported (raw) logprobs."""
    params = SamplingParams(max_tokens=20, temperature=0.7, top_k=20, top_p=0.9, seed=5, ignore_eos=True,
                            logprobs=2)
    for speculative, drafter in ((False, None), (True, NgramDrafter())):
        seqs = _engine(tiny_model, drafter, FixedGamma(3)).generate(_prompts()[:2], params, speculative=speculative)
        for seq in seqs:
            _check(seq, _reference(hf_model, seq.token_ids), 2, seq.num_prompt)
            assert not seq.prompt_logprobs


def test_outputs_carry_entries_only_for_requests_that_asked(tiny_model):
    engine = _engine(tiny_model, NgramDrafter(), FixedGamma(2))
    asked = engine.add_request("a", [5, 6, 7, 5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0))
    other = engine.add_request("b", [5, 6, 7, 5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True))
    got: dict[str, list] = {"a": [], "b": []}
    while engine.has_work():
        for out in engine.step():
            assert (out.logprobs is None) == (out.request_id == "b")
            if out.logprobs is not None:
                assert [e.token_id for e in out.logprobs] == out.new_token_ids  # no tokenizer: every token
                assert all(e.top == () for e in out.logprobs)
                got[out.request_id] += out.logprobs
    assert [e.token_id for e in got["a"]] == asked.output_ids and not other.logprobs


def test_logprobs_follow_the_returned_text(tiny_model, ref_target):
    """With stop strings the entries of tokens inside the matched stop string are dropped (streamed
    entries never run ahead of the text), and an EOS gets none: entries = the tokens of the text."""
    tokenizer = load_tokenizer(ref_target)
    free = _engine(tiny_model).generate([[40, 41, 42, 43]], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    text = tokenizer.decode(free.output_ids, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    for drafter in (None, NgramDrafter()):
        engine = LLMEngine(tiny_model, EngineConfig(max_batch=2, max_seq_len=128), tokenizer=tokenizer,
                           drafter=drafter, policy=FixedGamma(3))
        engine.add_request("s", [40, 41, 42, 43], SamplingParams(max_tokens=30, stop=(stop,), logprobs=1))
        out_text, entries = "", []
        while engine.has_work():
            for out in engine.step():
                out_text += out.text_delta
                entries += out.logprobs
                # Never ahead of the text: every released token's text starts within what is out.
                if entries:
                    ids = [e.token_id for e in entries[:-1]]
                    assert len(tokenizer.decode(ids, skip_special_tokens=True)) < len(out_text)
        assert out_text == text[:text.index(stop)]
        ids = [e.token_id for e in entries]
        # Every token whose text is returned has its entry, none other.
        assert len(tokenizer.decode(ids[:-1], skip_special_tokens=True)) < len(out_text) <= len(
            tokenizer.decode(ids, skip_special_tokens=True))
        assert ids == free.output_ids[:len(ids)]
    # EOS (a special token: its text is not returned): generated, counted, but no entry.
    engine = LLMEngine(tiny_model, EngineConfig(max_batch=2, max_seq_len=128),
                       tokenizer=_Skipping(tokenizer, free.output_ids[3]))
    engine.eos_ids = {free.output_ids[3]}
    engine.add_request("e", [40, 41, 42, 43], SamplingParams(max_tokens=30, logprobs=0))
    entries = [e for _ in iter(engine.has_work, False) for out in engine.step() for e in out.logprobs]
    assert engine.scheduler.get("e") is None  # finished
    assert [e.token_id for e in entries] == free.output_ids[:3]



class _Skipping:
    """A tokenizer treating `special` as a special token (skipped when decoding), as the real EOS is."""

    def __init__(self, tokenizer, special: int) -> None:
        self.tokenizer, self.special = tokenizer, special

    def decode(self, ids, skip_special_tokens=False):
        if skip_special_tokens:
            ids = [t for t in ids if t != self.special]
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

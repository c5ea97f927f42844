"""Speculative sampling emits tokens distributed exactly as the target's own sampling.

Statistical tests with fixed seeds: each compares observed counts with the exact distribution
(computed from the target's probabilities) by a chi-square goodness-of-fit test at
ALPHA = 1e-3, so a correct implementation fails a given check for 1 in 1000 seeds; the seeds are
fixed, so the outcome is deterministic. A biased verifier (e.g. accepting every draft, or
sampling rejections from p instead of norm(max(0, p - q))) fails them by a wide margin.
"""

from __future__ import annotations

import pytest
import torch
from support.engine import RandomDrafter, chi_square_p_value, exact_first_two, sample_many, tiny_eagle3_drafter

from tide.engine.drafters import NgramDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.sampling import SamplingScheme, verify_sampling
from tide.engine.sequence import SamplingParams
from tide.policies import FixedGamma

ALPHA = 1e-3


@pytest.mark.parametrize("proposal", ["q", "one-hot"])
def test_verifier_first_token_follows_p(proposal):
    g = torch.Generator().manual_seed(0)
    V, trials = 12, 20000
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)  # a different, draft distribution
    probs = torch.stack([p, torch.softmax(torch.randn(V, generator=g), -1)])
    counts = torch.zeros(V)
    for _ in range(trials):
        if proposal == "q":
            d = int(torch.multinomial(q, 1, generator=g))
            k, nxt = verify_sampling(probs, [d], q.view(1, V), g)
        else:
            d = 3  # deterministic proposal, as the n-gram drafter makes
            k, nxt = verify_sampling(probs, [d], None, g)
        counts[d if k == 1 else nxt] += 1
    assert chi_square_p_value(counts, p) > ALPHA


@pytest.mark.parametrize("scheme", list(SamplingScheme))
@pytest.mark.parametrize("drafter_kind,params", [
    ("random-q", SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)),
    ("ngram", SamplingParams(max_tokens=3, temperature=0.8, top_k=20, ignore_eos=True)),
    ("eagle3", SamplingParams(max_tokens=3, temperature=1.3, top_p=0.9, ignore_eos=True)),
])
def test_engine_sampling_matches_target_distribution(tiny_model, drafter_kind, params, scheme):
    # Every vocabulary id occurs in the prompt, so the n-gram drafter always finds a match to copy.
    prompt = list(range(3, tiny_model.cfg.vocab_size)) + [5, 17, 5]
    p1, p2 = exact_first_two(tiny_model, prompt, params)
    drafter = {"random-q": lambda: RandomDrafter(tiny_model.cfg.vocab_size, seed=3, sharpness=1.0),
               "ngram": NgramDrafter,
               "eagle3": lambda: tiny_eagle3_drafter(tiny_model, max_batch=64)}[drafter_kind]()
    engine = LLMEngine(tiny_model, EngineConfig(max_batch=64, max_seq_len=128, unseeded_sampling=scheme),
                       drafter=drafter, policy=FixedGamma(3))
    seqs = sample_many(engine, prompt, params)
    assert sum(s.draft_tokens for s in seqs) > 0
    if drafter_kind != "ngram":  # the copied n-gram is unlikely under this random target: mostly rejected
        assert sum(s.accepted_tokens for s in seqs) > 0
    first = torch.bincount(torch.tensor([s.output_ids[0] for s in seqs]), minlength=p1.numel())
    second = torch.bincount(torch.tensor([s.output_ids[1] for s in seqs]), minlength=p1.numel())
    assert chi_square_p_value(first, p1) > ALPHA
    assert chi_square_p_value(second, p2) > ALPHA


def test_sampling_with_prompt_lookup_matches_target_distribution(tiny_model):
    """EAGLE-3 + prompt lookup: the first token decides which proposes at the second (a copy when it
    occurs in the prompt, which holds half the vocabulary; else a sampled draft), so both kinds of
    proposal meet the verifier, in the same batches."""
    from tide.engine.drafters.hybrid import HybridDrafter

    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    vocab = tiny_model.cfg.vocab_size
    prompt = list(range(3, vocab, 2)) + [5, 17, 5]
    p1, p2 = exact_first_two(tiny_model, prompt, params)
    drafter = HybridDrafter(tiny_eagle3_drafter(tiny_model, max_batch=64))
    engine = LLMEngine(tiny_model, EngineConfig(max_batch=64, max_seq_len=128), drafter=drafter,
                       policy=FixedGamma(3))
    seqs = []
    for start in range(0, 1000, 64):
        batch = [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(start, min(1000, start + 64))]
        seqs += engine.generate([prompt] * len(batch), batch)
    assert drafter.copied > 50 and drafter.drafted > 50
    assert sum(s.accepted_tokens for s in seqs) > 0
    first = torch.bincount(torch.tensor([s.output_ids[0] for s in seqs]), minlength=p1.numel())
    second = torch.bincount(torch.tensor([s.output_ids[1] for s in seqs]), minlength=p1.numel())
    assert chi_square_p_value(first, p1) > ALPHA
    assert chi_square_p_value(second, p2) > ALPHA


def test_sampling_with_the_speculation_memory_matches_target_distribution(tiny_model):
    """EAGLE-3 + prompt lookup + the memory: after the first 64 requests the memory holds earlier
    samples of the same prompt, so the second and third tokens are proposed from it (the most
    frequent continuation so far: a proposal that depends on earlier requests' draws, never on
    this one's), meeting the verifier beside copies and drafts. Rejection sampling: where the
    proposal's q matters (coupled draws ignore it; test_coupled_sampling covers the memory there)."""
    from tide.engine.drafters.hybrid import HybridDrafter

    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    vocab = tiny_model.cfg.vocab_size
    prompt = list(range(3, vocab, 2)) + [5, 17, 5]
    p1, p2 = exact_first_two(tiny_model, prompt, params)
    drafter = HybridDrafter(tiny_eagle3_drafter(tiny_model, max_batch=64))
    config = EngineConfig(max_batch=64, max_seq_len=128, speculation_memory_mb=4)
    engine = LLMEngine(tiny_model, config, drafter=drafter, policy=FixedGamma(3))
    seqs = sample_many(engine, prompt, params)
    assert drafter.recalled > 500
    assert sum(s.accepted_tokens for s in seqs) > 0
    first = torch.bincount(torch.tensor([s.output_ids[0] for s in seqs]), minlength=p1.numel())
    second = torch.bincount(torch.tensor([s.output_ids[1] for s in seqs]), minlength=p1.numel())
    assert chi_square_p_value(first, p1) > ALPHA
    assert chi_square_p_value(second, p2) > ALPHA


def test_sampling_matches_the_quantized_targets_distribution(tiny_model_quantized):
    """With weight-only int8 / int4 weights the exact distribution is the quantized model's own."""
    model = tiny_model_quantized
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    prompt = list(range(3, model.cfg.vocab_size)) + [5, 17, 5]
    p1, p2 = exact_first_two(model, prompt, params)
    engine = LLMEngine(model, EngineConfig(max_batch=64, max_seq_len=128),
                       drafter=tiny_eagle3_drafter(model, max_batch=64), policy=FixedGamma(3))
    seqs = []
    for start in range(0, 1000, 64):
        batch = [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(start, min(1000, start + 64))]
        seqs += engine.generate([prompt] * len(batch), batch)
    assert sum(s.accepted_tokens for s in seqs) > 0
    first = torch.bincount(torch.tensor([s.output_ids[0] for s in seqs]), minlength=p1.numel())
    second = torch.bincount(torch.tensor([s.output_ids[1] for s in seqs]), minlength=p1.numel())
    assert chi_square_p_value(first, p1) > ALPHA
    assert chi_square_p_value(second, p2) > ALPHA


def test_seeded_requests_are_reproducible(tiny_model):
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    runs = [LLMEngine(tiny_model, EngineConfig(max_batch=4, max_seq_len=64)).generate([[5, 6, 7]], params)[0]
            for _ in range(2)]
    assert runs[0].output_ids == runs[1].output_ids

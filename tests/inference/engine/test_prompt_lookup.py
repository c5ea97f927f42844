"""Prompt lookup: the n-gram index finds what a scan of the history finds, and the EAGLE-3 +
lookup drafter copies where the context repeats, drafts elsewhere, and stays lossless."""

from __future__ import annotations

import random

import pytest
from support.engine import tiny_eagle3_drafter

from tide.engine.drafters.hybrid import HybridDrafter
from tide.engine.drafters.ngram import NgramIndex
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.sequence import SamplingParams
from tide.policies import FixedGamma, FixedTree
from tide.policies.adaptive import AdaptivePolicy
from tide.policies.profile import LatencyProfile, synthetic_profile


def _scan(tokens: list[int], gamma: int, max_n: int, min_n: int) -> list[int]:
    """The definition: the tokens after the latest earlier occurrence of the longest suffix."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                return tokens[start + n:start + n + gamma]
    return []


def _mixed_prompts(seed: int, n: int, cycle: int = 4, repeats: int = 5) -> list[list[int]]:
    """Half the prompts repeat a short cycle (copies), half are fresh tokens (drafts)."""
    rng = random.Random(seed)
    return [([rng.randrange(3, 96) for _ in range(cycle)] * repeats) if i % 2 == 0 else
            [rng.randrange(3, 96) for _ in range(9 + i)] for i in range(n)]


@pytest.mark.parametrize("vocab,max_n,min_n", [(6, 3, 1), (20, 4, 2), (200, 3, 1)])
def test_index_finds_what_a_scan_of_the_history_finds(vocab, max_n, min_n):
    rng = random.Random(vocab)
    tokens: list[int] = []
    index = NgramIndex(max_n)
    found = 0
    while len(tokens) < 400:  # grown by 1-4 tokens a step, as verification steps commit them
        tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        gamma = rng.randint(1, 5)
        expected = _scan(tokens, gamma, max_n, min_n)
        assert index.lookup(tokens, gamma, min_n) == expected
        found += bool(expected)
    assert found > 10  # matches were there to find


def test_index_of_another_shorter_list_starts_over():
    index = NgramIndex(3)
    assert index.lookup([1, 2, 3, 1, 2], 2, 1) == [3, 1]
    assert index.lookup([7, 8, 7], 2, 1) == [8, 7]  # not the first list's positions


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_output_equals_plain_and_both_sources_propose(tiny_model, batch):
    prompts = _mixed_prompts(batch, batch)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    config = EngineConfig(max_batch=8, max_seq_len=256)
    plain = [s.output_ids for s in LLMEngine(tiny_model, config).generate(prompts, params)]
    drafter = HybridDrafter(tiny_eagle3_drafter(tiny_model, seed=batch), min_match=2)
    spec = LLMEngine(tiny_model, config, drafter=drafter, policy=FixedGamma(3)).generate(prompts, params)
    assert [s.output_ids for s in spec] == plain
    assert drafter.copied > 0 and drafter.drafted > 0


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_output_equals_plain_with_trees_from_both_sources(tiny_model, batch):
    """Under a tree policy the hybrid proposes a copy as a branchless tree and grows the draft's
    trees elsewhere; one forward verifies both kinds side by side."""
    prompts = _mixed_prompts(10 + batch, batch)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    config = EngineConfig(max_batch=8, max_seq_len=256)
    plain = [s.output_ids for s in LLMEngine(tiny_model, config).generate(prompts, params)]
    drafter = HybridDrafter(tiny_eagle3_drafter(tiny_model, seed=batch), min_match=2)
    records = []
    engine = LLMEngine(tiny_model, config, drafter=drafter, policy=FixedTree(3, 2, 5))
    engine.step_listeners.append(records.append)
    assert [s.output_ids for s in engine.generate(prompts, params)] == plain
    assert drafter.copied > 0 and drafter.drafted > 0
    assert {s for r in records for s in r.sources} == {"ngram", "eagle3"}


class _Recording(FixedGamma):
    """FixedGamma that keeps the source each request was announced with, step by step."""

    def __init__(self, gamma: int) -> None:
        super().__init__(gamma)
        self.sources: list[str] = []
        self.matches: list[int] = []

    def decide(self, ctx):
        self.sources += [r.drafter for r in ctx.requests]
        self.matches += [r.match for r in ctx.requests]
        return super().decide(ctx)


def test_the_policy_is_told_which_source_each_request_drafts_from(tiny_model):
    """RequestView.drafter (and StepRecord.sources) is "ngram" exactly for the requests the hybrid
    then copies for and "eagle3" for those it drafts for, so the γ policy can price and learn each
    apart."""
    prompts = _mixed_prompts(3, 6)
    drafter = HybridDrafter(tiny_eagle3_drafter(tiny_model, seed=3), min_match=2)
    policy = _Recording(2)
    engine = LLMEngine(tiny_model, EngineConfig(max_batch=8, max_seq_len=256), drafter=drafter, policy=policy)
    records = []
    engine.step_listeners.append(records.append)
    engine.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    # Telemetry says the same per request, so the controller counts the draft's own tokens apart.
    # A copy says how long its match is (min_match 2 .. max_n 3); a draft chain has none.
    assert all((2 <= m <= 3) if s == "ngram" else m == 0 for s, m in zip(policy.sources, policy.matches, strict=True))
    told = [s for r in records for s in r.sources]
    assert told == policy.sources and all(r.drafter == "eagle3" for r in records)
    # γ = 2 everywhere except a request's last token (no room to draft): those steps propose nothing.
    assert policy.sources.count("ngram") >= drafter.copied > 0
    assert policy.sources.count("eagle3") >= drafter.drafted > 0
    assert len(policy.sources) - drafter.copied - drafter.drafted <= len(prompts)


def test_greedy_output_equals_plain_under_the_adaptive_policy_with_both_sources(tiny_model):
    prompts = _mixed_prompts(5, 4, cycle=3, repeats=6)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    config = EngineConfig(max_batch=4, max_seq_len=256)
    plain = [s.output_ids for s in LLMEngine(tiny_model, config).generate(prompts, params)]
    for batch in (1, 4):
        drafter = HybridDrafter(tiny_eagle3_drafter(tiny_model, seed=5), min_match=2)
        engine = LLMEngine(tiny_model, EngineConfig(max_batch=batch, max_seq_len=256), drafter=drafter,
                           policy=AdaptivePolicy(synthetic_profile(), alpha_prior=0.9))
        assert [s.output_ids for s in engine.generate(prompts, params)] == plain
        assert drafter.copied > 0


class _SeesShapes(AdaptivePolicy):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trees_played = 0

    def observe(self, feedback):
        self.trees_played += sum(sh is not None for sh in feedback.shapes)
        super().observe(feedback)


def test_greedy_output_equals_plain_when_the_adaptive_policy_grows_trees(tiny_model):
    """Rows priced free (a GPU's verify): the adaptive policy plays trees for the draft's requests
    and chains for the copies, and the output is plain decoding's, at batch 1 and 4."""
    prompts = _mixed_prompts(7, 4, cycle=3, repeats=6)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = [s.output_ids for s in LLMEngine(tiny_model, EngineConfig(max_batch=4, max_seq_len=256)).generate(
        prompts, params)]
    flat = LatencyProfile(T_ms={b: {n: 50.0 for n in range(1, 17)} for b in (1, 2, 4)}, D0_ms=0.5)
    for batch in (1, 4):
        drafter = HybridDrafter(tiny_eagle3_drafter(tiny_model, seed=7), min_match=2)
        policy = _SeesShapes(flat, alpha_prior=0.9, tree_extra=(3,))
        engine = LLMEngine(tiny_model, EngineConfig(max_batch=batch, max_seq_len=256), drafter=drafter,
                           policy=policy)
        assert [s.output_ids for s in engine.generate(prompts, params)] == plain
        assert policy.trees_played > 0 and drafter.copied > 0

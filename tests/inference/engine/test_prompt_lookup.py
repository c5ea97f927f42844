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
from tide.policies import FixedGamma


def _scan(tokens: list[int], gamma: int, max_n: int, min_n: int) -> list[int]:
    """The definition: the tokens after the latest earlier occurrence of the longest suffix."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                return tokens[start + n:start + n + gamma]
    return []


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
    rng = random.Random(batch)
    # Half the prompts repeat a short cycle (copies), half are fresh tokens (drafts).
    prompts = [([rng.randrange(3, 96) for _ in range(4)] * 5) if i % 2 == 0 else
               [rng.randrange(3, 96) for _ in range(9 + i)] for i in range(batch)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    config = EngineConfig(max_batch=8, max_seq_len=256)
    plain = [s.output_ids for s in LLMEngine(tiny_model, config).generate(prompts, params)]
    drafter = HybridDrafter(tiny_eagle3_drafter(tiny_model, seed=batch), min_match=2)
    spec = LLMEngine(tiny_model, config, drafter=drafter, policy=FixedGamma(3)).generate(prompts, params)
    assert [s.output_ids for s in spec] == plain
    assert drafter.copied > 0 and drafter.drafted > 0

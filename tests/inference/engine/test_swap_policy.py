"""A hot swap tells the γ policy that the draft it learnt acceptance from is gone."""

from __future__ import annotations

from support.engine import RandomDrafter

from tide.engine.drafters import NgramDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.policies import DraftAware, FixedGamma

VOCAB = 96


class RecordingPolicy(FixedGamma):
    def __init__(self) -> None:
        super().__init__(2)
        self.swaps = 0

    def draft_changed(self) -> None:
        self.swaps += 1


def test_each_swap_to_another_drafter_tells_a_draft_aware_policy(tiny_model):
    policy = RecordingPolicy()
    assert isinstance(policy, DraftAware)
    first = RandomDrafter(VOCAB)
    engine = LLMEngine(tiny_model, EngineConfig(max_batch=2, max_seq_len=64), drafter=first, policy=policy)
    before = policy.swaps
    engine.swap_drafter(first)
    assert policy.swaps == before  # the same drafter: what was learnt of it still holds
    engine.swap_drafter(NgramDrafter())
    engine.swap_drafter(None)
    assert policy.swaps == before + 2

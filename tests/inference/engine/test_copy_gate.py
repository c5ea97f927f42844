"""The copy gate: the hybrid copies from a match length only while such copies are worth more than
the draft's chains, learns both from the steps played, and the output stays the target's own."""

from __future__ import annotations

import random

import pytest
from support.engine import tiny_eagle3_drafter

from tide.engine.drafters.copy_gate import DRAFT, CopyGate
from tide.engine.drafters.hybrid import HybridDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.sequence import SamplingParams
from tide.policies import FixedGamma


def _mixed_prompts(seed: int, n: int, cycle: int = 4, repeats: int = 5) -> list[list[int]]:
    """Half the prompts repeat a short cycle (copies), half are fresh tokens (drafts)."""
    rng = random.Random(seed)
    return [([rng.randrange(3, 96) for _ in range(cycle)] * repeats) if i % 2 == 0 else
            [rng.randrange(3, 96) for _ in range(9 + i)] for i in range(n)]


def _played(gate: CopyGate, key: int, steps: int, depth: int, accepted: int) -> None:
    for _ in range(steps):
        gate.observe(key, depth, accepted)


def test_a_fresh_gate_copies_as_the_hybrid_always_did():
    gate = CopyGate()
    assert all(gate.allows_copy(n) for n in (1, 2, 3))
    assert not gate.allows_copy(0)  # no match: nothing to copy


def test_weak_copies_give_way_to_a_better_draft_and_strong_ones_do_not():
    gate = CopyGate()
    _played(gate, DRAFT, 200, 3, 2)  # the draft's chains: 2 of 3 accepted
    _played(gate, 1, 200, 3, 0)  # one-token matches: nothing accepted
    _played(gate, 3, 200, 3, 3)  # three-token matches: everything accepted
    assert gate.rate(DRAFT) == pytest.approx(2 / 3, abs=0.02) and gate.rate(1) < 0.05
    decisions = [gate.allows_copy(1) for _ in range(16)]
    assert decisions.count(True) == 2  # only the exploring plays (every 8th), so its rate stays current
    assert gate.allows_copy(3)


def test_the_draft_must_beat_a_copy_by_more_than_its_own_cost():
    even = CopyGate(draft_cost=0.15)
    _played(even, DRAFT, 300, 3, 1)
    _played(even, 1, 300, 3, 1)  # the same acceptance: the copy, which costs no draft forward, wins
    assert even.allows_copy(1)
    free = CopyGate(draft_cost=0.0)
    _played(free, DRAFT, 300, 3, 2)
    _played(free, 1, 300, 3, 1)
    assert not free.allows_copy(1)


def test_old_evidence_fades():
    gate = CopyGate()
    _played(gate, 1, 300, 3, 0)
    _played(gate, 1, 300, 3, 3)  # copies of this length became good
    assert gate.rate(1) > 0.9


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_output_equals_plain_with_the_gate_and_it_learns_from_the_steps(tiny_model, batch):
    prompts = _mixed_prompts(20 + batch, batch)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    config = EngineConfig(max_batch=8, max_seq_len=256)
    plain = [s.output_ids for s in LLMEngine(tiny_model, config).generate(prompts, params)]
    gate = CopyGate()
    drafter = HybridDrafter(tiny_eagle3_drafter(tiny_model, seed=batch), gate=gate)
    spec = LLMEngine(tiny_model, config, drafter=drafter, policy=FixedGamma(3)).generate(prompts, params)
    assert [s.output_ids for s in spec] == plain
    assert drafter.copied > 0 and drafter.drafted > 0
    assert gate.rate(DRAFT) != pytest.approx(1 / 4)  # the draft prior (1, 3) moved: its steps were heard
    assert any(gate.rate(n) != pytest.approx(3 / 5) for n in (1, 2, 3))  # ... and the copies'


def test_a_gate_that_rates_the_draft_higher_drafts_where_the_hybrid_copied(tiny_model):
    prompts = _mixed_prompts(31, 4)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    config = EngineConfig(max_batch=4, max_seq_len=256)

    def run(gate: CopyGate | None) -> HybridDrafter:
        drafter = HybridDrafter(tiny_eagle3_drafter(tiny_model, seed=4), gate=gate)
        LLMEngine(tiny_model, config, drafter=drafter, policy=FixedGamma(3)).generate(prompts, params)
        return drafter

    trusting = CopyGate(decay=1.0, draft_prior=(1e6, 1.0), copy_prior=(1.0, 1e6))  # evidence cannot move it
    ungated, gated = run(None), run(trusting)
    assert gated.drafted > ungated.drafted and gated.copied < ungated.copied
    assert gated.copied > 0  # exploration still copies now and then

"""Greedy speculative decoding emits exactly the tokens plain decoding emits.

Covered: γ ∈ {1, 2, 3, 5}; batch 1 and a batch of prompts with different lengths; γ changing
mid-request (including 0 <-> k); a useless (random) draft, a good one (mostly right, sometimes
wrong), the n-gram drafter and EAGLE-3 with prompt lookup; a drafter hot-swap mid-generation.
"""

from __future__ import annotations

import pytest
from support.engine import CyclingGamma, RandomDrafter, ScriptedDrafter, repetitive_prompts, tiny_eagle3_drafter

from tide.engine.drafters import NgramDrafter
from tide.engine.drafters.hybrid import HybridDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.sequence import SamplingParams
from tide.policies import FixedGamma

VOCAB = 96
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    return repetitive_prompts(n, VOCAB, seed)  # the n-gram drafter finds copies in them


def _engine(model, drafter=None, policy=None, max_batch=8) -> LLMEngine:
    return LLMEngine(model, EngineConfig(max_batch=max_batch, max_seq_len=256, max_tokens_per_step=64),
                     drafter=drafter, policy=policy)


def _plain(model, prompts) -> list[list[int]]:
    return [s.output_ids for s in _engine(model).generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def prompts():
    return _prompts(8)


@pytest.fixture(scope="module")
def plain_outputs(tiny_model, prompts):
    return _plain(tiny_model, prompts)


@pytest.mark.parametrize("gamma", [1, 2, 3, 5])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("drafter_kind", ["good", "random", "ngram", "eagle3", "hybrid", "hybrid-memory"])
def test_speculative_equals_plain(tiny_model, prompts, plain_outputs, gamma, batch, drafter_kind):
    prompts, expected = prompts[:batch], plain_outputs[:batch]
    if drafter_kind == "good":
        drafter = ScriptedDrafter({f"gen-0-{i}": out for i, out in enumerate(expected)}, VOCAB, corrupt_every=3)
    elif drafter_kind == "random":
        drafter = RandomDrafter(VOCAB, seed=gamma)
    elif drafter_kind == "eagle3":
        drafter = tiny_eagle3_drafter(tiny_model, seed=gamma)
    elif drafter_kind.startswith("hybrid"):  # EAGLE-3 + prompt lookup: copies and drafts
        drafter = HybridDrafter(tiny_eagle3_drafter(tiny_model, seed=gamma), min_match=2)
    else:
        drafter = NgramDrafter()
    engine = _engine(tiny_model, drafter, FixedGamma(gamma))
    if drafter_kind == "hybrid-memory":  # and recalls: the memory holds a first run of the prompts
        engine = LLMEngine(tiny_model, EngineConfig(max_batch=8, max_seq_len=256, max_tokens_per_step=64,
                                                    speculation_memory_mb=1), drafter=drafter, policy=FixedGamma(gamma))
        engine.generate(prompts, GREEDY)
        recalled = drafter.recalled
    seqs = engine.generate(prompts, GREEDY)
    if drafter_kind == "hybrid-memory":
        assert drafter.recalled > recalled
    assert [s.output_ids for s in seqs] == expected
    drafted = sum(s.draft_tokens for s in seqs)
    accepted = sum(s.accepted_tokens for s in seqs)
    assert drafted > 0, "speculation never ran: the test would prove nothing"
    if drafter_kind == "good":
        assert 0 < accepted < drafted  # both accepting and rejecting paths ran
        assert sum(s.verify_steps for s in seqs) < sum(len(o) for o in expected)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("drafter_kind", ["good", "ngram", "eagle3", "hybrid"])
def test_speculative_equals_plain_on_quantized_weights(tiny_model_quantized, prompts, batch, drafter_kind):
    """Lossless with respect to the quantized target: its own plain decoding is the reference."""
    model = tiny_model_quantized
    prompts = prompts[:batch]
    expected = _plain(model, prompts)
    drafter = {"good": lambda: ScriptedDrafter({f"gen-0-{i}": o for i, o in enumerate(expected)}, VOCAB,
                                               corrupt_every=3),
               "ngram": NgramDrafter, "eagle3": lambda: tiny_eagle3_drafter(model, seed=batch),
               "hybrid": lambda: HybridDrafter(tiny_eagle3_drafter(model, seed=batch))}[drafter_kind]()
    seqs = _engine(model, drafter, CyclingGamma([3, 1, 0, 5, 2])).generate(prompts, GREEDY)
    assert [s.output_ids for s in seqs] == expected
    assert sum(s.draft_tokens for s in seqs) > 0
    if drafter_kind == "good":
        assert 0 < sum(s.accepted_tokens for s in seqs) < sum(s.draft_tokens for s in seqs)


@pytest.mark.parametrize("drafter_kind", ["good", "eagle3"])
def test_gamma_changing_mid_request(tiny_model, prompts, plain_outputs, drafter_kind):
    """γ moves between 0 and k; an EAGLE-3 draft catches up on the tokens decoded while off."""
    if drafter_kind == "good":
        drafter = ScriptedDrafter({f"gen-0-{i}": o for i, o in enumerate(plain_outputs)}, VOCAB, corrupt_every=4)
    else:
        drafter = tiny_eagle3_drafter(tiny_model)
    engine = _engine(tiny_model, drafter, CyclingGamma([3, 0, 1, 5, 0, 0, 2]))
    seqs = engine.generate(prompts, GREEDY)
    assert [s.output_ids for s in seqs] == plain_outputs
    gammas_seen = {g for s in seqs for g, _ in s.recent}
    assert {0, 1, 2}.issubset(gammas_seen)


def test_hot_swap_mid_generation(tiny_model, prompts, plain_outputs):
    engine = _engine(tiny_model, RandomDrafter(VOCAB), FixedGamma(3))
    seqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    for _ in range(6):
        engine.step()
    assert any(s.num_output > 0 for s in seqs) and not all(s.status.is_finished() for s in seqs)
    engine.swap_drafter(NgramDrafter())
    for _ in range(4):
        engine.step()
    engine.swap_drafter(tiny_eagle3_drafter(tiny_model, seed=7))  # rebuilds its cache from the store
    for _ in range(3):
        engine.step()
    engine.swap_drafter(HybridDrafter(tiny_eagle3_drafter(tiny_model, seed=8)))  # its lookup indexes from scratch
    for _ in range(3):
        engine.step()
    engine.swap_drafter(ScriptedDrafter({f"r{i}": o for i, o in enumerate(plain_outputs)}, VOCAB))
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in seqs] == plain_outputs


def test_requests_joining_and_leaving_between_steps(tiny_model, prompts, plain_outputs):
    """Continuous batching: staggered arrivals and a cancellation leave other outputs unchanged."""
    engine = _engine(tiny_model, NgramDrafter(), FixedGamma(2), max_batch=3)
    seqs = {}
    pending = list(enumerate(prompts))
    victim = engine.add_request("victim", prompts[0], GREEDY)
    step = 0
    while pending or engine.has_work():
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            seqs[i] = engine.add_request(f"r{i}", p, GREEDY)
        if step == 3:
            assert engine.cancel("victim")
        engine.step()
        step += 1
    assert victim.finish_reason.value == "cancelled"
    assert [seqs[i].output_ids for i in range(len(prompts))] == plain_outputs


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "int8", "int4"])
def test_reference_model_speculative_equals_plain(dtype, request):
    """The production dtypes ("auto": bf16 where fast, else fp32) and TIDE_WEIGHTS=int8 / int4
    (bf16 activations) on the reference model, n-gram drafts, batch 1 and 3."""
    ref_model = request.getfixturevalue(f"ref_model_{dtype}")
    prompts = [[1, 9690, 198, 2683, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
               [1, 4093, 253, 1789, 2306, 338, 16296, 10148, 30, 2, 198] * 2,
               [1, 504, 3821, 2464, 325, 253, 1466, 28, 253, 1466, 28, 253, 1466, 28]]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    config = EngineConfig(max_batch=4, max_seq_len=512)
    plain = [s.output_ids for s in LLMEngine(ref_model, config).generate(prompts, params)]
    for batch in (1, 3):
        engine = LLMEngine(ref_model, config, drafter=NgramDrafter(), policy=FixedGamma(3))
        spec = engine.generate(prompts[:batch], params)
        assert [s.output_ids for s in spec] == plain[:batch]
        assert sum(s.accepted_tokens for s in spec) > 0

"""Coupled sampling (tide.engine.sampling: position_uniform, coupled_draws, verify_coupled): a seeded
request's tokens are a function of (seed, position) and the target alone.

What a user relies on: the same seed gives the same text with speculation on or off, whatever γ,
tree, drafter, draft, batch or load. The draws themselves are exact (chi-square against p, as in
test_lossless_sampling; the engine-level distribution tests there and in test_tree_sampling run on
this path too), and the uniforms behave as independent uniforms across positions.
"""

from __future__ import annotations

import pytest
import torch
from support.engine import (
    CyclingGamma,
    RandomDrafter,
    ScriptedDrafter,
    ScriptedTreeDrafter,
    chi_square_p_value,
    repetitive_prompts,
    tiny_eagle3_drafter,
)

from tide.engine.drafters import NgramDrafter
from tide.engine.drafters.hybrid import HybridDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.sampling import SamplingScheme, coupled_draws, position_uniform, verify_coupled
from tide.engine.sequence import SamplingParams
from tide.policies import FixedGamma, FixedTree

ALPHA = 1e-3
VOCAB = 96


def test_position_uniforms_are_uniform_and_independent_across_positions():
    u = torch.tensor([position_uniform(7, n) for n in range(40000)], dtype=torch.float64)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    bins = torch.bincount((u * 20).long(), minlength=20).double()
    assert chi_square_p_value(bins, torch.full((20,), 1 / 20)) > ALPHA
    # Consecutive positions (what one step's rows use) and the same position under nearby seeds:
    # a 10 x 10 grid of pairs is uniform.
    for a, b in ((u[:-1], u[1:]), (u, torch.tensor([position_uniform(8, n) for n in range(40000)]))):
        pairs = torch.bincount((a * 10).long() * 10 + (b * 10).long(), minlength=100).double()
        assert chi_square_p_value(pairs, torch.full((100,), 1 / 100)) > ALPHA
    assert position_uniform(2**64 + 7, 3) == position_uniform(7, 3)  # the seed is taken mod 2^64
    assert position_uniform(-1, 0) == position_uniform(2**64 - 1, 0)


def test_coupled_draws_follow_p_and_never_draw_a_zero_weight_token():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(12, generator=g) * 1.5, -1)
    p[[2, 7]] = 0.0  # as top-k / top-p leave it (unnormalised: the draw normalises)
    tokens = coupled_draws(p.expand(20000, -1), [position_uniform(3, n) for n in range(20000)])
    counts = torch.bincount(torch.tensor(tokens), minlength=12).double()
    assert counts[2] == counts[7] == 0
    assert chi_square_p_value(counts, p / p.sum()) > ALPHA
    # At the ends of [0, 1): the first and the last token with weight.
    assert coupled_draws(p[None], [0.0]) == [0]
    assert coupled_draws(p[None], [1.0 - 2.0**-53]) == [11]
    q = p.clone()
    q[11] = 0.0
    assert coupled_draws(q[None], [1.0 - 2.0**-53]) == [10]


def test_coupled_verification_emits_the_targets_draws_whatever_the_drafts():
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(5, 30, generator=g) * 2, -1)
    uniforms = [position_uniform(11, n) for n in range(5)]
    own = coupled_draws(probs, uniforms)
    assert verify_coupled(probs, own[:4], uniforms) == (4, own[4])  # the right guesses: all accepted
    wrong = [own[0], own[1], (own[2] + 1) % 30, own[3]]
    assert verify_coupled(probs, wrong, uniforms) == (2, own[2])  # the target's draw at the first miss
    assert verify_coupled(probs, [], uniforms) == (0, own[0])  # plain decoding


def _engine(model, drafter=None, policy=None, max_batch=8) -> LLMEngine:
    return LLMEngine(model, EngineConfig(max_batch=max_batch, max_seq_len=256, max_tokens_per_step=64),
                     drafter=drafter, policy=policy)


SEEDED = [SamplingParams(max_tokens=40, temperature=t, top_p=p, top_k=k, seed=s, ignore_eos=True)
          for t, p, k, s in ((1.0, 1.0, 0, 1234), (0.7, 0.9, 0, 7), (1.2, 1.0, 20, 2**64 - 5), (0.9, 0.95, 8, 0))]


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts(4, VOCAB, seed=3)


@pytest.fixture(scope="module")
def plain_seeded(tiny_model, prompts):
    return [s.output_ids for s in _engine(tiny_model).generate(prompts, SEEDED)]


@pytest.mark.parametrize("drafter_kind", ["oracle", "random", "ngram", "eagle3", "eagle3-argmax", "hybrid",
                                          "hybrid-memory", "tree-oracle", "tree-eagle3", "tree-memory"])
def test_a_seeded_request_gives_the_plain_seeded_tokens_under_speculation(tiny_model, prompts, plain_seeded,
                                                                         drafter_kind):
    """Fails where seeded sampling consumes randomness along the draft's path (rejection sampling):
    the tokens then depend on the drafter, γ and the batch."""
    policy = CyclingGamma([3, 1, 0, 5, 2])
    ids = {f"gen-0-{i}": out for i, out in enumerate(plain_seeded)}
    if drafter_kind == "oracle":
        drafter = ScriptedDrafter(ids, VOCAB, corrupt_every=3)
    elif drafter_kind == "random":
        drafter = RandomDrafter(VOCAB, seed=5)
    elif drafter_kind == "ngram":
        drafter = NgramDrafter()
    elif drafter_kind.startswith("eagle3"):
        drafter = tiny_eagle3_drafter(tiny_model, seed=1)
        drafter.coupled_drafts = drafter_kind == "eagle3"
    elif drafter_kind == "hybrid":
        drafter = HybridDrafter(tiny_eagle3_drafter(tiny_model, seed=2), min_match=2)
    elif drafter_kind in ("hybrid-memory", "tree-memory"):
        # The memory holds the prompts' seeded outputs under other seeds: recalls that are partly right.
        drafter = HybridDrafter(tiny_eagle3_drafter(tiny_model, seed=6), min_match=2)
        if drafter_kind == "tree-memory":
            policy = FixedTree(4, 2, 6)
        engine = LLMEngine(tiny_model, EngineConfig(max_batch=8, max_seq_len=256, max_tokens_per_step=64,
                                                    speculation_memory_mb=1), drafter=drafter, policy=policy)
        other = [SamplingParams(**{**p.__dict__, "seed": p.seed + 1}) for p in SEEDED]
        engine.generate(prompts, other)
        seqs = engine.generate(prompts, SEEDED)
        assert [s.output_ids for s in seqs] == plain_seeded
        assert drafter.recalled > 0
        return
    elif drafter_kind == "tree-oracle":
        drafter, policy = ScriptedTreeDrafter(ids, VOCAB, corrupt_every=4), FixedTree(4, 3, 9)
    else:
        drafter, policy = tiny_eagle3_drafter(tiny_model, seed=3), FixedTree(3, 4, 10)
    seqs = _engine(tiny_model, drafter, policy).generate(prompts, SEEDED)
    assert [s.output_ids for s in seqs] == plain_seeded
    assert sum(s.draft_tokens for s in seqs) > 0
    if "oracle" in drafter_kind:  # guesses of the target's own draws are accepted
        assert sum(s.accepted_tokens for s in seqs) > sum(s.verify_steps for s in seqs)  # > 1 a step


def test_a_seeded_request_is_the_same_alone_and_under_load(tiny_model, prompts, plain_seeded):
    """Beside other requests (sampled unseeded, greedy, other seeds) joining at other steps."""
    engine = _engine(tiny_model, HybridDrafter(tiny_eagle3_drafter(tiny_model, seed=4, max_batch=16), min_match=2),
                     FixedGamma(3), max_batch=16)
    load = [engine.add_request(f"load-{i}", repetitive_prompts(8, VOCAB, seed=9)[i],
                               SamplingParams(max_tokens=30, temperature=1.0 if i % 2 else 0.0, ignore_eos=True))
            for i in range(8)]
    engine.step()
    engine.step()
    mine = [engine.add_request(f"mine-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, SEEDED, strict=True))]
    while engine.has_work():
        engine.step()
    assert all(s.finish_reason is not None for s in load)
    assert [s.output_ids for s in mine] == plain_seeded


def test_logits_processing_keeps_seeded_tokens(tiny_model, prompts):
    """Penalties and logit_bias change each verification row as plain decoding's: same draws."""
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=i, presence_penalty=0.8, frequency_penalty=0.5,
                             logit_bias=((5, 3.0), (9, -50.0)), ignore_eos=True) for i in range(4)]
    plain = [s.output_ids for s in _engine(tiny_model).generate(prompts, params)]
    spec = _engine(tiny_model, NgramDrafter(), FixedGamma(4)).generate(prompts, params)
    assert [s.output_ids for s in spec] == plain
    assert all(9 not in out for out in plain)


def test_unseeded_requests_differ_and_rejection_sampling_stays_available(tiny_model, prompts):
    params = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    for scheme in SamplingScheme:
        engine = LLMEngine(tiny_model, EngineConfig(max_batch=8, max_seq_len=256, unseeded_sampling=scheme),
                           drafter=NgramDrafter(), policy=FixedGamma(2))
        outs = [s.output_ids for s in engine.generate([prompts[0]] * 4, params)]
        assert len({tuple(o) for o in outs}) > 1  # each unseeded request draws its own tokens

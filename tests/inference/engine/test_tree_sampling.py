"""Tree sampling (multi-branch rejection sampling, tide.engine.sampling.verify_tree_sampling) emits
tokens distributed exactly as the target's own sampling.

Same method as test_lossless_sampling: chi-square goodness of fit at ALPHA = 1e-3 against the
exact distribution, fixed seeds. A verifier that accepted a child with p(x) without renormalising
after a rejection, or sampled the residual from p itself, fails by a wide margin.
"""

from __future__ import annotations

import pytest
import torch
from support.engine import (
    ScriptedDrafter,
    chi_square_p_value,
    exact_first_two,
    sample_many,
    target_last_probs,
    tiny_eagle3_drafter,
)

from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.sampling import SamplingScheme, verify_tree_sampling
from tide.engine.sequence import SamplingParams
from tide.engine.tree import DraftTree
from tide.policies import FixedTree

ALPHA = 1e-3  # as in test_lossless_sampling

# root; children 3, 0, 7 (node 1..3); under 3: 1, 4 (4, 5); under 7: 2 (6); under 4: 5 (7)
TREE = DraftTree(tokens=(9, 3, 0, 7, 1, 4, 2, 5), parents=(-1, 0, 0, 0, 1, 1, 3, 5))


def test_tree_verifier_first_and_second_tokens_follow_p():
    g = torch.Generator().manual_seed(0)
    V, trials = 10, 30000
    logits = torch.randn(len(TREE.tokens), V, generator=g) * 1.5
    logits[0, [TREE.tokens[c] for c in TREE.children[0]]] = 1.0  # each first-level child emitted often
    probs = torch.softmax(logits, -1)
    first = torch.zeros(V)
    second = {c: torch.zeros(V) for c in TREE.children[0]}  # given the first token is a child's
    for _ in range(trials):
        path, nxt = verify_tree_sampling(probs, TREE, g)
        emitted = [TREE.tokens[n] for n in path[1:]] + [nxt]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[path[1]][emitted[1]] += 1
    assert chi_square_p_value(first, probs[0]) > ALPHA
    for child, counts in second.items():
        # A child's token emitted first: the next token is the target's given it, i.e. row `child`.
        assert counts.sum() > 500
        assert chi_square_p_value(counts, probs[child]) > ALPHA


def test_a_certain_child_is_accepted_after_impossible_ones():
    V = 10
    probs = torch.full((len(TREE.tokens), V), 0.0)
    probs[:, 6] = 1.0  # the target is sure of a token no child carries
    probs[0] = 0.0
    probs[0, 7] = 1.0  # at the root: the third child's token
    for seed in range(20):
        # root: children 3 and 0 have p = 0 (rejected), 7 has p = 1 after them; node 3's only
        # child (token 2) has p = 0, and the residual there is all on 6.
        assert verify_tree_sampling(probs, TREE, torch.Generator().manual_seed(seed)) == ([0, 3], 6)


class _OracleTreeDrafter(ScriptedDrafter):
    """Trees of the target's own most likely next tokens (from its exact sampling distribution),
    the least likely child first: the root gets the shape's `topk` most likely, its most likely
    child the 2 most likely after it. A verifier that mis-weights later siblings (accepting c_i with p(c_i)
    instead of p(c_i) / (1 - the mass of the rejected ones), or sampling the residual without
    zeroing them) mis-weights exactly the likely tokens, by a wide margin."""

    def __init__(self, model, params: SamplingParams) -> None:
        super().__init__({}, model.cfg.vocab_size)
        self.model, self.params = model, params
        self._memo: dict[tuple, list[int]] = {}  # 1000 requests of one prompt share their contexts

    def _likely(self, ids: list[int], k: int) -> list[int]:
        key = (*ids, k)
        if key not in self._memo:
            self._memo[key] = torch.topk(target_last_probs(self.model, ids, self.params), k).indices.flip(0).tolist()
        return self._memo[key]

    def propose_tree(self, seqs, shapes, features=None, generators=None) -> list[DraftTree]:
        trees = []
        for seq, shape in zip(seqs, shapes, strict=True):
            k = shape.topk
            kids = self._likely(seq.token_ids, k)
            grand = self._likely(seq.token_ids + [kids[-1]], 2)
            trees.append(DraftTree((seq.token_ids[-1], *kids, *grand), (-1, *[0] * k, k, k)))
        return trees


@pytest.mark.parametrize("drafter_kind,params", [
    ("eagle3", SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)),
    ("eagle3", SamplingParams(max_tokens=3, temperature=1.3, top_p=0.9, ignore_eos=True)),
    # Peaked enough (the tiny target is nearly flat at temperature 1) that mis-weighting the likely
    # tokens shows: at 0.5 the 8 children hold about half of the mass.
    ("oracle", SamplingParams(max_tokens=3, temperature=0.5, ignore_eos=True)),
    ("oracle", SamplingParams(max_tokens=3, temperature=0.6, top_k=20, ignore_eos=True)),
])
@pytest.mark.parametrize("scheme", list(SamplingScheme))
def test_engine_tree_sampling_matches_target_distribution(tiny_model, drafter_kind, params, scheme):
    prompt = list(range(3, tiny_model.cfg.vocab_size)) + [5, 17, 5]
    p1, p2 = exact_first_two(tiny_model, prompt, params)
    if drafter_kind == "eagle3":
        drafter = tiny_eagle3_drafter(tiny_model, max_batch=64)
    else:
        drafter = _OracleTreeDrafter(tiny_model, params)
    engine = LLMEngine(tiny_model, EngineConfig(max_batch=64, max_seq_len=128, unseeded_sampling=scheme),
                       drafter=drafter, policy=FixedTree(2, 8, 10))
    seqs = sample_many(engine, prompt, params)
    assert sum(s.draft_tokens for s in seqs) > 0
    assert sum(s.accepted_tokens for s in seqs) > 0
    first = torch.bincount(torch.tensor([s.output_ids[0] for s in seqs]), minlength=p1.numel())
    second = torch.bincount(torch.tensor([s.output_ids[1] for s in seqs]), minlength=p1.numel())
    assert chi_square_p_value(first, p1) > ALPHA
    assert chi_square_p_value(second, p2) > ALPHA

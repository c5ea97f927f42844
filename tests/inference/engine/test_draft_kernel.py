"""The EAGLE-3 drafter's one-call draft step (tide.kernels' draft_layer) computes what the draft's
torch ops compute: extend rows, chain steps and tree steps with their masks, and the cache rows
they write. Not bit for bit (its attention sums in float32 over a float32 cache): a draft's numerics
only decide what is proposed, and verification against the target keeps the output exact. With
int8 projections (the served default where the int8 kernel takes them) the same, within int8's
rounding of the weights."""

from __future__ import annotations

import copy

import pytest
import torch

from tide import kernels
from tide.eagle3.testing import TINY_TARGET, make_draft
from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.features import FeatureStore
from tide.engine.sequence import SamplingParams, Sequence
from tide.policies import TreeShape

ops = kernels.ops()
pytestmark = pytest.mark.skipif(ops is None or not ops.has_bf16_gemm or not ops.has_decode_attention,
                                reason="tide.kernels' bf16 GEMM and attention are not built here")

H, V = TINY_TARGET["hidden_size"], TINY_TARGET["vocab_size"]


@pytest.fixture(scope="module", params=["float", "int8"])
def drafters(request) -> tuple[Eagle3Drafter, Eagle3Drafter]:
    """(the drafter on the kernels, bf16 or int8 projections; the same draft on torch ops, bf16).
    A draft vocabulary of 48: every projection's shape fits the int8 kernel's packing."""
    draft, _ = make_draft(seed=3, draft_vocab_size=48)
    draft = draft.to(torch.bfloat16)
    fused = Eagle3Drafter(copy.deepcopy(draft), "fused", 4, 64, weights=request.param)
    with kernels.disabled():
        plain = Eagle3Drafter(copy.deepcopy(draft), "torch", 4, 64, weights="float")
    assert fused._fused is not None and fused.k.dtype == torch.float32
    assert fused.draft.serving.qkv.kind == ("bf16-kernel" if request.param == "float" else "int8-kernel")
    assert plain._fused is None and plain.k.dtype == torch.bfloat16
    return fused, plain


def _both(drafters, call):
    fused, plain = drafters
    with torch.inference_mode():
        a = call(fused)
        with kernels.disabled():
            b = call(plain)
    return a, b


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    # bf16 outputs of O(1) values; the two paths round attention and RoPE differently.
    torch.testing.assert_close(a.float(), b.float(), atol=0.06, rtol=0.03)


def test_extend_chain_and_tree_steps_match_the_torch_ops(drafters):
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([0, 2])
    # extend: 6 rows at positions 0..5 of two sequences
    ids = torch.randint(0, V, (2, 6), generator=g)
    hidden = torch.randn(2, 6, H, generator=g).to(torch.bfloat16)
    pos = torch.arange(6).expand(2, 6)
    a, b = _both(drafters, lambda d: d._step(ids, hidden, pos, slots))
    _close(a, b)
    fused, plain = drafters
    _close(fused.k[slots, :, :6], plain.k[slots, :, :6])
    _close(fused.v[slots, :, :6], plain.v[slots, :, :6])
    # a chain step at position 6
    step_ids = torch.randint(0, V, (2, 1), generator=g)
    a, b = _both(drafters, lambda d: d._step(step_ids, a[:, -1:].clone(), torch.full((2, 1), 6), slots))
    _close(a, b)
    # a tree level: 3 frontier nodes at position 7, cache rows 8..10, each seeing the committed
    # rows 0..6 and its own row only (not its siblings')
    tree_ids = torch.randint(0, V, (2, 3), generator=g)
    f_hidden = torch.randn(2, 3, H, generator=g).to(torch.bfloat16)
    rows = torch.tensor([8, 9, 10]).expand(2, 3)
    visible = torch.arange(11)[None, None, :] < 7
    visible = visible.expand(2, 3, 11).clone().scatter_(-1, rows[..., None], True)
    a, b = _both(drafters, lambda d: d._step(tree_ids, f_hidden, torch.full((2, 3), 7), slots, rows, visible))
    _close(a, b)
    # a node that sees its siblings' rows computes something else: the mask is applied
    sees_all = torch.ones_like(visible)
    c, _ = _both(drafters, lambda d: d._step(tree_ids, f_hidden, torch.full((2, 3), 7), slots, rows, sees_all))
    assert not torch.allclose(c.float(), a.float(), atol=0.06, rtol=0.03)


def test_proposals_follow_the_same_draft_distributions(drafters):
    """Chains and trees proposed on the kernels come from the distributions the torch path computes:
    the extend's logits agree, and each path's first draft token is the other's argmax up to
    rounding (this random draft's top two logits are ~0.04 apart, so neither path's exact argmax is
    asserted: another CPU's kernels round otherwise)."""
    g = torch.Generator().manual_seed(1)
    store = FeatureStore(4, 64, 3 * H, torch.bfloat16, torch.device("cpu"))
    store.rows[:, :20] = torch.randn((4, 20, 3 * H), generator=g).to(torch.bfloat16)
    tokens = torch.randint(3, V, (21,), generator=g).tolist()

    def propose(d: Eagle3Drafter):
        seq = Sequence(f"r-{d.version}", tokens, 5, SamplingParams())
        seq.slot, seq.num_cached = 1, 20
        d.add_sequence(seq)
        last, _, _ = d._extend([seq], store)
        logits = d.draft.logits(last).float()[0]  # [Vd]: the first draft token's distribution
        d._consumed[seq.request_id] = 0
        chain = d.propose([seq], [4], store, [None]).tokens[0]
        d._consumed[seq.request_id] = 12  # as after a rejection: extend 8 rows again
        tree = d.propose_tree([seq], [TreeShape(3, 2, 5)], store, [None])[0]
        d.remove_sequence(seq)
        return logits, chain, tree

    (logits_a, chain_a, tree_a), (logits_b, chain_b, tree_b) = _both(drafters, propose)
    torch.testing.assert_close(logits_a, logits_b, atol=0.1, rtol=0.05)
    assert len(chain_a) == len(chain_b) == 4 and tree_a.size == tree_b.size == 5
    to_draft = drafters[0].draft.target_to_draft()
    for first, other in ((chain_a[0], logits_b), (chain_b[0], logits_a), (tree_a.tokens[1], logits_b)):
        assert other[to_draft[first]] >= other.max() - 0.1

"""TTT objective and attention: shapes, masks, and equivalence with step-by-step drafting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.trainer.training.data import collate, load_dataset
from services.trainer.training.head import TargetHead
from services.trainer.training.objective import Eagle3Objective, TTTAttention, shift
from services.trainer.training.run import build_draft


@pytest.fixture(scope="module")
def setup(wide_target, wide_chunks):
    head = TargetHead.load(wide_target)
    data = load_dataset(wide_chunks, head, max_len=64)
    draft = build_draft(head, data, draft_vocab_size=200, seed=3)
    with torch.no_grad():  # move the layer off its init so that attention patterns matter
        for p in draft.midlayer.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return head, data, draft


@pytest.mark.parametrize("steps", [1, 3, 4])
def test_objective_shapes_and_counts(setup, steps):
    head, data, draft = setup
    batch = collate(data.pieces, [[0, 1], [2]])
    targets = torch.arange(draft.cfg.draft_vocab_size) + draft.d2t
    loss, stats = Eagle3Objective(draft, head.lm_head[targets], ttt_steps=steps)(batch)
    assert loss.dim() == 0 and loss.requires_grad and torch.isfinite(loss)
    assert stats.shape == (steps, 3)
    counted = stats[:, 2]
    # step k needs row r+1+k in the same piece: each step counts one row fewer per piece
    pieces = [data.pieces[i] for i in (0, 1, 2)]
    for k in range(steps):
        want = sum(int(((p.positions > 0) & torch.roll(p.loss_mask, -(1 + k)))[: len(p) - 1 - k].sum())
                   for p in pieces)
        assert int(counted[k]) == want
    assert (stats[:, 1] <= counted).all()


def test_a_shorter_unroll_is_the_objective_of_that_many_steps(setup):
    head, data, draft = setup
    batch = collate(data.pieces, [[0, 1], [2]])
    targets = torch.arange(draft.cfg.draft_vocab_size) + draft.d2t
    loss, stats = Eagle3Objective(draft, head.lm_head[targets], ttt_steps=3)(batch, unroll=2)
    loss2, stats2 = Eagle3Objective(draft, head.lm_head[targets], ttt_steps=2)(batch)
    assert torch.allclose(loss, loss2) and torch.equal(stats[:2], stats2)
    assert stats.shape == (3, 3) and not stats[2].any()  # the step not unrolled: nothing counted


def test_the_draft_sees_prompt_tokens_it_does_not_learn(setup):
    """The loss mask decides which rows are learnt, not what the draft sees: prompt rows (loss
    mask 0) are context every later row attends to, built from their real tokens as the engine's
    drafter builds them. Changing an early prompt token must change the loss at generated rows."""
    head, data, draft = setup
    piece = data.pieces[0]
    assert int(piece.positions[0]) == 0 and not piece.loss_mask[:3].any()  # rows 0-2 are prompt rows
    targets = torch.arange(draft.cfg.draft_vocab_size) + draft.d2t
    objective = Eagle3Objective(draft, head.lm_head[targets], ttt_steps=1)
    batch = collate(data.pieces, [[0]])
    other = collate(data.pieces, [[0]])
    other.input_ids[0, 2] = (other.input_ids[0, 2] + 1) % head.vocab_size  # x_2: row 1's step-0 token
    with torch.no_grad():
        (loss, stats), (loss_other, stats_other) = objective(batch), objective(other)
    assert torch.equal(stats[:, 2], stats_other[:, 2])  # the same rows are learnt
    assert not torch.allclose(loss, loss_other)  # ... from a context that holds the prompt


def dense_loss(objective, batch):
    """The objective written out over every row, masked afterwards (what the trainer computes on
    learnt rows only): per step, soft cross-entropy against softmax(lm_head(final_{r+1+k})) at rows
    r whose row r+1+k is a generated row of the same piece and whose greedy token is in vocabulary."""
    draft, seg, pos = objective.draft, batch.seg, batch.positions
    p_all = torch.softmax(batch.final.float() @ objective.target_rows.T, dim=-1)
    attend = TTTAttention(seg, objective.mask)
    hidden, total, hits = draft.project(batch.aux), 0.0, []
    for k in range(objective.ttt_steps):
        inside = (shift(seg, 1 + k, -1) == seg) & (seg >= 0)
        ahead = inside & (seg >= 0) & (pos > 0) & shift(batch.loss_mask, 1 + k, False)
        greedy = shift(batch.greedy, 1 + k)
        learn = ahead & draft.t2d[greedy]
        hidden = draft.step(shift(batch.input_ids, 1 + k) * inside, hidden, pos + k, attend)
        logq = F.log_softmax(draft.logits(hidden).float(), dim=-1)
        ce = -(shift(p_all, 1 + k) * logq).sum(-1)
        total = total + objective.step_decay**k * (ce * learn).sum() / learn.sum().clamp(min=1)
        hits.append(int(((draft.to_target_ids(logq.argmax(-1)) == greedy) & ahead).sum()))
    return total, hits


def test_scoring_learnt_rows_only_equals_the_masked_dense_objective(setup):
    """Pieces of uneven length with padding: the loss, its gradient and the hit counts are those of
    the objective computed at every row and masked."""
    head, data, draft = setup
    targets = torch.arange(draft.cfg.draft_vocab_size) + draft.d2t
    objective = Eagle3Objective(draft, head.lm_head[targets], ttt_steps=3)
    batch = collate(data.pieces, [[0, 1], [2], [3, 4]])
    assert (batch.seg < 0).any() and not batch.loss_mask.all()  # padding and prompt rows are present
    loss, stats = objective(batch)
    grad = torch.autograd.grad(loss, draft.lm_head.weight)[0]
    want, want_hits = dense_loss(objective, batch)
    want_grad = torch.autograd.grad(want, draft.lm_head.weight)[0]
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-4)
    assert stats[:, 1].long().tolist() == want_hits


def test_attention_masks_never_cross_pieces():
    seg = torch.tensor([[0, 0, 0, 1, 1, -1]])
    att = TTTAttention(seg, "inference")
    assert att.causal[0].int().tolist() == [
        [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]


def chain(draft, piece, r: int, steps: int, mask: str, base_k, base_v) -> list[torch.Tensor]:
    """Draft `steps` tokens from start row r, one step() per token, data tokens as inputs, with an
    explicit cache: the step-0 keys of rows 0..r (SpecForge at step k: 0..r-k) + the chain's own."""
    own_k, own_v = [], []
    outs, hid = [], None

    def attend(q, k, v):
        step = len(outs)
        if step == 0:  # step 0 is row r of the base pass itself
            return F.scaled_dot_product_attention(q, base_k[:, :, :r + 1], base_v[:, :, :r + 1], enable_gqa=True)
        own_k.append(k)
        own_v.append(v)
        visible = r + 1 if mask == "inference" else max(r - step + 1, 0)
        ks = torch.cat([base_k[:, :, :visible], *own_k], 2)
        vs = torch.cat([base_v[:, :, :visible], *own_v], 2)
        return F.scaled_dot_product_attention(q, ks, vs, enable_gqa=True)

    hid = draft.project(piece.aux[None, r:r + 1])
    for k in range(steps):
        tok = piece.input_ids[None, r + 1 + k:r + 2 + k]
        hid = draft.step(tok, hid, piece.positions[None, r:r + 1] + k, attend)
        outs.append(hid[0, 0])
    return outs


@pytest.mark.parametrize("mask", ["inference", "specforge"])
def test_ttt_equals_drafting_step_by_step_with_a_kv_cache(setup, mask):
    """TTT step k at row r == running the draft token by token from row r with a KV cache."""
    _, data, draft = setup
    piece = data.pieces[0]
    batch = collate(data.pieces, [[0]])
    K, n = 3, len(piece)
    att = TTTAttention(batch.seg, mask)
    with torch.no_grad():
        hidden = draft.project(batch.aux)
        ttt_out = []
        for k in range(K):
            hidden = draft.step(shift(batch.input_ids, 1 + k), hidden, batch.positions + k, att)
            ttt_out.append(hidden[0])
        base_k, base_v = att.keys[0][:, ::2], att.values[0][:, ::2]  # undo the GQA repeat (2 groups)
        for r in (0, 3, 10, n - 1 - K):
            for k, out in enumerate(chain(draft, piece, r, K, mask, base_k, base_v)):
                torch.testing.assert_close(out, ttt_out[k][r], atol=2e-5, rtol=1e-4)

"""The EAGLE-3 objective: soft targets from the target's logits, training-time-test (TTT) unrolling.

Position alignment (EAGLE): row r of a piece holds the target's state after token x_r; step 0
feeds the draft fc(aux_r) together with the embedding of token x_{r+1} at position p_r, and
trains it to predict token x_{r+2}, whose target distribution is softmax(lm_head(final_{r+1})).
TTT step k feeds back the draft's own output of step k-1 at the same row with token x_{r+1+k} at
position p_r + k, and predicts x_{r+2+k} against softmax(lm_head(final_{r+1+k})). Rows whose
target row r+1+k lies outside the piece, has loss_mask 0, or whose greedy token is not in the draft
vocabulary (SpecForge's position mask) do not count; rows at position 0 never do (the target's
state there carries one huge activation, RMS ~445 vs ~20 elsewhere, that fc cannot use).

Attention at step k (`TTTAttention`): every row attends to the step-0 keys of its own piece
causally, plus to its own keys of steps 1..k (the "diagonal" entries, EAGLE-3's Figure 6). With
`mask="specforge"` the step-0 keys r-k+1..r are hidden at step k, as in SpecForge's and EAGLE's
training code; with `mask="inference"` they stay visible, which is what chain drafting does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tide.eagle3 import Eagle3Draft

# SpecForge weighs TTT step k's loss by 0.8**k: later steps matter less (they only count when all
# earlier ones were accepted) and are noisier.
STEP_DECAY = 0.8


class TTTAttention:
    """The `attend` callable for unrolled draft steps over packed rows (see module docstring).

    seg [B, L]: piece id per column, -1 on padding. Each call is one step; the first call's k/v
    are the step-0 ("base") keys, later calls add one diagonal key per row.
    """

    def __init__(self, seg: torch.Tensor, mask: str = "specforge") -> None:
        if mask not in ("specforge", "inference"):
            raise ValueError(f"mask must be 'specforge' or 'inference', not {mask!r}")
        L = seg.shape[1]
        idx = torch.arange(L, device=seg.device)
        same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
        self.causal = same & (idx[None, :] <= idx[:, None])  # [B, L(query), L(key)]
        self.causal |= torch.eye(L, dtype=torch.bool, device=seg.device)  # padding rows see themselves
        self.lag = idx[:, None] - idx[None, :]  # query - key
        self.shift = mask == "specforge"
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        self.keys.append(k.repeat_interleave(groups, 1).float())
        self.values.append(v.repeat_interleave(groups, 1).float())
        step = len(self.keys) - 1
        qf = q.float()
        scale = 1.0 / math.sqrt(q.shape[-1])
        allowed = self.causal if not (self.shift and step) else self.causal & (self.lag >= step)
        base = (qf @ self.keys[0].transpose(-1, -2)) * scale  # [B, nH, L, L]
        base = base.masked_fill(~allowed[:, None], float("-inf"))
        diag = [(qf * km).sum(-1, keepdim=True) * scale for km in self.keys[1:]]  # [B, nH, L, 1] each
        probs = torch.softmax(torch.cat([base, *diag], dim=-1), dim=-1)
        L = base.shape[-1]
        out = probs[..., :L] @ self.values[0]
        for m, vm in enumerate(self.values[1:]):
            out = out + probs[..., L + m:L + m + 1] * vm
        return out.to(q.dtype)


def shift(x: torch.Tensor, s: int, fill=0) -> torch.Tensor:
    """x[:, j + s] at column j (dim 1), `fill` past the end."""
    pad = torch.full((x.shape[0], s, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, s:], pad], dim=1)


class Eagle3Objective(nn.Module):
    """forward(batch, unroll=K) -> (loss, stats [K, 3] = per step: loss, correct, counted; zero rows
    past `unroll`, the steps unrolled in this call); one module so that DDP sees a single forward.
    `target_rows` [Vd, T]: the target's lm_head rows of the draft vocab; `logit_softcap`: the
    target's final logit soft-cap (Gemma 2), applied before its softmax. With `aux_scale`, the
    draft's fc weight must be in training units (training.aux_scale)."""

    def __init__(self, draft: Eagle3Draft, target_rows: torch.Tensor, ttt_steps: int = 3,
                 mask: str = "specforge", step_decay: float = STEP_DECAY, feature_noise: float = 0.0,
                 aux_scale: torch.Tensor | None = None, logit_softcap: float | None = None) -> None:
        super().__init__()
        self.draft = draft
        # the target's logit soft-cap (Gemma 2): its distribution is softmax(cap * tanh(logits / cap))
        self.logit_softcap = logit_softcap
        # [3T] powers of two the aux states are divided by before fc (training.aux_scale); None: as served
        self.register_buffer("aux_scale", aux_scale, persistent=False)
        self.register_buffer("target_rows", target_rows.float(), persistent=False)
        self.ttt_steps = ttt_steps
        self.mask = mask
        self.step_decay = step_decay
        self.feature_noise = feature_noise
        self.noise_rng = torch.Generator()  # the loop seeds it per step: a resumed run draws the same noise

    def forward(self, batch, unroll: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        draft = self.draft
        unroll = self.ttt_steps if unroll is None else unroll
        seg, pos = batch.seg, batch.positions
        with torch.no_grad():
            counted_rows = (seg >= 0) & (pos > 0)
            # The target's distribution is only ever read at rows with loss_mask (the row after a
            # learnt one): label those alone, once for all steps. `slot` maps a flat row to its
            # label; a step-k learner at flat row r reads slot[r + 1 + k] (same piece, same row).
            labelled = ((seg >= 0) & batch.loss_mask).flatten()
            slot = torch.cumsum(labelled, 0) - 1
            final = batch.final.flatten(0, 1)[labelled]
            logits = (final.float() @ self.target_rows.T).float()  # [N, Vd]; autocast: bf16 GEMM
            if self.logit_softcap is not None:
                logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
            p_all = torch.softmax(logits, dim=-1)
        attend = TTTAttention(seg, self.mask)
        aux = batch.aux
        if self.training and self.feature_noise > 0:
            # Gaussian, scaled by the RMS of each row's state in each aux layer (the layers' scales differ)
            parts = aux.float().unflatten(-1, (3, -1))
            noise = torch.randn(parts.shape, generator=self.noise_rng).to(aux.device)
            aux = (parts + self.feature_noise * parts.pow(2).mean(-1, keepdim=True).sqrt() * noise).flatten(-2)
        hidden = draft.project(aux if self.aux_scale is None else aux / self.aux_scale.to(aux.dtype))
        total = hidden.new_zeros(())
        stats = []
        for k in range(unroll):
            with torch.no_grad():
                inside = (shift(seg, 1 + k, -1) == seg) & (seg >= 0)  # row r+1+k is in r's piece
                ahead = inside & counted_rows & shift(batch.loss_mask, 1 + k, False)
                greedy = shift(batch.greedy, 1 + k)
                # Rows whose greedy token the draft vocabulary lacks cannot be hit: they count
                # against the accuracy (in `ahead`) but are neither learnt nor scored.
                rows = (ahead & draft.t2d[greedy]).flatten().nonzero().squeeze(1)
                p = p_all[slot[rows + 1 + k]]
                # token x_{r+1+k} wherever it exists, learnable or not: prompt rows are keys every
                # later row attends to, and the engine's draft builds them from their real tokens
                # (masking them to token 0 here trained the draft on a context it never sees)
                ids = shift(batch.input_ids, 1 + k) * inside
            out = draft.step(ids, hidden, pos + k, attend)
            # the lm_head and the 8192-way softmaxes run on learnt rows only (68.5 % of a bootstrap's
            # rows: prompt rows, padding and piece ends are keys for the others but never scored)
            logq = F.log_softmax(draft.logits(out.flatten(0, 1)[rows]).float(), dim=-1)
            loss_k = -(p * logq).sum() / max(len(rows), 1)
            total = total + self.step_decay**k * loss_k
            with torch.no_grad():
                hit = draft.to_target_ids(logq.argmax(-1)) == greedy.flatten()[rows]
                stats.append(torch.stack([loss_k.detach(), hit.sum().float(), ahead.sum().float()]))
            hidden = out
        stats += [torch.zeros(3, device=total.device)] * (self.ttt_steps - unroll)
        return total, torch.stack(stats)

"""Offline evaluation of a draft on held-out chunks: simulated acceptance length under greedy chain
drafting, per-step accuracies and draft-vocabulary coverage. No target forward is needed.

Chain simulation, for every start row r of a piece (in parallel, exactly what the engine does):
the draft's cache holds its step-0 keys of rows 0..r (computed from the target's states, as after
a verification); draft token 1 comes from (fc(aux_r), x_{r+1}) at position p_r, token j+1 from
(out_j, token j) at p_r + j attending to rows 0..r plus its own chain. Draft token j is judged
against the target's greedy token after the accepted prefix, argmax lm_head(final_{r+j}) of the
stored state: valid while the data itself followed the target's greedy path (true for greedy
serving; with sampled data a chain stops being checkable at the first non-greedy token, which is
counted as the chain's end, so acceptance is then slightly under-estimated). Acceptance length at
γ = 1 + number of leading matches among the first γ draft tokens (the 1 is the bonus token).

`acceptance` averages that over every start row. A serving engine only drafts at the rows its
verifications land on: after accepting a tokens it skips a rows, so easy stretches (long accepts)
get fewer steps than hard ones and its tokens per step is the row-weighted harmonic mean, not the
arithmetic one (with uneven difficulty it is clearly lower). `served` replays that walk on every
piece (from the first row whose next token was generated, the engine's first draft, then jumping
by each step's accepted length + 1) and reports tokens per verification: what the engine measures
at a fixed γ on the same data (greedy), up to the few short-γ steps at the very end of a sequence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from services.trainer.training.data import Dataset, collate, plan_batches
from services.trainer.training.head import TargetHead
from services.trainer.training.objective import Eagle3Objective, TTTAttention, shift
from tide.eagle3 import Eagle3Draft

GAMMAS = (1, 2, 3, 4, 5)


@dataclass
class EvalResult:
    acceptance: dict[int, float]  # γ -> mean acceptance length over all start rows
    chain_accuracy: list[float]  # step j: P(draft token j+1 right | tokens 1..j right)
    ttt_top1: list[float]  # teacher-forced top-1 per TTT step (the training metric)
    ttt_loss: list[float]  # objective per TTT step
    coverage: float  # share of the target's greedy next tokens that the draft vocabulary holds
    chains: int  # start rows simulated
    tokens: int  # rows evaluated
    served: dict[int, float] = field(default_factory=dict)  # γ -> tokens per verification on the engine's walk

    def to_json(self) -> dict:
        d = asdict(self)
        d["acceptance"] = {str(k): v for k, v in self.acceptance.items()}
        d["served"] = {str(k): v for k, v in self.served.items()}
        return d


@torch.no_grad()
def evaluate(draft: Eagle3Draft, data: Dataset, head: TargetHead, gammas=GAMMAS, ttt_steps: int = 3,
             mask: str = "specforge", batch_rows: int = 8, max_len: int = 512) -> EvalResult:
    """See the module docstring. `mask`: the TTT mask of the teacher-forced metric (as trained).
    Runs on the draft's device."""
    if not data.pieces:
        raise ValueError("no evaluation data")
    device = draft.fc.weight.device
    draft.eval()
    G = max(gammas)
    targets = torch.arange(draft.cfg.draft_vocab_size, device=draft.d2t.device) + draft.d2t
    objective = Eagle3Objective(draft, head.lm_head[targets.cpu()].to(device), ttt_steps, mask,
                                logit_softcap=head.logit_softcap)
    accepted = {g: 0.0 for g in gammas}
    judged, right = torch.zeros(G), torch.zeros(G)
    ttt = torch.zeros(ttt_steps, 3)
    chains = covered = counted = tokens = 0
    walk = {g: [0, 0] for g in gammas}  # γ -> [tokens, verifications]
    plan = plan_batches([len(p) for p in data.pieces], batch_rows, max_len, seed=0, epoch=0)
    for rows in plan:
        b = collate(data.pieces, rows).to(device)
        tokens += b.num_tokens
        loss, stats = objective(b)
        ttt += stats.cpu() * torch.tensor([b.num_tokens, 1, 1])  # loss weighted by batch tokens
        rowmask = (b.seg >= 0) & b.loss_mask
        covered += int(draft.t2d[b.greedy][rowmask].sum())
        counted += int(rowmask.sum())
        # start rows: not position 0, all G judged rows inside the piece, first judged row generated
        start = (b.seg >= 0) & (b.positions > 0) & shift(b.loss_mask, 1, False) & (shift(b.seg, G, -1) == b.seg)
        n_start = int(start.sum())
        if n_start == 0:
            continue
        chains += n_start
        attend = TTTAttention(b.seg, "inference")
        hidden = draft.project(b.aux)
        tok = shift(b.input_ids, 1)
        alive = start.clone()  # all previous draft tokens accepted
        run = torch.zeros_like(b.seg)  # accepted tokens so far per chain
        for j in range(G):
            out = draft.step(tok, hidden, b.positions + j, attend)
            guess = draft.to_target_ids(draft.logits(out).argmax(-1))
            want = shift(b.greedy, 1 + j)
            # the stored state at row r+1+j continues the chain only if the data followed it
            checkable = alive if j == 0 else alive & (shift(b.input_ids, 1 + j) == shift(b.greedy, j))
            hit = checkable & (guess == want)
            judged[j] += int(checkable.sum())
            right[j] += int(hit.sum())
            run += hit.long()
            alive = hit
            if j + 1 in accepted:
                accepted[j + 1] += float((run + 1)[start].sum())
                _walk(walk[j + 1], start & b.loss_mask, b.seg, run)
            tok, hidden = guess, out
    w = max(tokens, 1)
    return EvalResult(
        acceptance={g: accepted[g] / max(chains, 1) for g in gammas},
        chain_accuracy=(right / judged.clamp(min=1)).tolist(),
        ttt_top1=(ttt[:, 1] / ttt[:, 2].clamp(min=1)).tolist(),
        ttt_loss=(ttt[:, 0] / w).tolist(),
        coverage=covered / max(counted, 1),
        chains=chains,
        tokens=tokens,
        served={g: t / s if s else 1.0 for g, (t, s) in walk.items()},
    )


def _walk(acc: list[int], start: torch.Tensor, seg: torch.Tensor, run: torch.Tensor) -> None:
    """Add the engine's walk over every piece of a batch to acc = [tokens, verifications]: from a
    piece's first start row (whose own token was generated, so not the one predicting the first
    output token, which the target's prefill emits), jump by run + 1 while on start rows."""
    start, seg, run = start.cpu().tolist(), seg.cpu().tolist(), run.cpu().tolist()
    for srow, grow, rrow in zip(start, seg, run, strict=True):
        c, n = 0, len(srow)
        while c < n:
            if not srow[c]:
                c += 1
                continue
            piece = grow[c]
            while c < n and grow[c] == piece and srow[c]:
                acc[0] += rrow[c] + 1
                acc[1] += 1
                c += rrow[c] + 1
            while c < n and grow[c] == piece:  # the rest of this piece is past the walk's end
                c += 1


def compare(draft_a: Eagle3Draft, draft_b: Eagle3Draft, data: Dataset, head: TargetHead, gamma: int = 3,
            **kwargs) -> dict:
    """Evaluate two drafts on the same data; `b_better` when b's *served* accept length at γ (tokens
    per verification along the engine's walk, what serving achieves) is higher. `acceptance` (the
    all-rows mean) is in the evaluations but decides nothing: it overstates serving."""
    a = evaluate(draft_a, data, head, **kwargs)
    b = evaluate(draft_b, data, head, **kwargs)
    delta = b.served[gamma] - a.served[gamma]
    return {"a": a.to_json(), "b": b.to_json(), "gamma": gamma, "metric": "served", "delta": delta,
            "b_better": delta > 0}

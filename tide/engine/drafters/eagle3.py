"""EAGLE-3 drafter: owns the draft model and its one-layer KV cache.

Alignment (EAGLE): the draft row at position t consumes the target's aux states after token x_t
and the embedding of x_{t+1}, and predicts x_{t+2}. For a sequence whose target cache holds
positions [0, n) and whose last token x_n is pending, a proposal is:

1. extend: rows t in [consumed, n) — the target features the draft has not seen yet (one per
   verified token normally; many after speculation was off or after a hot-swap) — with input ids
   x_{t+1}; the last row predicts d1 = x_{n+1};
2. γ - 1 autoregressive steps at positions n, n+1, ...: hidden = the previous step's output (the
   draft's own stand-in for the target's features), input id = the previous draft token.
Only rows from target features are committed (`consumed` = n); the speculative rows at positions
>= n are overwritten by the next extend, so rejected drafts need no rollback.

Constrained requests (a grammar matcher on the sequence): each draft step's logits are masked to
the tokens the grammar allows after the drafts so far, so drafts follow the grammar; a sampled
request's q is that masked distribution, exactly what its draft was drawn from. A chain stops
where the grammar allows nothing in the draft vocabulary (decided before drawing, so lossless).
The matcher is rolled back to the committed output before returning.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from tide.eagle3 import Eagle3Draft, load_checkpoint
from tide.engine.drafters.base import DraftAlgorithm, Proposal
from tide.engine.features import FeatureStore
from tide.engine.llama import LlamaModel
from tide.engine.sequence import Sequence


class Eagle3Drafter:
    algorithm = DraftAlgorithm.EAGLE3

    def __init__(self, draft: Eagle3Draft, version: str, max_batch: int, max_len: int) -> None:
        self.draft = draft.eval().freeze_for_serving()  # its projections on tide.kernels' GEMM
        self.version = version
        cfg = draft.cfg
        p = draft.fc.weight
        shape = (max_batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.max_len = max_len
        self._consumed: dict[str, int] = {}
        # Draft id -> target id as a plain tensor; target ids for sampled q rows.
        self._d2t_ids = torch.arange(cfg.draft_vocab_size, device=p.device) + draft.d2t
        self._d2t_cpu = self._d2t_ids.cpu()  # indexes grammar masks (built on the CPU)
        self.mask_to_grammar = True  # False: unmasked drafts (benchmarks/features.py measures the gain)

    @classmethod
    def from_checkpoint(cls, path: str | Path, target: LlamaModel, version: str, max_batch: int,
                        max_len: int) -> Eagle3Drafter:
        """Load and check a checkpoint against the serving target (raises DraftIncompatible)."""
        draft = load_checkpoint(path, target.embed, target.cfg, device=target.device, dtype=target.dtype)
        return cls(draft, version, max_batch, max_len)

    # ---- per-sequence lifecycle ----------------------------------------------------------------

    def add_sequence(self, seq: Sequence) -> None:
        self._consumed[seq.request_id] = 0

    def remove_sequence(self, seq: Sequence) -> None:
        self._consumed.pop(seq.request_id, None)

    def lag(self, seq: Sequence) -> int:
        return seq.num_cached - self._consumed.get(seq.request_id, 0)

    # ---- proposing -----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], gammas: list[int], features: FeatureStore | None,
                generators: list[torch.Generator | None]) -> Proposal:
        if features is None:
            raise RuntimeError("EAGLE-3 drafting needs the engine's feature store")
        device = self.k.device
        B = len(seqs)
        starts = [self._consumed[s.request_id] for s in seqs]
        ends = [s.num_cached for s in seqs]
        P = max(e - s for s, e in zip(starts, ends, strict=True))
        width = features.rows.shape[-1]
        aux = torch.zeros((B, P, width), dtype=features.rows.dtype, device=device)
        ids = torch.zeros((B, P), dtype=torch.long)
        pos = torch.empty((B, P), dtype=torch.long)
        for i, seq in enumerate(seqs):
            n = ends[i] - starts[i]
            aux[i, :n] = features.read(seq.slot, starts[i], ends[i])
            ids[i, :n] = torch.tensor(seq.token_ids[starts[i] + 1:ends[i] + 1])
            # Padding rows continue past `end` into the speculative area, which later steps rewrite
            # (clamped to the last cache row, which no committed position ever reaches).
            pos[i] = torch.clamp(torch.arange(starts[i], starts[i] + P), max=self.max_len - 1)
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=device)
        out = self.draft.step(ids.to(device), self.draft.project(aux), pos.to(device),
                              self._attend_fn(slots, pos.to(device)))
        last_rows = torch.tensor([e - s - 1 for s, e in zip(starts, ends, strict=True)], device=device)
        last = out[torch.arange(B, device=device), last_rows]
        for seq, end in zip(seqs, ends, strict=True):
            self._consumed[seq.request_id] = end

        gmax = max(gammas)
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        hidden = last.unsqueeze(1)  # [B, 1, H]
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None] if self.mask_to_grammar else []
        masked = set(constrained)  # only these walk their matcher (and roll it back below)
        stopped = {i for i in constrained if gammas[i] <= 0}  # constrained chains that drafted their last
        try:
            for j in range(gmax):
                logits = self.draft.logits(hidden[:, 0]).float()  # [B, Vd]
                for i in constrained:
                    if i not in stopped and not self._mask_to_grammar(seqs[i], logits[i]):
                        stopped.add(i)
                chosen = self._choose(seqs, logits, generators, probs, stopped)
                for i in range(B):
                    if j < gammas[i] and i not in stopped:
                        tokens[i].append(int(chosen[i]))
                        if i in masked:
                            seqs[i].matcher.accept(int(chosen[i]))  # allowed: drawn from the masked row
                            if j + 1 >= gammas[i]:
                                stopped.add(i)
                if j == gmax - 1 or all(i in stopped or j + 1 >= gammas[i] for i in range(B)):
                    break  # no chain goes on: no more draft forwards
                step_pos = torch.tensor([[e + j] for e in ends], dtype=torch.long, device=device)
                hidden = self.draft.step(chosen.view(B, 1), hidden, step_pos, self._attend_fn(slots, step_pos))
        finally:
            for i in constrained:
                seqs[i].matcher.rollback(len(tokens[i]))
        q_rows = [None if seqs[i].params.greedy or not probs[i] else torch.stack(probs[i][:gammas[i]])
                  for i in range(B)]
        return Proposal(tokens=tokens, probs=q_rows)

    def _mask_to_grammar(self, seq: Sequence, row: torch.Tensor) -> bool:
        """Mask one draft-logits row [Vd] to the tokens the grammar allows next; False (row left
        alone) when none of them is in the draft vocabulary: the chain stops there."""
        allowed = seq.matcher.allowed()[self._d2t_cpu]
        if not bool(allowed.any()):
            return False
        row.masked_fill_(~allowed.to(row.device), float("-inf"))
        return True

    def _choose(self, seqs, logits, generators, probs, skip: set[int]) -> torch.Tensor:
        """Next draft token per sequence (target ids): argmax for greedy requests; sampled from
        q = softmax(logits / T) for sampled ones, whose q (over the target vocab) is recorded.
        Sequences in `skip` (constrained chains that stopped) draw nothing."""
        chosen = self._d2t_ids[logits.argmax(-1)]
        for i, seq in enumerate(seqs):
            if seq.params.greedy or i in skip:
                continue
            # On the CPU, like the target's sampling: the request's generator lives there.
            q = torch.softmax(logits[i].cpu() / seq.params.temperature, dim=-1)
            d = int(torch.multinomial(q, 1, generator=generators[i]))
            chosen[i] = self._d2t_ids[d]
            full = torch.zeros(self.draft.cfg.vocab_size, dtype=torch.float32)
            probs[i].append(full.index_copy_(0, self._d2t_ids.cpu(), q))
        return chosen

    def _attend_fn(self, slots: torch.Tensor, positions: torch.Tensor):
        """attend(q, k, v) over this drafter's cache: write the new k/v rows at `positions`, then
        attend to every cached key at a position <= the query's."""
        kv_len = int(positions.max()) + 1

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.k[slots[:, None], :, positions] = k.transpose(1, 2)
            self.v[slots[:, None], :, positions] = v.transpose(1, 2)
            keys, values = self.k[slots, :, :kv_len], self.v[slots, :, :kv_len]
            mask = torch.arange(kv_len, device=q.device)[None, None, None, :] <= positions[:, None, :, None]
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                  enable_gqa=keys.shape[1] != q.shape[1])
        return attend

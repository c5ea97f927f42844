"""What the trainer takes from the target: its embedding, final norm and lm_head, nothing else.

The trainer never runs (or loads) the target's decoder layers: its signal is in the chunks. The
target's logits at row i are `lm_head(final[i])` (`final` is already post-norm), its distribution
over the token after row i. From them come the greedy next tokens (for masks and evaluation) and
the soft targets of the EAGLE-3 objective, restricted to the draft vocabulary.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from tide.eagle3 import Eagle3Config, Eagle3Draft
from tide.layers import Linear
from tide.precision import resolve_dtype
from tide.target import EMBED_TENSOR, LM_HEAD_TENSOR, NORM_TENSOR, HeadSemantics, TargetFiles, load_head_tensors

# Rows per lm_head matmul when computing greedy tokens: bounds the [rows, V] bf16 logits to
# ~100 MB for a 49k vocabulary.
_ARGMAX_ROWS = 1024
# Greedy tokens are computed as the engine computes them when it serves in its default dtype
# ("auto", tide.precision): where bf16 is native, a bf16 lm_head over the bf16 `final` the chunk
# stores. On a bootstrap's greedy chunks that gives the token the engine generated on every row
# checked (1,221 rows), where a float32 lm_head disagreed on 0.8 % of them (near-ties); and it is
# ~2x cheaper there: the full-vocabulary matmul was 3 of a 30-minute bootstrap's minutes at 650k
# rows in float32. The bf16 head is tide.layers.Linear, the engine's own (tide.kernels' GEMM where
# built, on AVX2 CPUs too: torch's emulated bf16 matmul was 3.7x slower than float32 there). Where
# the engine serves in float32 (no kernels, no native bf16), so does this.
def greedy_dtype() -> torch.dtype:
    """The dtype greedy tokens are computed in (see above); resolved when a head is built, not at
    import: "auto" may have to load (or build) tide.kernels to decide."""
    return resolve_dtype("auto", "cpu")


class GreedyHead:
    """rows -> logits over the full vocabulary, as the engine computes them in `weight.dtype`."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.dtype = weight.dtype
        self._linear = Linear(weight) if weight.dtype == torch.bfloat16 else None
        self._weight = weight

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return self._linear(rows) if self._linear is not None else rows @ self._weight.T


@dataclass
class TargetHead:
    """The target's embedding [V, T], final norm weight [T] and lm_head [V, T] (float32, CPU), as a
    Llama head computes with them (tide.target.load_head_tensors: Gemma's (1 + w) norm folded in,
    tied heads resolved), and the soft-cap its logits take (Gemma 2: cap * tanh(logits / cap); None)."""

    model_id: str
    config: dict  # the target's HF config.json
    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        weight = self.lm_head.to(greedy_dtype())
        self._greedy_head = GreedyHead(weight)

    @classmethod
    def load(cls, target: TargetFiles) -> TargetHead:
        t = load_head_tensors(target, torch.float32)
        return cls(target.model_id, target.config, t[EMBED_TENSOR], t[NORM_TENSOR], t[LM_HEAD_TENSOR],
                   HeadSemantics.of(target.config).logit_softcap)

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.lm_head.shape[1])

    @torch.no_grad()
    def greedy(self, final: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """argmax over the full vocabulary of lm_head(final) [N] long: the target's greedy next tokens.
        With a bool mask `rows` [N], only those rows are computed and the others hold 0 (the
        full-vocabulary matmul is most of the cost of loading training data)."""
        out = torch.zeros(final.shape[0], dtype=torch.long)
        idx = torch.arange(final.shape[0]) if rows is None else rows.nonzero().squeeze(1)
        for a in range(0, idx.shape[0], _ARGMAX_ROWS):
            part = idx[a:a + _ARGMAX_ROWS]
            out[part] = self._greedy_head(final[part].to(self._greedy_head.dtype)).argmax(-1)
        return out


def draft_vocab_from_counts(counts: Counter, draft_vocab_size: int,
                            vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [Vd] int64, t2d [V] bool) keeping the `draft_vocab_size` most frequent target ids.

    Ties break towards the smaller id, so the result is deterministic; when fewer distinct ids were
    seen, the smallest unseen ids fill the rest (as SpecForge does). Kept ids are sorted ascending,
    so draft id i maps to the i-th smallest kept target id.
    """
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    kept = [t for t, _ in ranked[:draft_vocab_size]]
    if len(kept) < draft_vocab_size:
        seen = set(kept)
        kept += [t for t in range(vocab_size) if t not in seen][: draft_vocab_size - len(kept)]
    targets = torch.tensor(sorted(kept), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[targets] = True
    return targets - torch.arange(draft_vocab_size), t2d


def new_draft(head: TargetHead, d2t: torch.Tensor, t2d: torch.Tensor, seed: int,
              torch_dtype: str = "bfloat16") -> Eagle3Draft:
    """A from-scratch draft for the target: random layer (seeded), the given vocabulary, the draft
    lm_head initialised from the target's lm_head rows of the kept tokens and the draft's final
    norm from the target's final norm as a Llama norm multiplies by (Gemma's 1 + w), so that a draft
    state that mimics the target's last hidden state already yields the target's logits (before
    any soft-cap); fp32 parameters for training."""
    cfg = Eagle3Config.for_target(head.config, draft_vocab_size=int(d2t.shape[0]), torch_dtype=torch_dtype)
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
        draft.lm_head.weight.copy_(head.lm_head[torch.arange(cfg.draft_vocab_size) + d2t])
        draft.norm.weight.copy_(head.norm)
    draft.set_embedding(head.embed)
    return draft

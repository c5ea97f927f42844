"""One training job end to end: load the target's head, read chunks, split, build the draft (from
scratch or from a checkpoint), train, evaluate against the starting point, export.

Used by the trainer service, the bootstrap command and `python -m services.trainer.training`
(which also runs under torchrun; only rank 0 evaluates and exports).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from services.trainer.training.aux_scale import layer_exponents, scale_vector, to_model_units
from services.trainer.training.data import Dataset, load_dataset, split
from services.trainer.training.evaluate import GAMMAS, evaluate
from services.trainer.training.export import export_draft
from services.trainer.training.head import TargetHead, draft_vocab_from_counts, new_draft
from services.trainer.training.loop import TrainConfig, train
from tide.eagle3 import Eagle3Draft, load_checkpoint
from tide.target import resolve_target

log = logging.getLogger(__name__)

# Draft vocabulary for from-scratch drafts: measured on the reference target, 8192 tokens cost
# ~1.7 ms per draft step in bf16 on CPU and learned as well as 32000 (~3.6 ms) at small data.
DRAFT_VOCAB = 8192


def token_counts(data: Dataset) -> Counter:
    """Ranking of target ids for the draft vocabulary: first by how often they are the target's
    greedy next token on learnable rows (what the draft must emit), then by input frequency."""
    greedy, inputs = Counter(), Counter()
    for p in data.pieces:
        greedy.update(p.greedy[p.loss_mask].tolist())
        inputs.update(p.input_ids.tolist())
    scale = sum(inputs.values()) + 1  # makes greedy counts dominate, inputs break ties
    return Counter({t: greedy[t] * scale + inputs[t] for t in greedy.keys() | inputs.keys()})


def build_draft(head: TargetHead, data: Dataset, init=None, draft_vocab_size: int = DRAFT_VOCAB,
                seed: int = 0, aux_norm: bool = True) -> Eagle3Draft:
    """Fine-tune start (`init`: a checkpoint directory, vocabulary kept) or a from-scratch draft.

    `aux_norm` (TrainConfig.aux_norm): a from-scratch fc gets its usual random init in training units
    (training.aux_scale), i.e. divided by the per-layer scales here. Kept in model units instead, the
    same init is 4-16x larger in training units on the reference target and learns far slower: served
    accept@3 1.727 against 1.839 after 720 steps on boot19's data
    (docs/results/bootstrap, "Why boot20 fell short of the A/B")."""
    if init is not None:
        return load_checkpoint(init, head.embed, head.config, dtype=torch.float32)
    vd = min(draft_vocab_size, head.vocab_size)
    d2t, t2d = draft_vocab_from_counts(token_counts(data), vd, head.vocab_size)
    draft = new_draft(head, d2t, t2d, seed)
    if aux_norm:
        to_model_units(draft.fc, scale_vector(layer_exponents(data.pieces), draft.cfg.target_hidden_size))
    return draft


def train_draft(target, source, out_dir, init=None, cfg: TrainConfig | None = None,
                draft_vocab_size: int = DRAFT_VOCAB, eval_fraction: float = 0.1,
                expected_target: str | None = None, gammas=GAMMAS) -> dict:
    """Train a draft for `target` (name or path, see tide.target) on the chunks of `source` and
    export it to `out_dir`. Returns the training record's evaluation summary."""
    cfg = cfg or TrainConfig()
    head = TargetHead.load(resolve_target(target))
    data = load_dataset(source, head, cfg.max_len, expected_target=expected_target)
    if data.rejected:
        log.warning("%d chunks rejected: %s", len(data.rejected), data.rejected[:5])
    train_set, eval_set = split(data, eval_fraction, cfg.seed)
    log.info("data: %d chunks, %d tokens (train %d / eval %d tokens)", len(data.chunk_ids), data.num_tokens,
             train_set.num_tokens, eval_set.num_tokens)
    draft = build_draft(head, train_set, init, draft_vocab_size, cfg.seed, cfg.aux_norm)
    ev_kwargs = {"gammas": gammas, "ttt_steps": cfg.ttt_steps, "mask": cfg.ttt_mask, "max_len": cfg.max_len}
    baseline = evaluate(draft, eval_set, head, **ev_kwargs).to_json() if init and eval_set.pieces else None
    result = train(draft, head, train_set, cfg)
    rank = dist.get_rank() if dist.is_initialized() else 0
    summary = {
        "train": {"steps": result.steps, "tokens": result.tokens, "seconds": result.seconds,
                  "tokens_per_s": result.tokens_per_s, "last": result.history[-1] if result.history else None},
        "baseline": baseline,
        "candidate": evaluate(draft, eval_set, head, **ev_kwargs).to_json() if eval_set.pieces else None,
        "rejected_chunks": data.rejected,
        "eval_chunk_ids": eval_set.chunk_ids,
    }
    if rank == 0:
        args = {**dataclasses.asdict(cfg), "target": str(target),
                "source": str(source) if isinstance(source, str | Path) else "<iterable>",
                "init": str(init) if init else None, "draft_vocab_size": draft.cfg.draft_vocab_size,
                "eval_fraction": eval_fraction}
        export_draft(out_dir, draft, args, train_set.chunk_ids, summary, target_model=head.model_id,
                     parent=str(init) if init else None)
    return summary

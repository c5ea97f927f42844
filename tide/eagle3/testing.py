"""Tiny random drafts for tests (here and in the engine's and trainer's tests): no files, no target."""

from __future__ import annotations

import torch

from tide.eagle3.config import Eagle3Config
from tide.eagle3.model import Eagle3Draft, causal_attend

TINY_TARGET = {  # HF config.json of a tiny Llama target: 8 layers -> aux layers (1, 3, 4)
    "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 256,
}
TINY_VD = 40  # draft vocabulary of the tiny draft


def make_draft(dtype: str = "float32", seed: int = 0, target: dict | None = None,
               draft_vocab_size: int = TINY_VD) -> tuple[Eagle3Draft, torch.Tensor]:
    """A random draft for `target` (default TINY_TARGET) with a random sorted vocabulary map, and
    the random target embedding it was given. Norm weights are perturbed away from 1 so that a
    swapped or missing norm changes outputs."""
    target = target or TINY_TARGET
    torch.manual_seed(seed)
    cfg = Eagle3Config.for_target(target, draft_vocab_size=draft_vocab_size, torch_dtype=dtype)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        targets = torch.randperm(cfg.vocab_size)[:draft_vocab_size].sort().values
        draft.d2t.copy_(targets - torch.arange(draft_vocab_size))
        draft.t2d.zero_()
        draft.t2d[targets] = True
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    draft.set_embedding(embed)
    return draft, embed


def run_draft(draft: Eagle3Draft, seed: int = 1, batch: int = 2, length: int = 7) -> torch.Tensor:
    """Float32 logits of one causal pass over random aux states and tokens (fixed by `seed`)."""
    cfg = draft.cfg
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(batch, length, 3 * cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (batch, length), generator=g)
    pos = torch.arange(length).expand(batch, length)
    with torch.no_grad():
        hidden = draft.project(aux)
        return draft.logits(draft.step(ids, hidden, pos, causal_attend)).float()

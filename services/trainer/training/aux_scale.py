"""Per-layer scaling of the target's aux states while training; the exported fc keeps its usual form.

The three aux layers reach one fc at very different scales: RMS 2.8 / 6.2 / 22 on the reference
target's bootstrap data (the residual stream grows with depth). AdamW moves every weight by about
the same step whatever its input's scale, so in output terms fc learns the deep layer's columns
~8x faster than the shallow layer's, and at initialisation the deep layer dominates fc's output.
Training therefore runs fc on the states divided per layer by a power of two near that layer's
RMS: the trained weight is `W * s` and `fc_train(aux / s) == fc(aux)` for the model's `W`. Powers of
two make both conversions exact in floating point, so checkpoints (always in the model's units)
resume bit for bit. A from-scratch fc starts from PyTorch's init in training units (run.build_draft).
Measured on boot19's data, 1,200 steps each (docs/results/bootstrap, "Fixed-step A/Bs on boot19's data"):
held-out served acceptance at γ = 3 1.800 without, 1.912 with (a prototype scaling by the exact RMS;
the powers of two do as well).
"""

from __future__ import annotations

import math

import torch

from services.trainer.training.data import Piece

AUX_LAYERS = 3  # EAGLE-3 concatenates three target layers


def layer_exponents(pieces: list[Piece]) -> list[int]:
    """Per aux layer, round(log2(RMS)) of its states over every row at position > 0 (the target's
    state at position 0 carries one huge activation, RMS ~445: it would set the scale alone)."""
    sq = torch.zeros(AUX_LAYERS, dtype=torch.float64)
    n = 0
    for p in pieces:
        rows = p.aux[p.positions > 0].float()
        sq += rows.unflatten(-1, (AUX_LAYERS, -1)).pow(2).mean(-1).sum(0).double()
        n += rows.shape[0]
    rms = (sq / max(n, 1)).sqrt().tolist()
    return [round(math.log2(r)) if r > 0 else 0 for r in rms]


def scale_vector(exponents: list[int], target_hidden: int) -> torch.Tensor:
    """[3T] float32: 2**exponent for each layer's T columns."""
    return torch.tensor([2.0**e for e in exponents]).repeat_interleave(target_hidden)


@torch.no_grad()
def to_training_units(fc: torch.nn.Linear, scale: torch.Tensor) -> None:
    fc.weight.mul_(scale.to(fc.weight.device))


@torch.no_grad()
def to_model_units(fc: torch.nn.Linear, scale: torch.Tensor) -> None:
    fc.weight.div_(scale.to(fc.weight.device))

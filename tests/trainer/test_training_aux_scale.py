"""Per-layer aux scaling in training: exponents from the data, and the draft always leaves train()
in the model's units (the exported fc reads the raw states, as the engine feeds them)."""

from __future__ import annotations

import pytest
import torch

from services.trainer.training.aux_scale import layer_exponents
from services.trainer.training.data import Piece
from services.trainer.training.loop import TrainConfig, train
from services.trainer.training.objective import Eagle3Objective
from tests.trainer.test_training_loop import FAST, setup


def piece(n: int, rms: tuple[float, float, float], t: int = 16, seed: int = 0) -> Piece:
    g = torch.Generator().manual_seed(seed)
    aux = torch.cat([r * torch.randn(n, t, generator=g) for r in rms], dim=1)
    aux[0] = 500.0  # the target's state at position 0: one huge activation
    return Piece("c", torch.zeros(n, dtype=torch.long), torch.arange(n), torch.ones(n, dtype=torch.bool),
                 aux.bfloat16(), torch.zeros(n, t).bfloat16(), torch.zeros(n, dtype=torch.long))


def test_exponents_follow_each_layers_rms_and_ignore_position_zero():
    pieces = [piece(400, (3.0, 6.0, 20.0), seed=s) for s in range(3)]
    assert layer_exponents(pieces) == [2, 3, 4]  # log2 of 3, 6, 20 = 1.6, 2.6, 4.3
    assert layer_exponents([piece(400, (0.05, 1.0, 1.0))]) == [-4, 0, 0]


def history_losses(result) -> list[float]:
    return [h["loss"] for h in result.history]


def test_scaling_changes_how_fc_learns_not_what_the_draft_computes(wide_target, wide_chunks):
    # lr 0: no step moves a weight, so both runs see the same draft; the scaled fc (W * 2**e on
    # states / 2**e) must compute exactly what the unscaled one does, and hand the draft back unscaled
    runs = {}
    for aux_norm in (False, True):
        head, train_set, _, draft = setup(wide_target, wide_chunks)
        start = draft.fc.weight.detach().clone()
        result = train(draft, head, train_set, TrainConfig(steps=4, aux_norm=aux_norm, **{**FAST, "lr": 0.0}))
        assert torch.equal(draft.fc.weight, start)
        runs[aux_norm] = history_losses(result)
    assert runs[True] == runs[False]
    # with learning, the two differ: the scaling is in effect
    learnt = {}
    for aux_norm in (False, True):
        head, train_set, _, draft = setup(wide_target, wide_chunks)
        train(draft, head, train_set, TrainConfig(steps=4, aux_norm=aux_norm, **FAST))
        learnt[aux_norm] = draft.fc.weight.detach().clone()
    assert not torch.allclose(learnt[True], learnt[False])


def test_a_failed_step_leaves_the_draft_in_model_units(wide_target, wide_chunks, monkeypatch):
    head, train_set, _, draft = setup(wide_target, wide_chunks)
    start = draft.fc.weight.detach().clone()
    real, calls = Eagle3Objective.forward, []

    def fails_third(self, batch, unroll=None):  # a step that raises (e.g. out of memory): a fault made on demand
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real(self, batch, unroll)

    monkeypatch.setattr(Eagle3Objective, "forward", fails_third)
    with pytest.raises(RuntimeError, match="injected"):
        train(draft, head, train_set, TrainConfig(steps=5, **{**FAST, "lr": 0.0}))
    assert torch.equal(draft.fc.weight, start)


@pytest.mark.parametrize("aux_norm", [False, True])
def test_a_from_scratch_fc_starts_from_the_usual_init_in_training_units(wide_target, wide_chunks, aux_norm):
    from services.trainer.training.aux_scale import scale_vector
    from services.trainer.training.run import build_draft

    head, train_set, _, _ = setup(wide_target, wide_chunks)
    draft = build_draft(head, train_set, draft_vocab_size=200, aux_norm=aux_norm)
    scale = scale_vector(layer_exponents(train_set.pieces), draft.cfg.target_hidden_size)
    assert not torch.equal(scale, torch.ones_like(scale))  # the tiny target's states are not at unit RMS
    trained = draft.fc.weight * scale if aux_norm else draft.fc.weight  # what the optimizer starts from
    bound = draft.fc.in_features ** -0.5  # PyTorch's Linear init: uniform in +-1/sqrt(fan_in)
    assert bound * 0.95 < trained.abs().max() <= bound

"""Training loop: learning, acceptance on repetitive data, determinism, resume, schedule."""

from __future__ import annotations

import pytest
import torch

from services.trainer.training import loop
from services.trainer.training.data import load_dataset, split
from services.trainer.training.evaluate import compare, evaluate
from services.trainer.training.head import TargetHead
from services.trainer.training.loop import TrainConfig, lr_at, train, unroll_at, unroll_cost
from services.trainer.training.run import build_draft

FAST = {"batch_rows": 4, "max_len": 64, "lr": 3e-3, "warmup_steps": 5, "log_every": 5, "progress": False}


def setup(target, chunks, vocab: int = 200, seed: int = 0):
    head = TargetHead.load(target)
    data = load_dataset(chunks, head, max_len=64)
    train_set, eval_set = split(data, 0.25, seed=0)
    return head, train_set, eval_set, build_draft(head, train_set, draft_vocab_size=vocab, seed=seed)


def params(draft) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in draft.state_dict().items()}


def test_loss_decreases(wide_target, wide_chunks):
    head, train_set, _, draft = setup(wide_target, wide_chunks)
    result = train(draft, head, train_set, TrainConfig(steps=30, schedule="constant", **FAST))
    first, last = result.history[0], result.history[-1]
    assert sum(last["step_loss"]) < sum(first["step_loss"]) - 0.05
    assert last["step_acc"][0] > first["step_acc"][0]
    assert result.steps == 30 and result.tokens > 0 and result.tokens_per_s > 0


def test_repetitive_data_reaches_high_acceptance(copy_target, copy_chunks):
    head, train_set, eval_set, draft = setup(copy_target, copy_chunks, vocab=64)
    before = evaluate(draft, eval_set, head, max_len=64)
    train(draft, head, train_set, TrainConfig(steps=40, **FAST))
    after = evaluate(draft, eval_set, head, max_len=64)
    assert before.acceptance[3] < 1.5
    assert after.acceptance[3] > 3.5, after  # at most 4 = 3 drafted + bonus
    assert after.acceptance[1] <= after.acceptance[3] <= after.acceptance[5]
    assert after.coverage == 1.0 and after.chains > 100
    assert min(after.chain_accuracy) > 0.85 and min(after.ttt_top1) > 0.85
    verdict = compare(before_draft(head, train_set), draft, eval_set, head)
    assert verdict["b_better"] and verdict["delta"] > 2.0


def before_draft(head, train_set):
    return build_draft(head, train_set, draft_vocab_size=64, seed=0)


def test_a_step_budget_is_capped_at_max_epochs_passes(wide_target, wide_chunks):
    head, train_set, _, draft = setup(wide_target, wide_chunks)
    two_passes = train(draft, head, train_set, TrainConfig(epochs=2, **FAST)).steps
    assert two_passes >= 2
    capped = train(draft, head, train_set, TrainConfig(steps=10 * two_passes, max_epochs=2, **FAST))
    assert capped.steps == two_passes  # not the 10x budget
    assert train(draft, head, train_set, TrainConfig(steps=1, max_epochs=2, **FAST)).steps == 1  # a cap, no floor


def test_deterministic_under_seed(wide_target, wide_chunks):
    runs = []
    for seed in (0, 0, 1):
        head, train_set, _, draft = setup(wide_target, wide_chunks, seed=seed)
        train(draft, head, train_set, TrainConfig(steps=4, seed=seed, **FAST))
        runs.append(params(draft))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert not all(torch.equal(runs[0][k], runs[2][k]) for k in runs[0])


def test_a_frozen_head_stays_the_targets_and_feature_noise_changes_what_is_learnt(wide_target, wide_chunks):
    head, train_set, _, draft = setup(wide_target, wide_chunks)
    start = params(draft)
    train(draft, head, train_set, TrainConfig(steps=4, freeze_head=True, **FAST))
    frozen = params(draft)
    for name in ("lm_head.weight", "norm.weight"):
        assert torch.equal(frozen[name], start[name]), name
    assert not torch.equal(frozen["fc.weight"], start["fc.weight"])
    assert not torch.equal(frozen["midlayer.mlp.down_proj.weight"], start["midlayer.mlp.down_proj.weight"])
    head, train_set, _, noisy = setup(wide_target, wide_chunks)
    train(noisy, head, train_set, TrainConfig(steps=4, freeze_head=True, feature_noise=0.5, **FAST))
    assert not torch.equal(params(noisy)["fc.weight"], frozen["fc.weight"])


class Killed(Exception):
    pass


@pytest.mark.parametrize("feature_noise", [0.0, 0.5])
def test_resume_gives_the_uninterrupted_result(wide_target, wide_chunks, tmp_path, monkeypatch, feature_noise):
    cfg = TrainConfig(steps=8, checkpoint_every=3, checkpoint_dir=str(tmp_path / "state"),
                      feature_noise=feature_noise, **FAST)
    head, train_set, _, draft = setup(wide_target, wide_chunks)
    train(draft, head, train_set, TrainConfig(**{**cfg.__dict__, "checkpoint_dir": None}))
    uninterrupted = params(draft)

    real_save = loop.save_state

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        raise Killed  # the process dies right after the step-3 checkpoint

    monkeypatch.setattr(loop, "save_state", save_then_die)
    head, train_set, _, draft = setup(wide_target, wide_chunks)
    with pytest.raises(Killed):
        train(draft, head, train_set, cfg)
    monkeypatch.setattr(loop, "save_state", real_save)
    head, train_set, _, fresh = setup(wide_target, wide_chunks, seed=9)  # other init: state must win
    result = train(fresh, head, train_set, cfg)
    assert result.steps == 8
    resumed = params(fresh)
    for k in uninterrupted:
        assert torch.equal(uninterrupted[k], resumed[k]), k
    assert len(list((tmp_path / "state").glob("train_state-*.safetensors"))) == 1


def test_lr_schedule():
    cfg = TrainConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(cfg, 0, 100) == pytest.approx(0.1)
    assert lr_at(cfg, 9, 100) == pytest.approx(1.0)
    assert lr_at(cfg, 10, 100) == pytest.approx(1.0)
    assert lr_at(cfg, 55, 100) == pytest.approx(0.55)
    assert lr_at(cfg, 99, 100) == pytest.approx(0.1, abs=1e-3)
    assert lr_at(TrainConfig(lr=1.0, warmup_steps=10, schedule="constant"), 99, 100) == 1.0


def test_unroll_ramp():
    cfg = TrainConfig(ttt_steps=3, ttt_ramp=0.4)
    # 1 step over the first 20 % of the schedule, 2 over the next 20 %, then all 3
    assert [unroll_at(cfg, s, 100) for s in (0, 19, 20, 39, 40, 99)] == [1, 1, 2, 2, 3, 3]
    assert [unroll_at(TrainConfig(ttt_steps=3), s, 100) for s in (0, 99)] == [3, 3]  # no ramp
    # a schedule shortened mid-run never takes a step back to a shorter unroll
    for step in range(100):
        assert unroll_at(cfg, step, 80) >= unroll_at(cfg, step, 100)
    assert unroll_cost(3, 3) == 1.0 and 0 < unroll_cost(1, 3) < unroll_cost(2, 3) < 1.0


def test_a_ramped_run_trains_short_unrolls_first(wide_target, wide_chunks):
    head, train_set, _, draft = setup(wide_target, wide_chunks)
    result = train(draft, head, train_set, TrainConfig(steps=20, ttt_ramp=0.5, **{**FAST, "log_every": 1}))
    assert result.step_unroll == [1] * 5 + [2] * 5 + [3] * 10
    assert [h["unroll"] for h in result.history] == result.step_unroll
    # steps not unrolled add no loss (and nothing counted); unrolled ones do
    assert result.history[0]["step_loss"][1:] == [0.0, 0.0] and result.history[7]["step_loss"][2] == 0.0
    assert result.history[7]["step_loss"][1] > 0 and result.history[-1]["step_loss"][2] > 0

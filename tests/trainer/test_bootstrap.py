"""Bootstrap end to end on a tiny random target (char tokenizer): draft, report and plot written, the
draft loads in the engine, resume skips finished prompts, `tide draft eval` reports acceptance and
per-step top-1, and the evaluator's predicted acceptance matches what the engine measures."""

from __future__ import annotations

import itertools
import json
import time

import pytest
import torch

from services.trainer.training.loop import lr_at
from tests.support.bootstrap import TINY_BOOTSTRAP, save_tiny_chat_target, tiny_bootstrap, write_prompt_file
from tide.chunks import decode_chunk
from tools.draft import bootstrap as bs
from tools.draft.bootstrap_state import MANIFEST
from tools.draft.bootstrap_train import MIN_EVALS, evaluate_held_out
from tools.draft.draft_eval import evaluate_on_prompts
from tools.draft.generation import generate_groups, torch_threads


@pytest.fixture(scope="module")
def booted(tmp_path_factory):
    return tiny_bootstrap(tmp_path_factory)


def test_bootstrap_writes_loadable_draft_report_and_plot(booted):
    from tide.engine.drafters.eagle3 import Eagle3Drafter
    from tide.engine.llama import LlamaModel
    from tide.target import resolve_target

    cfg, report, paths = booted
    out = paths["out"]
    assert json.loads((out / "report.json").read_text())["accept_length"] == report["accept_length"]
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(report["accept_length"]) == {"1", "2", "3", "4", "5"}
    assert len(report["top1"]) == cfg.ttt_steps
    # the curve: the untrained draft, after warm-up, then one point per segment; tokens and minutes rise
    curve = report["curve"]
    assert len(curve) >= 3 and curve[0]["step"] == 0
    assert [c["train_tokens"] for c in curve] == sorted(c["train_tokens"] for c in curve)
    assert [c["wall_minutes"] for c in curve] == sorted(c["wall_minutes"] for c in curve)
    assert report["accept_length"]["3"] > curve[0]["acceptance"]["3"]  # it learned something
    assert report["wall_minutes"] <= cfg.minutes * 1.25 + 0.1
    gen = report["generation"]
    assert gen["prompts_eval"] == cfg.eval_prompts and gen["prompts_train"] > 0
    # chunks are the workers' format; held-out prompts never reach the training set
    manifest = json.loads((out / MANIFEST).read_text())
    ids = {}
    for split in ("train", "eval"):
        for name in manifest["chunks"][split]:
            chunk = decode_chunk((out / "chunks" / split / name).read_bytes(), expected_target="target")
            ids.setdefault(split, set()).add(chunk.meta.chunk_id)
            assert chunk.loss_mask.sum() > 0
    assert ids["train"].isdisjoint(ids["eval"])
    # the unroll grows from 1 step to the full TTT unroll over the schedule (BootstrapConfig.ttt_ramp)
    unrolls = [h["unroll"] for h in manifest["train"]["history"]]
    assert unrolls[0] == 1 and unrolls[-1] == cfg.ttt_steps and unrolls == sorted(unrolls)
    record = json.loads((out / "draft" / "training_record.json").read_text())
    assert set(record["chunk_ids"]) == ids["train"]
    assert record["evaluation"]["held_out"]["acceptance"] == report["accept_length"]
    model = LlamaModel.load(resolve_target(paths["target"]), dtype=torch.float32)
    drafter = Eagle3Drafter.from_checkpoint(out / "draft", model, "boot", max_batch=4, max_len=128)
    assert drafter.draft.cfg.draft_vocab_size == cfg.draft_vocab


class Stop(Exception):
    """A run "killed" between two phases."""


def stop(*a, **k):
    raise Stop


def test_finished_bootstrap_is_not_redone(booted):
    cfg, report, _ = booted
    phases = bs.Phases(generate_groups=lambda *a, **k: pytest.fail("regenerated a finished prompt"),
                       train=lambda *a, **k: pytest.fail("retrained a finished draft"))
    assert bs.bootstrap(cfg, phases=phases)["accept_length"] == report["accept_length"]


def test_resume_generates_only_missing_prompts(tmp_path):
    save_tiny_chat_target(tmp_path / "target", layers=4, init_std=0.05)
    prompts = write_prompt_file(tmp_path / "p.jsonl", 20)
    cfg = bs.BootstrapConfig(**{**TINY_BOOTSTRAP, "target": str(tmp_path / "target"), "prompts": [str(prompts)],
                                "out": str(tmp_path / "out"), "batch": 2, "eval_prompts": 4, "max_tokens": 8,
                                "gen_tokens": 1, "minutes": 5.0})
    seen: list[list[str]] = []

    def recording(engine, sink, groups, *a, **k):
        def spy():
            for items in groups:
                seen[-1].extend(key for key, _ in items)
                yield items

        return generate_groups(engine, sink, spy(), *a, **k)

    phases = bs.Phases(generate_groups=recording, train=stop)  # "killed" once generation is done
    seen.append([])
    with pytest.raises(Stop):
        bs.bootstrap(cfg, phases=phases)  # held-out prompts + one group of 4, then gen_tokens is reached
    first = seen[0]
    # the 4 held-out prompts, the first training group, and at most one more group that joined the
    # continuous batch while the first was finishing (before its tokens were counted)
    assert 8 <= len(first) <= 12 and len(set(first)) == len(first)
    # a stray chunk of an interrupted group (written, never named by the manifest) is removed
    (tmp_path / "out" / "chunks" / "train" / "boot-stray-0.safetensors").write_bytes(b"x")
    seen.append([])
    with pytest.raises(Stop):
        bs.bootstrap(bs.BootstrapConfig(**{**cfg.__dict__, "gen_tokens": None}), phases=phases)
    assert set(seen[1]).isdisjoint(first) and len(first) + len(seen[1]) == 20
    assert not (tmp_path / "out" / "chunks" / "train" / "boot-stray-0.safetensors").exists()
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert len(manifest["prompts"]) == 20 and manifest["runs"] == 2
    seen.append([])
    with pytest.raises(Stop):
        bs.bootstrap(cfg, phases=phases)
    assert seen[2] == []
    with pytest.raises(ValueError, match="other settings"):
        bs.bootstrap(bs.BootstrapConfig(**{**cfg.__dict__, "max_tokens": 9}), phases=phases)
    # a manifest from before aux_norm existed was trained without it: resuming it with it is refused
    manifest["fixed"].pop("aux_norm")
    (tmp_path / "out" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="aux_norm"):
        bs.bootstrap(bs.BootstrapConfig(**{**cfg.__dict__, "aux_norm": True}), phases=phases)


def test_draft_eval_cli_reports_acceptance_and_top1(booted, tmp_path):
    from tools.cli import main

    _, _, paths = booted
    out = tmp_path / "eval.json"
    rc = main(["draft", "eval", "--draft", str(paths["out"]), "--prompts", str(paths["heldout"]), "--gamma", "1..3",
               "--json", str(out), "--max-tokens", "24", "--batch", "8", "--dtype", "fp32", "--threads", "1",
               "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["accept_length"]) == {"1", "2", "3"}
    assert all(1.0 <= v <= g + 1 for g, v in zip((1, 2, 3), res["accept_length"].values(), strict=True))
    assert len(res["top1"]) == 3 and all(0 <= x <= 1 for x in res["top1"])
    assert res["prompts"] == 16 and res["chains"] > 0


def test_eval_on_the_held_out_chunks_reproduces_the_bootstrap_report(booted, tmp_path, capsys):
    """`tide draft eval --chunks` scores a draft on sequences captured before: on a bootstrap's
    held-out chunks it gives exactly the report's held-out numbers (same rows, same exported weights),
    which is what makes two drafts comparable on one held-out set."""
    from tools.cli import main

    cfg, report, paths = booted
    out = tmp_path / "eval.json"
    argv = ["draft", "eval", "--draft", str(paths["out"]), "--chunks", str(paths["out"] / "chunks" / "eval"),
            "--json", str(out), "--max-prompt-tokens", str(cfg.max_prompt_tokens), "--max-tokens", str(cfg.max_tokens),
            "--threads", "1", "--no-progress"]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["accept_length"] == report["accept_length"] and res["top1"] == report["top1"]
    assert res["chains"] > 0 and res["rejected_chunks"] == []
    assert main([*argv, "--engine-gamma", "3"]) == 2
    assert "does not apply to --chunks" in capsys.readouterr().err


def test_predicted_acceptance_matches_the_engine(booted):
    """Greedy, γ = 3, the same prompts: the engine serves them with the draft (and captures the chunks
    the evaluator reads); the evaluator's prediction is within 10% of the engine's measurement.

    The mean over every start row (`accept_length_all_rows`) is not what an engine measures: it
    verifies only where its previous step ended, skipping over easy stretches, so its tokens per
    step is the harmonic-style mean that `accept_length` (the evaluator's replay of that walk)
    predicts. On this target the two differ by far more than 10%."""
    _, _, paths = booted
    t0 = time.perf_counter()
    res = evaluate_on_prompts(paths["out"], [paths["heldout"]], gammas=(3,), max_tokens=40, batch=16,
                              dtype="fp32", engine_gamma=3, threads=1, progress=False)
    measured, predicted = res["engine"]["accept_length"], res["accept_length"]["3"]
    assert measured > 1.1, "the draft must accept something for the comparison to mean anything"
    assert abs(predicted - measured) <= 0.1 * measured, (predicted, measured, res["accept_length_all_rows"])
    assert time.perf_counter() - t0 < 60


def test_segments_with_a_fixed_schedule_equal_one_run(booted, tmp_path):
    """Bootstrap trains in segments (steps=end, schedule_steps=total, resuming from its state):
    the weights equal one uninterrupted run of `total` steps."""
    from services.trainer.training.data import load_dataset
    from services.trainer.training.head import TargetHead
    from services.trainer.training.loop import TrainConfig, train
    from services.trainer.training.run import build_draft
    from tide.target import resolve_target

    _, _, paths = booted
    head = TargetHead.load(resolve_target(paths["target"]))
    data = load_dataset(paths["out"] / "chunks" / "train", head, max_len=64)
    # with an unroll ramp: each step's unroll depends on the schedule, not on where a segment starts
    fast = dict(batch_rows=2, max_len=64, lr=3e-3, warmup_steps=2, log_every=2, progress=False, ttt_ramp=0.6)
    with torch_threads(1):
        one = build_draft(head, data, draft_vocab_size=64)
        train(one, head, data, TrainConfig(steps=7, **fast))
        seg = build_draft(head, data, draft_vocab_size=64)
        for end in (2, 5, 7):
            r = train(seg, head, data, TrainConfig(steps=end, schedule_steps=7, checkpoint_dir=str(tmp_path), **fast))
            assert r.steps == end and r.history[-1]["lr"] == pytest.approx(lr_at(TrainConfig(**fast), end - 1, 7))
    for k, v in one.state_dict().items():
        assert torch.equal(v, seg.state_dict()[k]), k


def test_stopped_before_export_exports_the_trained_weights(tmp_path):
    from safetensors.torch import load_file

    save_tiny_chat_target(tmp_path / "target", layers=4, init_std=0.05)
    prompts = write_prompt_file(tmp_path / "p.jsonl", 12)
    cfg = bs.BootstrapConfig(**{**TINY_BOOTSTRAP, "target": str(tmp_path / "target"), "prompts": [str(prompts)],
                                "out": str(tmp_path / "out"), "batch": 4, "eval_prompts": 4, "max_tokens": 8,
                                "max_epochs": 2, "evals": 2, "warmup_steps": 2, "minutes": 5.0})

    with pytest.raises(Stop):
        bs.bootstrap(cfg, phases=bs.Phases(export=stop))
    report = bs.bootstrap(cfg, phases=bs.Phases(generate_groups=lambda *a, **k: pytest.fail("regenerated")))
    assert report["runs"] == 2 and report["training"]["steps"] == report["training"]["schedule_steps"]
    state = json.loads((tmp_path / "out" / "train_state" / "train_state.json").read_text())
    trained = load_file(str(tmp_path / "out" / "train_state" / state["weights"]))
    exported = load_file(str(tmp_path / "out" / "draft" / "model.safetensors"))
    assert torch.equal(exported["fc.weight"], trained["draft.fc.weight"].to(exported["fc.weight"].dtype))


@pytest.mark.parametrize("change", ["slower", "faster"])
def test_the_schedule_follows_a_machine_whose_pace_changes(tmp_path, monkeypatch, change):
    """The pace measured in calibration does not hold: each training step takes 0.12 s longer (~3x the
    tiny draft's step) after it ("slower") or only during it ("faster"). The schedule is shortened or
    lengthened at the next segments, and the run completes it (its last step at the schedule's end,
    the cosine's floor) within the budget."""
    from services.trainer.training.loop import TrainConfig
    from services.trainer.training.objective import Eagle3Objective

    save_tiny_chat_target(tmp_path / "target", layers=4, init_std=0.05)
    prompts = write_prompt_file(tmp_path / "p.jsonl", 12)
    # no unroll ramp: the steps' own cost stays put, only the machine's pace changes
    cfg = bs.BootstrapConfig(**{**TINY_BOOTSTRAP, "target": str(tmp_path / "target"), "prompts": [str(prompts)],
                                "out": str(tmp_path / "out"), "batch": 4, "eval_prompts": 4, "max_tokens": 8,
                                "max_epochs": 10_000, "evals": 8, "warmup_steps": 2, "minutes": 0.8,
                                "ttt_ramp": 0.0})
    real, calls = Eagle3Objective.forward, itertools.count()

    def paced(self, batch, unroll=None):  # a machine's pace: a fault a real run cannot be made to show on demand
        # calibration times the first training steps (the warm-up's 2 here); evaluations do not count
        if self.draft.training and (next(calls) < cfg.warmup_steps) == (change == "faster"):
            time.sleep(0.12)
        return real(self, batch, unroll)

    monkeypatch.setattr(Eagle3Objective, "forward", paced)
    report = bs.bootstrap(cfg)
    tr = report["training"]
    # without re-planning: equal, and stopped early (slower) or ended with time to spare (faster)
    if change == "slower":
        assert tr["schedule_steps"] < tr["planned_steps"]
    else:
        assert tr["schedule_steps"] > 1.2 * tr["planned_steps"]
    assert tr["steps"] == tr["schedule_steps"] and not tr["stopped_early"]
    history = json.loads((tmp_path / "out" / MANIFEST).read_text())["train"]["history"]
    floor = lr_at(TrainConfig(lr=cfg.lr, warmup_steps=cfg.warmup_steps), tr["steps"] - 1, tr["steps"])
    assert history[-1]["step"] == tr["steps"] and history[-1]["lr"] == pytest.approx(floor)
    assert report["wall_minutes"] <= cfg.minutes + 0.05


def test_slow_evaluations_make_a_coarser_curve_not_a_shorter_training(tmp_path):
    """Where one held-out evaluation is slow against the budget (a slow CPU), the curve gets fewer
    points (at least MIN_EVALS) so that evaluating stays near EVAL_SHARE of the training time."""
    save_tiny_chat_target(tmp_path / "target", layers=4, init_std=0.05)
    prompts = write_prompt_file(tmp_path / "p.jsonl", 12)
    cfg = bs.BootstrapConfig(**{**TINY_BOOTSTRAP, "target": str(tmp_path / "target"), "prompts": [str(prompts)],
                                "out": str(tmp_path / "out"), "batch": 4, "eval_prompts": 4, "max_tokens": 8,
                                "max_epochs": 10_000, "evals": 8, "warmup_steps": 2, "minutes": 0.4})
    def slow(*a, **k):  # a slow machine's evaluation: a pace a real run cannot be made to show on demand
        time.sleep(1.5)
        return evaluate_held_out(*a, **k)

    report = bs.bootstrap(cfg, phases=bs.Phases(evaluate=slow))
    assert report["training"]["evaluations"] == MIN_EVALS < cfg.evals
    assert 1 + 2 <= len(report["curve"]) <= 1 + MIN_EVALS  # the origin, then at most MIN_EVALS points
    # the schedule ran (to within a step or so: on a 24-s budget a 1.5-s evaluation shifts the last
    # segment's deadline by more than a step of the tiny draft)
    assert report["training"]["steps"] >= 0.95 * report["training"]["schedule_steps"]
    assert report["wall_minutes"] <= cfg.minutes + 0.05

"""Phase 2 of `tide draft bootstrap`: train a from-scratch draft for the rest of the budget.

The draft (`training.run.build_draft`: vocabulary from the training data) trains on the training
chunks in segments (resuming from its state in `DIR/train_state/`), each followed by an evaluation
on the held-out chunks: the curve of simulated acceptance length vs training tokens and minutes.
The first few warm-up steps measure the step time (the calibration); the LR schedule's length
(warm-up + cosine) is then fixed so that training ends at the deadline, capped at `max_epochs`
passes, and re-planned before each segment as the measured pace drifts."""

from __future__ import annotations

import logging
import math
import statistics
import time
from pathlib import Path

from tools.draft.bootstrap_config import BootstrapConfig
from tools.draft.bootstrap_state import BootstrapManifest, BudgetClock
from tools.draft.generation import progress_bar

log = logging.getLogger(__name__)

CALIBRATION_STEPS = 5  # steps timed before the schedule's length is fixed (at most the warm-up)
EXPORT_RESERVE_S = 8.0  # budget kept back for export, report and the process's exit, on top of one evaluation
# The curve's evaluations may take at most this share of the training time: fewer than `evals` points
# where one evaluation is slow against the budget (boot21, a 2-core AVX2 CPU: 30 s each, 10 of them
# were 5 of its 30 minutes), but never fewer than MIN_EVALS after the origin.
EVAL_SHARE = 0.1
# A segment stops once it has run PACE_SLACK x its predicted time + PACE_GRACE_S: the machine's pace
# changed (another job, a slower unroll than the cost model says), and the schedule is re-planned at
# once instead of at the segment's planned end, by which time the budget may be gone.
PACE_SLACK, PACE_GRACE_S = 2.0, 1.0
MIN_EVALS = 4  # the schedule is re-planned at each: too few and a drifting pace goes uncorrected


def evaluate_held_out(draft, eval_set, head, cfg: BootstrapConfig) -> dict:
    """The draft's numbers on the held-out set: one point of the curve, or the final evaluation."""
    from services.trainer.training.evaluate import evaluate

    r = evaluate(draft, eval_set, head, ttt_steps=cfg.ttt_steps, mask=cfg.ttt_mask, max_len=cfg.eval_len)
    return {"acceptance": {str(k): v for k, v in r.served.items()},
            "acceptance_all_rows": {str(k): v for k, v in r.acceptance.items()}, "top1": r.ttt_top1,
            "chain_accuracy": r.chain_accuracy, "ttt_loss": r.ttt_loss, "coverage": r.coverage}


def train_phase(cfg: BootstrapConfig, out: Path, manifest: BootstrapManifest, clock: BudgetClock, target,
                evaluate=evaluate_held_out) -> dict:
    """Train (or resume) for the rest of the budget in segments, evaluating after each with
    `evaluate` (`evaluate_held_out`'s signature). Returns what the export needs (the draft, the
    target head, the held-out set) and the training's numbers."""
    return _Training(cfg, out, manifest, clock, target, evaluate).run()


class _Training:
    """One run's training: the data, the draft (resumed from its state), the step it is at, and the
    pace measured so far: seconds of a fully unrolled step (`t_step`), a segment's cost besides its
    steps (`t_seg`), one evaluation (`t_eval`); kept in the manifest for a resumed run."""

    def __init__(self, cfg: BootstrapConfig, out: Path, manifest: BootstrapManifest, clock: BudgetClock, target,
                 evaluate) -> None:
        from services.trainer.training.data import load_dataset, plan_batches
        from services.trainer.training.head import TargetHead
        from services.trainer.training.loop import train, unroll_at, unroll_cost
        from services.trainer.training.run import build_draft
        from services.trainer.training.state import load_state

        self.cfg, self.manifest, self.clock, self.evaluate = cfg, manifest, clock, evaluate
        self._train, self._unroll_at = train, unroll_at
        self.cost = lambda k: unroll_cost(k, cfg.ttt_steps)  # of a k-step unroll, in fully unrolled steps
        self.head = head = TargetHead.load(target)
        self.train_set = load_dataset(out / "chunks" / "train", head, cfg.max_len, expected_target=head.model_id,
                                      learn_prompt_rows=cfg.learn_prompt_rows)
        # held-out sequences stay whole (one piece each): the draft sees their whole context, as when served
        self.eval_set = load_dataset(out / "chunks" / "eval", head, cfg.eval_len, expected_target=head.model_id)
        if not self.train_set.pieces:
            raise RuntimeError(f"no training data in {out / 'chunks' / 'train'} (budget or prompts too small?)")
        if not self.eval_set.pieces:
            raise RuntimeError(f"no held-out data in {out / 'chunks' / 'eval'} (--eval-prompts 0?)")
        self.tr = tr = manifest.doc["train"]
        self.state_dir = out / "train_state"
        self.draft = build_draft(head, self.train_set, None, cfg.draft_vocab, cfg.seed, cfg.aux_norm)
        state = load_state(self.state_dir)
        self.step = int(state["doc"]["progress"]["step"]) if state else 0
        self.tokens = int(state["doc"]["progress"]["tokens"]) if state else 0
        if state:  # the trained weights, also when no segment is left to run (stopped before the export)
            self.draft.load_state_dict({k[len("draft."):]: v for k, v in state["tensors"].items()
                                        if k.startswith("draft.")})
        del state
        self.per_epoch = len(plan_batches([len(p) for p in self.train_set.pieces], cfg.batch_rows, cfg.max_len,
                                          cfg.seed, 0))
        self.max_steps = max(1, math.floor(cfg.max_epochs * self.per_epoch))
        clock.charge("other")
        self.t_eval = tr.get("eval_s") or 0.0
        self.t_step = tr.get("step_s")
        # A segment's wall time is its steps plus a fixed cost (set-up, the checkpoint it writes, and a
        # slower first step: 0.4 s on the CI-sized CPU). The median step time leaves that cost out, so a
        # short calibration does not read it as slower steps: counted into 5 steps, it once planned a
        # third fewer steps than the budget held.
        self.t_seg = tr.get("segment_s") or 0.0
        self.tcfg = cfg.train_config(self.state_dir, 0, None)

    # ---- measuring -------------------------------------------------------------------------------

    def evaluate_now(self, step: int, tokens: int, loss: float | None) -> None:
        """A point of the curve (timed: `t_eval`)."""
        tr, clock = self.tr, self.clock
        t = time.monotonic()
        entry = self.evaluate(self.draft, self.eval_set, self.head, self.cfg)
        self.t_eval = time.monotonic() - t
        tr["eval_s"] = self.t_eval
        clock.charge("eval")
        entry.update(step=step, train_tokens=tokens, data_tokens=self.train_set.num_tokens, loss=loss,
                     train_minutes=self.manifest.doc["spent_s"]["train"] / 60, wall_minutes=clock.elapsed() / 60)
        tr["curve"].append(entry)
        self.manifest.save()
        log.info("step %d: acceptance@3 %.3f, top1 %s", step, entry["acceptance"].get("3", float("nan")),
                 [round(x, 3) for x in entry["top1"]])

    def segment(self, end: int, schedule: int) -> None:
        """Train up to step `end` of a `schedule`-step schedule (measuring the pace), then evaluate."""
        tr = self.tr
        # cut short when the pace falls well behind the one planned with (the loop re-plans after it)
        cap = None if self.t_step is None else PACE_SLACK * self.seconds(self.step, end, schedule) + PACE_GRACE_S
        t = time.monotonic()
        res = self._train(self.draft, self.head, self.train_set,
                          self.cfg.train_config(self.state_dir, end, schedule, max_seconds=cap))
        took = time.monotonic() - t
        self.clock.charge("train")
        tr["history"] += res.history
        if res.step_seconds:  # t_step: seconds of a fully unrolled step, whatever the unroll was
            self.t_step = statistics.median(s / self.cost(k)
                                            for s, k in zip(res.step_seconds, res.step_unroll, strict=True))
            self.t_seg = max(0.0, took - self.t_step * sum(self.cost(k) for k in res.step_unroll))
            tr["step_s"], tr["segment_s"] = self.t_step, self.t_seg
        self.step, self.tokens = res.steps, res.tokens
        loss = res.history[-1]["loss"] if res.history else None
        self.evaluate_now(self.step, self.tokens, loss)

    # ---- planning --------------------------------------------------------------------------------

    def reserve(self) -> float:
        """Kept back at the end: the final evaluation and the export."""
        return self.t_eval + EXPORT_RESERVE_S

    def per_segment(self) -> float:
        """What a segment costs besides its steps."""
        return self.t_eval + self.t_seg

    def seconds(self, a: int, b: int, total: int) -> float:
        """Predicted time of steps a..b-1 of a `total`-step schedule (their unrolls differ)."""
        return max(self.t_step or 1e-6, 1e-6) * sum(self.cost(self._unroll_at(self.tcfg, i, total))
                                                    for i in range(a, b))

    def steps_within(self, budget: float, end: int, total: int) -> int:
        """The last step (exclusive, at most `end`) that `budget` seconds reach from `step` on."""
        spent, i = 0.0, self.step
        while i < end and (spent := spent + self.seconds(i, i + 1, total)) <= budget:
            i += 1
        return i

    def longest_schedule(self, budget: float) -> int:
        """The longest schedule (at most max_steps) whose steps from `step` on fit in `budget` seconds."""
        lo, hi = self.step, self.max_steps
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.seconds(self.step, mid, mid) <= budget else (lo, mid - 1)
        return lo

    def calibrate(self) -> None:
        """Time the first steps, then fix the number of evaluations and the schedule's length."""
        cfg, tr, clock = self.cfg, self.tr, self.clock
        # warm-up steps depend neither on the schedule's length nor (being at its very start) on its
        # unroll ramp; max_steps stands in for the length
        self.segment(max(1, min(CALIBRATION_STEPS, cfg.warmup_steps, self.max_steps)), self.max_steps)
        affordable = math.floor(EVAL_SHARE * (clock.left() - self.reserve()) / max(self.t_eval, 1e-6))
        tr["evals"] = max(min(cfg.evals, MIN_EVALS), min(cfg.evals, affordable))
        if tr["evals"] < cfg.evals:
            log.info("%d evaluations during training instead of %d: one takes %.0f s of the %.0f s left",
                     tr["evals"], cfg.evals, self.t_eval, clock.left())
        evals_left = max(1, tr["evals"] - 1)
        tr["schedule_steps"] = tr["planned_steps"] = self.longest_schedule(
            clock.left() - self.reserve() - evals_left * self.per_segment())
        self.manifest.save()

    # ---- the phase -------------------------------------------------------------------------------

    def run(self) -> dict:
        cfg, tr, clock = self.cfg, self.tr, self.clock
        if self.step == 0 and not tr["curve"]:
            self.evaluate_now(0, 0, None)  # the untrained draft: the curve's origin
        if tr["schedule_steps"] is None:
            self.calibrate()
        total = tr["schedule_steps"]
        bar = progress_bar(total, "train", "step", cfg.progress, self.step)
        evals = tr.get("evals", cfg.evals)
        n_seg = max(1, evals - (len(tr["curve"]) - 1))  # segments left: `evals` points after the origin
        stopped_early = False
        while self.step < total:
            # The machine's pace drifts (boot15: planned 1,448 steps from the calibration, 1,201 fitted),
            # and the calibration's 1-step unrolls predict fully unrolled steps through a cost model. The
            # schedule is re-planned before each segment so that its cosine ends at the deadline: shortened
            # when what is left no longer fits (the LR steps down once instead of the run stopping at a
            # high LR), lengthened when over 2 % more fits (the LR steps up a little).
            step = self.step
            fit_total = self.longest_schedule(clock.left() - self.reserve() - n_seg * self.per_segment())
            if step < fit_total < total or fit_total > step + 1.02 * (total - step):
                log.info("schedule re-planned from %d to %d steps (measured pace %.3f s per full step)", total,
                         fit_total, self.t_step)
                total = tr["schedule_steps"] = fit_total
                bar.total = total
            target = min(total, step + max(1, math.ceil((total - step) / n_seg)))
            n_seg = max(1, n_seg - 1)
            end = self.steps_within(clock.left() - self.reserve() - self.per_segment(), target, total)
            if end <= step:
                stopped_early = True
                break
            if end < target == total:
                # the last segment falls a few steps short of the deadline (the pace drifted since the
                # re-plan above): the schedule ends where the time does, so its last step is the cosine's floor
                log.info("schedule ends at step %d instead of %d: the pace drifted in the last segment", end, total)
                total = tr["schedule_steps"] = end
                bar.total = total
            self.segment(end, total)
            bar.update(self.step - bar.n)
            bar.set_postfix(acc3=f"{tr['curve'][-1]['acceptance'].get('3', 0):.3f}",
                            loss=f"{tr['curve'][-1]['loss']:.3f}")
        bar.close()
        tr["stopped_early"] = stopped_early or self.step < total
        self.manifest.save()
        return {"steps": self.step, "schedule_steps": total, "planned_steps": tr.get("planned_steps", total),
                "tokens": self.tokens, "per_epoch": self.per_epoch, "epochs": self.step / max(self.per_epoch, 1),
                "train_chunks": self.train_set.chunk_ids, "eval_set": self.eval_set, "head": self.head,
                "draft": self.draft, "data_tokens": self.train_set.num_tokens}

"""Bootstrap a draft for a target from prompts alone: generate, capture, train from scratch, export.

`tide draft bootstrap --target ref --prompts FILE... --minutes N --out DIR` runs, within a wall-time
budget of N minutes (model loading, generation, training, evaluation and export included):

1. **Generate.** Prompts (the formats of `tide.prompts`) are deduplicated, shuffled (seeded) and
   the first `eval_prompts` are held out (never trained on). The engine decodes greedy
   continuations (chat template via `encode_prompt`, `max_tokens` each) in groups of
   2 x `batch` prompts of similar length (`generation.length_sorted_groups`) with continuous
   batching over `batch` slots (a group joins as soon as slots free up, so groups overlap:
   `generation.generate_groups`), with a capture listener as an
   inference worker has: every committed row (prompt rows and generated tokens, their aux and
   final states) becomes a chunk row, learnable when its next token is generated
   (`tide.chunks.learnable_rows`). Chunks are the workers' format
   (`tide.chunks`), each sequence kept whole in one chunk where it fits, and go to
   `DIR/chunks/eval/` (held-out prompts, generated first) and `DIR/chunks/train/`. Generation
   stops at the first of: `gen_fraction` of the budget spent (the sequences still running are then
   cut, and their greedy prefixes kept), `gen_tokens` output tokens in the training set, or no
   prompts left.
2. **Train** a from-scratch draft (`training.run.build_draft`: vocabulary from the training data)
   on the training chunks for the rest of the budget. The first few warm-up steps measure the
   step time; the LR schedule's length (warm-up + cosine) is then fixed so that training ends at
   the deadline, capped at `max_epochs` passes, and shortened when later steps are slower.
   Training runs in segments (resuming from its state in `DIR/train_state/`), each followed by an
   evaluation on the held-out chunks: the curve of simulated acceptance length vs training tokens
   and minutes.
3. **Export** the draft to `DIR/draft/` (checkpoint + training_record.json), evaluate the exported
   (bf16-rounded) weights on the held-out chunks, and write `DIR/report.json` and `DIR/report.png`
   (loss and acceptance over training).

Resumable: `DIR/bootstrap.json` (the manifest, written atomically) records the prompts already
generated (their chunks are written before the manifest names them; files no manifest names are
removed at start), the time spent per phase, the schedule length and the curve. A rerun skips
finished prompts, resumes training from its last segment and only re-exports when that is missing.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tide.eagle3.checkpoint import BOOTSTRAP_DRAFT_DIR, CONFIG_FILE
from tide.precision import dtype_name, resolve_dtype
from tide.prompts import Prompt
from tools.draft.generation import (
    LENGTH_SORT_WINDOW,
    SequenceChunks,
    encode_prompts,
    generate_groups,
    length_sorted_groups,
    load_prompt_files,
    make_engine,
    progress_bar,
    prompt_key,
    torch_threads,
    write_blob,
)

log = logging.getLogger(__name__)

MANIFEST = "bootstrap.json"
MANIFEST_VERSION = 1
REPORT_JSON = "report.json"
REPORT_PNG = "report.png"
CALIBRATION_STEPS = 5  # steps timed before the schedule's length is fixed (at most the warm-up)
EXPORT_RESERVE_S = 8.0  # budget kept back for export, report and the process's exit, on top of one evaluation
# The curve's evaluations may take at most this share of the training time: fewer than `evals` points
# where one evaluation is slow against the budget (boot21, a 2-core AVX2 CPU: 30 s each, 10 of them
# were 5 of its 30 minutes), but never fewer than MIN_EVALS after the origin.
EVAL_SHARE = 0.1
MIN_EVALS = 4  # the schedule is re-planned at each: too few and a drifting pace goes uncorrected


# ---- prompts ------------------------------------------------------------------------------------

def split_prompts(prompts: list[Prompt], eval_prompts: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out): a seeded shuffle (sources mixed, so a budget cut keeps every domain), the
    first `eval_prompts` held out. The split of a prompt does not depend on the budget."""
    order = sorted(prompts, key=prompt_key)
    random.Random(seed).shuffle(order)
    n = min(eval_prompts, max(0, len(order) - 1))
    return order[n:], order[:n]


# ---- configuration and manifest -----------------------------------------------------------------

@dataclass
class BootstrapConfig:
    target: str = "ref"
    prompts: list[str] = field(default_factory=list)
    out: str = "bootstrap"
    minutes: float = 30.0  # wall-time budget of the whole run (generation + training + export)
    # Share of the budget that generation may use (held-out prompts included). The draft is limited
    # by optimizer steps more than by distinct tokens: on one machine and one data source, a 30-minute
    # run with generation cut at 0.5 / 0.4 / 0.3 of the budget reached served accept@3 1.855 / 1.922 /
    # 1.972 (2.1 / 4.2 / 7.0 passes over the data; docs/results/2026-11-28/README.md). A clean-clone
    # run with 0.3 gave 1.940: runs of one setting differ by ~0.03 (docs/results/2026-11-29/README.md).
    gen_fraction: float = 0.3
    gen_tokens: int | None = None  # stop generating once the training set holds this many output tokens
    prompt_limit: int | None = None  # prompts read per file
    eval_prompts: int = 32  # held-out prompts (evaluation only)
    # Engine slots while generating. More slots make more tokens per second (reference model on the
    # Intel AMX machine, prompts grouped by length: 325 tokens/s at 32, 379 at 64, 450 at 128), and
    # since generation is cut at its deadline they cost training no time. But the float32 KV cache
    # grows with them (128 slots x 769 positions: 7.9 GB resident), and in a 30-minute run 128 slots'
    # 1.3x the tokens ended at the same held-out acceptance as 32 (docs/results/2026-11-27/README.md).
    batch: int = 32
    max_tokens: int = 256  # output tokens per prompt
    max_prompt_tokens: int = 768  # longer prompts are skipped
    chunk_tokens: int = 2048  # rows per chunk file (the workers' default)
    dtype: str = "auto"  # target dtype for generation (tide.precision: "auto" = bf16 where native, else fp32)
    draft_vocab: int = 8192
    max_epochs: float = 20.0  # cap on passes over the training data
    evals: int = 8  # evaluations on the held-out chunks during training (the curve; see EVAL_SHARE)
    # A from-scratch draft in a ~15-minute training budget is limited by optimizer steps, not by
    # tokens: on 292k output tokens (session 6), 2 rows x 512 at lr 1e-3 reached held-out served
    # accept@3 1.64 in 4.3 min of training, where 8 rows at 3e-4 had 1.40 after 2.9 min and 2 rows
    # at 3e-4 1.63 after 6.4 min (docs/results/2026-11-22/README.md).
    lr: float = 1e-3
    batch_rows: int = 2
    learn_prompt_rows: bool = False  # see training.data.load_dataset
    max_len: int = 512
    ttt_steps: int = 3
    ttt_mask: str = "specforge"  # see training.objective.TTTAttention
    # The unroll grows from 1 to ttt_steps over this share of the schedule (training.loop.TrainConfig).
    # At equal compute on boot19's data (1,440 steps with it, 1,200 without): held-out served
    # accept@3 2.017 against 1.912 (docs/results/2026-11-30/README.md).
    ttt_ramp: float = 0.4
    warmup_steps: int = 20
    freeze_head: bool = False  # see training.loop.TrainConfig
    feature_noise: float = 0.0  # see training.loop.TrainConfig
    aux_norm: bool = True  # per-layer scaling of the aux states while training (training.aux_scale)
    autocast: bool = True  # bf16 autocast for the training forward (see training.loop.TrainConfig)
    seed: int = 0
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    progress: bool = True

    @property
    def eval_len(self) -> int:
        return self.max_prompt_tokens + self.max_tokens + 1

    def train_config(self, state_dir: Path, steps: int, schedule_steps: int | None):
        from services.trainer.training.loop import TrainConfig

        return TrainConfig(steps=steps, schedule_steps=schedule_steps, batch_rows=self.batch_rows,
                           max_len=self.max_len, lr=self.lr, warmup_steps=self.warmup_steps,
                           ttt_steps=self.ttt_steps, ttt_mask=self.ttt_mask, ttt_ramp=self.ttt_ramp, seed=self.seed,
                           freeze_head=self.freeze_head, feature_noise=self.feature_noise, aux_norm=self.aux_norm,
                           checkpoint_dir=str(state_dir), autocast=self.autocast,
                           log_every=1, progress=False)  # segments start anywhere


# Settings a resumed run must share with the first one (the rest may change, e.g. --minutes).
_FIXED = ("target", "eval_prompts", "max_tokens", "max_prompt_tokens", "seed", "draft_vocab", "lr", "batch_rows",
          "max_len", "ttt_steps", "ttt_mask", "warmup_steps", "learn_prompt_rows", "freeze_head", "feature_noise",
          "aux_norm", "ttt_ramp")
# What a manifest written before a _FIXED setting existed did, for that setting (not today's default:
# resuming such a run with the new default would change its training under it).
_BEFORE_SETTING = {"aux_norm": False, "ttt_ramp": 0.0}


class Manifest:
    def __init__(self, path: Path, doc: dict) -> None:
        self.path, self.doc = path, doc

    @classmethod
    def open(cls, out: Path, cfg: BootstrapConfig) -> Manifest:
        path = out / MANIFEST
        fixed = {k: getattr(cfg, k) for k in _FIXED}
        if path.exists():
            doc = json.loads(path.read_text())
            if doc.get("version") != MANIFEST_VERSION:
                raise ValueError(f"{path}: manifest version {doc.get('version')}, expected {MANIFEST_VERSION}")
            # a setting newer than the manifest counts as what the code did before it existed
            was = {k: doc["fixed"].get(k, _BEFORE_SETTING.get(k, getattr(BootstrapConfig, k))) for k in fixed}
            changed = {k: (was[k], v) for k, v in fixed.items() if was[k] != v}
            if changed:
                raise ValueError(f"{out} was bootstrapped with other settings {changed}; use another --out")
            return cls(path, doc)
        doc = {"version": MANIFEST_VERSION, "fixed": fixed, "prompts": {}, "chunks": {"train": [], "eval": []},
               "spent_s": {"generate": 0.0, "train": 0.0, "eval": 0.0, "other": 0.0},
               "runs": 0, "train": {"schedule_steps": None, "curve": [], "history": []}, "done": False}
        return cls(path, doc)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".bootstrap.", dir=self.path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(self.doc, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)

    def tokens(self, split: str) -> int:
        return sum(v["tokens"] for v in self.doc["prompts"].values() if v["split"] == split)


class Clock:
    """Budget bookkeeping: seconds spent in earlier runs (from the manifest) + this run's, counted
    from `started` (time.monotonic(); the command line passes its process's start, so that the budget
    is the command's wall time; what precedes the clock is charged to the phase of the first charge)."""

    def __init__(self, manifest: Manifest, budget_s: float, started: float | None = None) -> None:
        self.m, self.budget_s = manifest, budget_s
        self.start = time.monotonic() if started is None else started
        self.before = sum(manifest.doc["spent_s"].values())
        self._mark = self.start

    def elapsed(self) -> float:
        return self.before + time.monotonic() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def charge(self, phase: str) -> float:
        """Add the time since the last charge to `phase`; returns it."""
        now = time.monotonic()
        dt = now - self._mark
        self.m.doc["spent_s"][phase] += dt
        self._mark = now
        return dt


# ---- the pipeline -----------------------------------------------------------------------------------


def bootstrap(cfg: BootstrapConfig, started: float | None = None) -> dict:
    """Run (or resume) the bootstrap of `cfg.out`; returns the report (also in DIR/report.json).
    `started`: the time.monotonic() this run's budget counts from (None: now)."""
    with torch_threads(cfg.threads):
        return _bootstrap(cfg, started)


def _bootstrap(cfg: BootstrapConfig, started: float | None) -> dict:
    from tide.target import load_tokenizer, resolve_target

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest.open(out, cfg)
    if manifest.doc["done"] and (out / REPORT_JSON).exists() and (out / BOOTSTRAP_DRAFT_DIR / CONFIG_FILE).exists():
        log.info("%s: bootstrap already finished", out)
        return json.loads((out / REPORT_JSON).read_text())
    manifest.doc["runs"] += 1
    clock = Clock(manifest, cfg.minutes * 60.0, started)
    target = resolve_target(cfg.target)
    _remove_unlisted_chunks(out, manifest)
    prompts = load_prompt_files(cfg.prompts, cfg.prompt_limit)
    train_prompts, eval_prompts = split_prompts(prompts, cfg.eval_prompts, cfg.seed)
    log.info("%d prompts: %d for training, %d held out", len(prompts), len(train_prompts), len(eval_prompts))
    generated = generate_phase(cfg, out, manifest, clock, target, load_tokenizer(target), train_prompts, eval_prompts)
    manifest.save()
    summary = train_phase(cfg, out, manifest, clock, target)
    report = finish(cfg, out, manifest, clock, target, summary, generated)
    return report


def _remove_unlisted_chunks(out: Path, manifest: Manifest) -> None:
    """Chunks written by a run that stopped before its manifest named them would be duplicates."""
    for split in ("train", "eval"):
        listed = set(manifest.doc["chunks"][split])
        d = out / "chunks" / split
        if d.exists():
            for f in d.iterdir():
                if f.name not in listed:
                    f.unlink()


def generate_phase(cfg: BootstrapConfig, out: Path, manifest: Manifest, clock: Clock, target, tokenizer,
                   train_prompts: list[Prompt], eval_prompts: list[Prompt]) -> dict:
    """Generate what is missing (held-out prompts first); returns this run's generation stats."""
    from tide.engine.llama import LlamaModel

    done = manifest.doc["prompts"]
    gen_deadline = cfg.gen_fraction * clock.budget_s  # in clock.elapsed() seconds
    todo = {"eval": [p for p in eval_prompts if prompt_key(p) not in done],
            "train": [p for p in train_prompts if prompt_key(p) not in done]}
    stats = {"prompts": 0, "output_tokens": 0, "seconds": 0.0}

    def train_full() -> bool:
        return cfg.gen_tokens is not None and manifest.tokens("train") >= cfg.gen_tokens

    if manifest.doc["train"]["schedule_steps"] is not None or (out / "train_state").exists():
        todo["train"] = []  # training has started on the data there is: it must not change under it
    if not todo["eval"] and (not todo["train"] or train_full() or clock.elapsed() >= gen_deadline):
        return stats
    t0 = time.perf_counter()
    model = LlamaModel.load(target, dtype=resolve_dtype(cfg.dtype))
    engine = make_engine(model, cfg.batch, cfg.max_prompt_tokens, cfg.max_tokens)
    sink = SequenceChunks(model.cfg.hidden_size, target.model_id, cfg.chunk_tokens)
    engine.capture_listeners.append(sink)
    group = 2 * cfg.batch
    n_train_done = sum(1 for v in done.values() if v["split"] == "train")
    for split in ("eval", "train"):
        initial = n_train_done if split == "train" else len(eval_prompts) - len(todo["eval"])
        bar = progress_bar(initial + len(todo[split]), f"generate ({split})", "prompt", cfg.progress, initial)
        made = {"t0": time.perf_counter(), "prompts": 0, "tokens": 0}  # this split, this run

        def groups(todo_split=todo[split], bar=bar):
            """Encoded groups of prompts, sorted by length within windows (`length_sorted_groups`),
            encoded a window at a time: a big prompt file costs nothing up front."""
            pending = iter(todo_split)
            while part := list(itertools.islice(pending, group * LENGTH_SORT_WINDOW)):
                items, _ = encode_prompts(tokenizer, part, cfg.max_prompt_tokens)
                keep = {k for k, _ in items}
                for p in part:
                    if prompt_key(p) not in keep:
                        done[prompt_key(p)] = {"split": "skipped", "tokens": 0}  # too long (or empty)
                bar.update(len(part) - len(items))
                yield from length_sorted_groups(items, group)

        def out_of_time(split=split) -> bool:
            """Training data stops at the generation deadline, once it holds a group at least
            (whatever the budget: training needs data); the held-out set is always completed."""
            return split == "train" and clock.elapsed() >= gen_deadline and manifest.tokens("train") > 0

        def admit(split=split) -> bool:
            return not (split == "train" and train_full()) and not out_of_time(split)

        for res in generate_groups(engine, sink, groups(), cfg.max_tokens, on_done=bar.update, admit=admit,
                                   cut=out_of_time):
            for cid, blob in res.chunks:
                write_blob(out / "chunks" / split, f"{cid}.safetensors", blob)
            manifest.doc["chunks"][split] += [f"{cid}.safetensors" for cid, _ in res.chunks]
            for k, n in zip(res.keys, res.output_tokens, strict=True):
                done[k] = {"split": split, "tokens": n}
            stats["prompts"] += len(res.keys)
            stats["output_tokens"] += sum(res.output_tokens)
            made["prompts"] += len(res.keys)
            made["tokens"] += sum(res.output_tokens)
            clock.charge("generate")
            manifest.save()
            elapsed = time.perf_counter() - made["t0"]
            if split == "train":
                fit = bar.n + int(max(0.0, gen_deadline - clock.elapsed()) / (elapsed / made["prompts"]))
                bar.total = min(bar.total, fit)
                bar.refresh()
            bar.set_postfix(tok=manifest.tokens(split), tok_s=f"{made['tokens'] / max(elapsed, 1e-9):.0f}")
        bar.close()
    stats["seconds"] = time.perf_counter() - t0
    log.info("generation: %d prompts, %d output tokens in %.0f s (%.0f tokens/s)", stats["prompts"],
             stats["output_tokens"], stats["seconds"], stats["output_tokens"] / max(stats["seconds"], 1e-9))
    return stats


def _eval_entry(draft, eval_set, head, cfg: BootstrapConfig) -> dict:
    from services.trainer.training.evaluate import evaluate

    r = evaluate(draft, eval_set, head, ttt_steps=cfg.ttt_steps, mask=cfg.ttt_mask, max_len=cfg.eval_len)
    return {"acceptance": {str(k): v for k, v in r.served.items()},
            "acceptance_all_rows": {str(k): v for k, v in r.acceptance.items()}, "top1": r.ttt_top1,
            "chain_accuracy": r.chain_accuracy, "ttt_loss": r.ttt_loss, "coverage": r.coverage}


def train_phase(cfg: BootstrapConfig, out: Path, manifest: Manifest, clock: Clock, target) -> dict:
    """Train (or resume) for the rest of the budget in segments, evaluating after each."""
    from services.trainer.training.data import load_dataset, plan_batches
    from services.trainer.training.head import TargetHead
    from services.trainer.training.loop import train, unroll_at, unroll_cost
    from services.trainer.training.run import build_draft
    from services.trainer.training.state import load_state

    head = TargetHead.load(target)
    train_set = load_dataset(out / "chunks" / "train", head, cfg.max_len, expected_target=head.model_id,
                             learn_prompt_rows=cfg.learn_prompt_rows)
    # held-out sequences stay whole (one piece each): the draft sees their whole context, as when served
    eval_set = load_dataset(out / "chunks" / "eval", head, cfg.eval_len, expected_target=head.model_id)
    if not train_set.pieces:
        raise RuntimeError(f"no training data in {out / 'chunks' / 'train'} (budget or prompts too small?)")
    if not eval_set.pieces:
        raise RuntimeError(f"no held-out data in {out / 'chunks' / 'eval'} (--eval-prompts 0?)")
    tr = manifest.doc["train"]
    state_dir = out / "train_state"
    draft = build_draft(head, train_set, None, cfg.draft_vocab, cfg.seed, cfg.aux_norm)
    state = load_state(state_dir)
    step = int(state["doc"]["progress"]["step"]) if state else 0
    tokens = int(state["doc"]["progress"]["tokens"]) if state else 0
    if state:  # the trained weights, also when no segment is left to run (stopped before the export)
        draft.load_state_dict({k[len("draft."):]: v for k, v in state["tensors"].items() if k.startswith("draft.")})
    del state
    per_epoch = len(plan_batches([len(p) for p in train_set.pieces], cfg.batch_rows, cfg.max_len, cfg.seed, 0))
    max_steps = max(1, math.floor(cfg.max_epochs * per_epoch))
    clock.charge("other")
    t_eval = tr.get("eval_s") or 0.0
    t_step = tr.get("step_s")
    # A segment's wall time is its steps plus a fixed cost (set-up, the checkpoint it writes, and a
    # slower first step: 0.4 s on the CI-sized CPU). The median step time leaves that cost out, so a
    # short calibration does not read it as slower steps: counted into 5 steps, it once planned a
    # third fewer steps than the budget held.
    t_seg = tr.get("segment_s") or 0.0

    def evaluate_now(step: int, tokens: int, loss: float | None) -> None:
        t = time.monotonic()
        entry = _eval_entry(draft, eval_set, head, cfg)
        nonlocal t_eval
        t_eval = time.monotonic() - t
        tr["eval_s"] = t_eval
        clock.charge("eval")
        entry.update(step=step, train_tokens=tokens, data_tokens=train_set.num_tokens, loss=loss,
                     train_minutes=manifest.doc["spent_s"]["train"] / 60, wall_minutes=clock.elapsed() / 60)
        tr["curve"].append(entry)
        manifest.save()
        log.info("step %d: acceptance@3 %.3f, top1 %s", step, entry["acceptance"].get("3", float("nan")),
                 [round(x, 3) for x in entry["top1"]])

    tcfg = cfg.train_config(state_dir, 0, None)
    cost = lambda k: unroll_cost(k, cfg.ttt_steps)  # noqa: E731 - of a k-step unroll, in fully unrolled steps

    def segment(end: int, schedule: int) -> None:
        nonlocal step, tokens, t_step, t_seg
        t = time.monotonic()
        res = train(draft, head, train_set, cfg.train_config(state_dir, end, schedule))
        took = time.monotonic() - t
        clock.charge("train")
        tr["history"] += res.history
        if res.step_seconds:  # t_step: seconds of a fully unrolled step, whatever the unroll was
            t_step = statistics.median(s / cost(k) for s, k in zip(res.step_seconds, res.step_unroll, strict=True))
            t_seg = max(0.0, took - t_step * sum(cost(k) for k in res.step_unroll))
            tr["step_s"], tr["segment_s"] = t_step, t_seg
        step, tokens = res.steps, res.tokens
        loss = res.history[-1]["loss"] if res.history else None
        evaluate_now(step, tokens, loss)

    reserve = lambda: t_eval + EXPORT_RESERVE_S  # noqa: E731 - final evaluation + export
    per_segment = lambda: t_eval + t_seg  # noqa: E731 - what a segment costs besides its steps
    if step == 0 and not tr["curve"]:
        evaluate_now(0, 0, None)  # the untrained draft: the curve's origin

    def seconds(a: int, b: int, total: int) -> float:
        """Predicted time of steps a..b-1 of a `total`-step schedule (their unrolls differ)."""
        return max(t_step or 1e-6, 1e-6) * sum(cost(unroll_at(tcfg, i, total)) for i in range(a, b))

    def steps_within(budget: float, end: int, total: int) -> int:
        """The last step (exclusive, at most `end`) that `budget` seconds reach from `step` on."""
        spent, i = 0.0, step
        while i < end and (spent := spent + seconds(i, i + 1, total)) <= budget:
            i += 1
        return i

    def longest_schedule(budget: float) -> int:
        """The longest schedule (at most max_steps) whose steps from `step` on fit in `budget` seconds."""
        lo, hi = step, max_steps
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if seconds(step, mid, mid) <= budget else (lo, mid - 1)
        return lo

    if tr["schedule_steps"] is None:
        # calibration: warm-up steps depend neither on the schedule's length nor (being at its very start)
        # on its unroll ramp; max_steps stands in for the length
        segment(max(1, min(CALIBRATION_STEPS, cfg.warmup_steps, max_steps)), max_steps)
        affordable = math.floor(EVAL_SHARE * (clock.left() - reserve()) / max(t_eval, 1e-6))
        tr["evals"] = max(min(cfg.evals, MIN_EVALS), min(cfg.evals, affordable))
        if tr["evals"] < cfg.evals:
            log.info("%d evaluations during training instead of %d: one takes %.0f s of the %.0f s left",
                     tr["evals"], cfg.evals, t_eval, clock.left())
        evals_left = max(1, tr["evals"] - 1)
        tr["schedule_steps"] = tr["planned_steps"] = longest_schedule(
            clock.left() - reserve() - evals_left * per_segment())
        manifest.save()
    total = tr["schedule_steps"]
    bar = progress_bar(total, "train", "step", cfg.progress, step)
    evals = tr.get("evals", cfg.evals)
    n_seg = max(1, evals - (len(tr["curve"]) - 1))  # segments left: `evals` points after the origin
    stopped_early = False
    while step < total:
        # The machine's pace drifts (boot15: planned 1,448 steps from the calibration, 1,201 fitted),
        # and the calibration's 1-step unrolls predict fully unrolled steps through a cost model. The
        # schedule is re-planned before each segment so that its cosine ends at the deadline: shortened
        # when what is left no longer fits (the LR steps down once instead of the run stopping at a
        # high LR), lengthened when over 2 % more fits (the LR steps up a little).
        fit_total = longest_schedule(clock.left() - reserve() - n_seg * per_segment())
        if step < fit_total < total or fit_total > step + 1.02 * (total - step):
            log.info("schedule re-planned from %d to %d steps (measured pace %.3f s per full step)", total,
                     fit_total, t_step)
            total = tr["schedule_steps"] = fit_total
            bar.total = total
        end = min(total, step + max(1, math.ceil((total - step) / n_seg)))
        n_seg = max(1, n_seg - 1)
        end = steps_within(clock.left() - reserve() - per_segment(), end, total)
        if end <= step:
            stopped_early = True
            break
        segment(end, total)
        bar.update(step - bar.n)
        bar.set_postfix(acc3=f"{tr['curve'][-1]['acceptance'].get('3', 0):.3f}", loss=f"{tr['curve'][-1]['loss']:.3f}")
    bar.close()
    tr["stopped_early"] = stopped_early or step < total
    manifest.save()
    return {"steps": step, "schedule_steps": total, "planned_steps": tr.get("planned_steps", total), "tokens": tokens,
            "per_epoch": per_epoch,
            "epochs": step / max(per_epoch, 1), "train_chunks": train_set.chunk_ids, "eval_set": eval_set,
            "head": head, "draft": draft, "data_tokens": train_set.num_tokens}


def finish(cfg: BootstrapConfig, out: Path, manifest: Manifest, clock: Clock, target, summary: dict,
           generated: dict) -> dict:
    from services.trainer.training.export import export_draft
    from tide.eagle3 import load_checkpoint

    head, draft, tr = summary["head"], summary["draft"], manifest.doc["train"]
    draft_dir = out / BOOTSTRAP_DRAFT_DIR
    args = {**dataclasses.asdict(cfg), "target": str(cfg.target), "target_model": head.model_id}
    export_draft(draft_dir, draft.cpu(), args, summary["train_chunks"], {"curve": tr["curve"]},
                 target_model=head.model_id)
    exported = load_checkpoint(draft_dir, head.embed, head.config, dtype=torch.float32)  # as served (bf16-rounded)
    final = _eval_entry(exported, summary["eval_set"], head, cfg)
    clock.charge("eval")
    doc = manifest.doc
    eval_tokens, train_tokens = manifest.tokens("eval"), manifest.tokens("train")
    gen_s = doc["spent_s"]["generate"]
    report = {
        "target": head.model_id, "draft": str(draft_dir), "created_at": time.time(),
        "accept_length": final["acceptance"], "top1": final["top1"], "evaluation": final,
        "budget_minutes": cfg.minutes, "wall_minutes": clock.elapsed() / 60,
        "spent_minutes": {k: v / 60 for k, v in doc["spent_s"].items()},
        "runs": doc["runs"],
        "generation": {
            "prompts_train": sum(1 for v in doc["prompts"].values() if v["split"] == "train"),
            "prompts_eval": sum(1 for v in doc["prompts"].values() if v["split"] == "eval"),
            "output_tokens_train": train_tokens, "output_tokens_eval": eval_tokens,
            "chunks_train": len(doc["chunks"]["train"]), "chunks_eval": len(doc["chunks"]["eval"]),
            "skipped_long": sum(1 for v in doc["prompts"].values() if v["split"] == "skipped"),
            "tokens_per_s": (train_tokens + eval_tokens) / gen_s if gen_s else None,
            "dtype": dtype_name(resolve_dtype(cfg.dtype)),
            "this_run": generated,
        },
        "training": {"steps": summary["steps"], "schedule_steps": summary["schedule_steps"],
                     "planned_steps": summary["planned_steps"],
                     "tokens": summary["tokens"], "data_rows": summary["data_tokens"],
                     "epochs": summary["epochs"], "stopped_early": tr.get("stopped_early", False),
                     "seconds_per_step": tr.get("step_s"), "evaluations": tr.get("evals", cfg.evals),
                     "seconds_per_evaluation": tr.get("eval_s")},
        "curve": tr["curve"],
        "loss_history": tr["history"],
        "config": dataclasses.asdict(cfg),
    }
    # the training record carries the final evaluation too
    record_path = draft_dir / "training_record.json"
    record = json.loads(record_path.read_text())
    record["evaluation"] = {"held_out": final, "curve": tr["curve"], "report": REPORT_JSON}
    record_path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    plot_report(report, out / REPORT_PNG)
    clock.charge("other")
    report["wall_minutes"] = clock.elapsed() / 60
    report["spent_minutes"] = {k: v / 60 for k, v in doc["spent_s"].items()}
    write_blob(out, REPORT_JSON, (json.dumps(report, indent=2) + "\n").encode())
    doc["done"] = True
    manifest.save()
    log.info("bootstrap done: acceptance %s (held-out), draft in %s", final["acceptance"], draft_dir)
    return report


def plot_report(report: dict, path: Path) -> None:
    """Loss over training tokens; held-out acceptance length (each γ) over training tokens and minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve, hist = report["curve"], report["loss_history"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    if hist:
        ax.plot([h["step"] for h in hist], [h["loss"] for h in hist], lw=1, alpha=0.5, label="train objective")
        ax.plot([h["step"] for h in hist], [h["step_loss"][0] for h in hist], lw=1, label="train loss, step 1")
    ax.plot([c["step"] for c in curve], [c["ttt_loss"][0] for c in curve], "o-", ms=3, label="held-out loss, step 1")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title("loss (objective: unrolled steps weighted)")
    ax.legend()
    gammas = sorted(curve[-1]["acceptance"], key=int) if curve else []
    for ax, xkey, xlabel in ((axes[1], "train_tokens", "training tokens processed"),
                             (axes[2], "wall_minutes", "wall minutes (generation + training)")):
        for g in gammas:
            ax.plot([c[xkey] for c in curve], [c["acceptance"][g] for c in curve], "o-", ms=3, label=f"γ={g}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out acceptance length")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].set_title("acceptance vs tokens")
    axes[2].set_title("acceptance vs minutes")
    fig.suptitle(f"bootstrap of {report['target']}: {report['generation']['output_tokens_train']} training tokens, "
                 f"{report['training']['steps']} steps, {report['wall_minutes']:.1f} min")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".report.", suffix=".png", dir=path.parent)
    os.close(fd)
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)

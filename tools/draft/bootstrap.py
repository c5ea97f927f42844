"""Bootstrap a draft for a target from prompts alone: generate, capture, train from scratch, export.

`tide draft bootstrap --target ref --prompts FILE... --minutes N --out DIR` runs, within a wall-time
budget of N minutes (model loading, generation, training, evaluation and export included):

1. **Generate** (`bootstrap_generate`). Prompts (the formats of `tide.prompts`) are deduplicated,
   shuffled (seeded) and the first `eval_prompts` are held out (never trained on). The engine decodes
   greedy continuations in groups of prompts of similar length with continuous batching, capturing
   every committed row as an inference worker does, into chunks (the workers' format) in
   `DIR/chunks/eval/` (held-out prompts, generated first) and `DIR/chunks/train/`. Generation
   stops at the first of: `gen_fraction` of the budget spent (the sequences still running are then
   cut, and their greedy prefixes kept), `gen_tokens` output tokens in the training set, or no
   prompts left.
2. **Train** (`bootstrap_train`) a from-scratch draft on the training chunks for the rest of the
   budget. The first few warm-up steps measure the step time; the LR schedule's length (warm-up +
   cosine) is then fixed so that training ends at the deadline, capped at `max_epochs` passes, and
   shortened when later steps are slower. Training runs in segments (resuming from its state in
   `DIR/train_state/`), each followed by an evaluation on the held-out chunks: the curve of
   simulated acceptance length vs training tokens and minutes.
3. **Export** (`bootstrap_export`) the draft to `DIR/draft/` (checkpoint + training_record.json),
   evaluate the exported (bf16-rounded) weights on the held-out chunks, and write `DIR/report.json`
   and `DIR/report.png` (loss and acceptance over training).

Resumable: `DIR/bootstrap.json` (the manifest, `bootstrap_state`, written atomically) records the
prompts already generated (their chunks are written before the manifest names them; files no
manifest names are removed at start), the time spent per phase, the schedule length and the curve.
A rerun skips finished prompts, resumes training from its last segment and only re-exports when that
is missing.

This module holds the orchestration; the settings are `bootstrap_config.BootstrapConfig`.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tide.eagle3.checkpoint import BOOTSTRAP_DRAFT_DIR, CONFIG_FILE
from tide.prompts import Prompt
from tools.draft.bootstrap_config import BootstrapConfig
from tools.draft.bootstrap_export import REPORT_JSON, export_phase
from tools.draft.bootstrap_generate import generate_phase
from tools.draft.bootstrap_state import BootstrapManifest, BudgetClock, remove_unlisted_chunks
from tools.draft.bootstrap_train import evaluate_held_out, train_phase
from tools.draft.generation import generate_groups, load_prompt_files, prompt_key, torch_threads

__all__ = ["BootstrapConfig", "Phases", "bootstrap", "split_prompts"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Phases:
    """What a bootstrap runs, each replaceable (a test stops a run between phases, watches the prompt
    groups that reach the engine, or slows the evaluations down): the generation phase's engine loop
    (`generation.generate_groups`), the training phase, the held-out evaluation (of the curve's
    points and of the exported draft) and the export."""

    generate_groups: Callable = generate_groups
    train: Callable[..., dict] = train_phase
    evaluate: Callable[..., dict] = evaluate_held_out
    export: Callable[..., dict] = export_phase


def split_prompts(prompts: list[Prompt], eval_prompts: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out): a seeded shuffle (sources mixed, so a budget cut keeps every domain), the
    first `eval_prompts` held out. The split of a prompt does not depend on the budget."""
    order = sorted(prompts, key=prompt_key)
    random.Random(seed).shuffle(order)
    n = min(eval_prompts, max(0, len(order) - 1))
    return order[n:], order[:n]


def bootstrap(cfg: BootstrapConfig, started: float | None = None, phases: Phases | None = None) -> dict:
    """Run (or resume) the bootstrap of `cfg.out`; returns the report (also in DIR/report.json).
    `started`: the time.monotonic() this run's budget counts from (None: now)."""
    with torch_threads(cfg.threads):
        return _bootstrap(cfg, started, phases or Phases())


def _bootstrap(cfg: BootstrapConfig, started: float | None, phases: Phases) -> dict:
    from tide.target import load_tokenizer, resolve_target

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = BootstrapManifest.open(out, cfg)
    if manifest.doc["done"] and (out / REPORT_JSON).exists() and (out / BOOTSTRAP_DRAFT_DIR / CONFIG_FILE).exists():
        log.info("%s: bootstrap already finished", out)
        return json.loads((out / REPORT_JSON).read_text())
    manifest.doc["runs"] += 1
    clock = BudgetClock(manifest, cfg.minutes * 60.0, started)
    target = resolve_target(cfg.target)
    remove_unlisted_chunks(out, manifest)
    prompts = load_prompt_files(cfg.prompts, cfg.prompt_limit)
    train_prompts, eval_prompts = split_prompts(prompts, cfg.eval_prompts, cfg.seed)
    log.info("%d prompts: %d for training, %d held out", len(prompts), len(train_prompts), len(eval_prompts))
    generated = generate_phase(cfg, out, manifest, clock, target, load_tokenizer(target), train_prompts, eval_prompts,
                               generate=phases.generate_groups)
    manifest.save()
    summary = phases.train(cfg, out, manifest, clock, target, evaluate=phases.evaluate)
    return phases.export(cfg, out, manifest, clock, summary, generated, evaluate=phases.evaluate)

"""Phase 1 of `tide draft bootstrap`: greedy continuations of the prompts, captured as training data.

The engine decodes greedy continuations (chat template via `encode_prompt`, `max_tokens` each) in
groups of 2 x `batch` prompts of similar length (`generation.length_sorted_groups`) with continuous
batching over `batch` slots (a group joins as soon as slots free up, so groups overlap:
`generation.generate_groups`), with a capture listener as an inference worker has: every committed
row (prompt rows and generated tokens, their aux and final states) becomes a chunk row, learnable
when its next token is generated (`tide.chunks.learnable_rows`). Chunks are the workers' format
(`tide.chunks`), each sequence kept whole in one chunk where it fits, and go to `DIR/chunks/eval/`
(held-out prompts, generated first) and `DIR/chunks/train/`. Generation stops at the first of:
`gen_fraction` of the budget spent (the sequences still running are then cut, and their greedy
prefixes kept), `gen_tokens` output tokens in the training set, or no prompts left. A prompt is
generated once: a rerun skips those its manifest names, and adds no training data once training
has started."""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

from tide.precision import resolve_dtype
from tide.prompts import Prompt
from tools.draft.bootstrap_config import BootstrapConfig
from tools.draft.bootstrap_state import BootstrapManifest, BudgetClock
from tools.draft.generation import (
    LENGTH_SORT_WINDOW,
    capturing_engine,
    encode_prompts,
    generate_groups,
    length_sorted_groups,
    progress_bar,
    prompt_key,
    write_chunks,
)

log = logging.getLogger(__name__)


def generate_phase(cfg: BootstrapConfig, out: Path, manifest: BootstrapManifest, clock: BudgetClock, target,
                   tokenizer, train_prompts: list[Prompt], eval_prompts: list[Prompt],
                   generate=generate_groups) -> dict:
    """Generate what is missing (held-out prompts first); returns this run's generation stats.
    `generate`: the engine loop (`generation.generate_groups`, or a test's wrapper around it)."""
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
    engine, sink = capturing_engine(model, target.model_id, cfg.batch, cfg.max_prompt_tokens, cfg.max_tokens,
                                    chunk_tokens=cfg.chunk_tokens)
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

        for res in generate(engine, sink, groups(), cfg.max_tokens, on_done=bar.update, admit=admit,
                            cut=out_of_time):
            manifest.doc["chunks"][split] += write_chunks(out / "chunks" / split, res.chunks)
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

"""Bootstrap-style generation throughput (tokens/s) for several engine batch sizes, same prompts.

    .venv/bin/python benchmarks/experiments/genspeed.py SECONDS SPEC...

SPEC is BATCHxMAX_TOKENS (prompts in the seeded shuffle's order, groups of 2 x BATCH as the
bootstrap forms them) or BATCHxMAX_TOKENSwN (grouped by length within windows of N groups,
`generation.length_sorted_groups`). Each setting generates greedily, capturing chunks as the
bootstrap does, and counts the generated tokens of its first SECONDS (then the sequences
running are cut, as at the bootstrap's generation deadline). docs/results/bootstrap (boot13 and boot14,
"Generation: bigger batches") ran `150 32x256 32x256w8 64x256w8 128x256w8 64x256w2`, one process each run.
"""

from __future__ import annotations

import random
import sys
import time

import torch

from tide.engine.llama import LlamaModel
from tide.target import load_tokenizer, resolve_target
from tools.draft.generation import (
    capturing_engine,
    encode_prompts,
    generate_groups,
    length_sorted_groups,
    load_prompt_files,
)

DATA = "/work/shared/data/"
FILES = ["spec_bench_questions.jsonl", "alpaca_seed_tasks.jsonl", "gsm8k_train.jsonl"]


class Meter:
    """Capture listener counting generated tokens until `seconds` have passed; `running()` is the
    admission check (no new group once time is up)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.t0 = seconds, time.perf_counter()
        self.tokens, self.stopped = 0, None

    def running(self) -> bool:
        if self.stopped is None and time.perf_counter() - self.t0 > self.seconds:
            self.stopped = time.perf_counter() - self.t0
        return self.stopped is None

    def time_up(self) -> bool:
        """Cut the running sequences: no drain."""
        return not self.running()

    def __call__(self, rows) -> None:
        if self.running():
            self.tokens += sum(len(r.token_ids) for r in rows if r.start >= r.num_prompt)


def main() -> None:
    target = resolve_target("ref")
    prompts = load_prompt_files([DATA + f for f in FILES], 4000)
    random.Random(1).shuffle(prompts)
    items, _ = encode_prompts(load_tokenizer(target), prompts[:2000], 512)
    model = LlamaModel.load(target, dtype=torch.bfloat16)
    seconds = float(sys.argv[1])
    for spec in sys.argv[2:]:
        shape, _, window = spec.partition("w")
        batch, max_tokens = map(int, shape.split("x"))
        group = 2 * batch
        if window:
            groups = list(length_sorted_groups(items, group, int(window)))
        else:
            groups = [items[a:a + group] for a in range(0, len(items), group)]
        engine, sink = capturing_engine(model, target.model_id, batch, 512, max_tokens)
        meter = Meter(seconds)
        engine.capture_listeners.append(meter)
        for _ in generate_groups(engine, sink, groups, max_tokens, admit=meter.running, cut=meter.time_up):
            pass
        n, dt = meter.tokens, meter.stopped or time.perf_counter() - meter.t0
        print(f"{spec}: {n} generated tokens in {dt:.0f} s = {n / dt:.0f} tokens/s", flush=True)


if __name__ == "__main__":
    main()

"""Reference-model engine speed on this CPU.

    .venv/bin/python benchmarks/experiments/engine_speed.py fp32 bf16
        greedy generation tokens/s per dtype (32 Spec-Bench prompts, batch 16, 64 tokens)
    .venv/bin/python benchmarks/experiments/engine_speed.py --profile [BATCH]
        where a float32 decode step goes: 20 steps under torch.profiler (default 32 slots)
"""

import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.getcwd())
from tide.engine.llama import LlamaModel  # noqa: E402
from tide.engine.sequence import SamplingParams  # noqa: E402
from tide.target import load_tokenizer, resolve_target  # noqa: E402
from tools.draft.generation import make_engine  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
target = resolve_target("ref")
tok = load_tokenizer(target)
with open("/work/shared/data/spec_bench_questions.jsonl") as f:
    questions = [json.loads(line) for line in f][:32]


def ids_of(question: dict) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": question["turns"][0]}], add_generation_prompt=True)
    return ids if isinstance(ids, list) else list(ids["input_ids"])


def start(dtype: torch.dtype, batch: int, max_tokens: int):
    engine = make_engine(LlamaModel.load(target, dtype=dtype), batch, 512, max_tokens)
    params = SamplingParams(max_tokens=max_tokens)
    n = len(questions) if batch == 16 else batch  # generation: all 32 prompts through 16 slots
    return engine, [engine.add_request(f"r{i}", ids_of(q), params, False) for i, q in enumerate(questions[:n])]


if sys.argv[1:2] == ["--profile"]:
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    engine, seqs = start(torch.float32, batch, 96)
    for _ in range(40):  # prefills and the first decode steps
        engine.step()
    t0, n0 = time.perf_counter(), sum(s.num_output for s in seqs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            engine.step()
    seconds, n = time.perf_counter() - t0, sum(s.num_output for s in seqs) - n0
    print(f"decode: {n} tokens in {seconds:.2f}s = {n / seconds:.1f} tok/s, {seconds / 20 * 1e3:.0f} ms/step, "
          f"active {len(engine.scheduler.active)}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
else:
    for name in sys.argv[1:]:
        engine, seqs = start(DTYPES[name], 16, 64)
        t0 = time.perf_counter()
        while engine.has_work():
            engine.step()
        seconds = time.perf_counter() - t0
        n = sum(s.num_output for s in seqs)
        print(name, n, f"{seconds:.1f}s", f"{n / seconds:.1f} tok/s", flush=True)

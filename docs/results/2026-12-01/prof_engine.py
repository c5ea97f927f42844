"""Where a float32 decode step of the reference model goes: 20 steps under torch.profiler.

    .venv/bin/python docs/results/2026-12-01/prof_engine.py [BATCH]   (default 32 slots)
"""

import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.getcwd())
from services.inference.engine.llama import LlamaModel  # noqa: E402
from services.inference.engine.sequence import SamplingParams  # noqa: E402
from services.trainer.generation import make_engine  # noqa: E402
from tide.target import load_tokenizer, resolve_target  # noqa: E402

target = resolve_target("ref")
tok = load_tokenizer(target)
with open("/work/shared/data/spec_bench_questions.jsonl") as f:
    questions = [json.loads(line) for line in f][:32]


def ids_of(question: dict) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": question["turns"][0]}], add_generation_prompt=True)
    return ids if isinstance(ids, list) else list(ids["input_ids"])


batch = int(sys.argv[1]) if len(sys.argv) > 1 else 32
engine = make_engine(LlamaModel.load(target, dtype=torch.float32), batch, 512, 96)
params = SamplingParams(max_tokens=96)
seqs = [engine.add_request(f"r{i}", ids_of(q), params, False) for i, q in enumerate(questions[:batch])]
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

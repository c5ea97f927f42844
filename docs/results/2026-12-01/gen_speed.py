"""Greedy generation tokens/s of the reference model per dtype (32 Spec-Bench prompts, batch 16, 64 tokens).

    .venv/bin/python docs/results/2026-12-01/gen_speed.py fp32 bf16
"""

import json
import os
import sys
import time

import torch

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


prompts = [ids_of(q) for q in questions]
for name in sys.argv[1:]:
    model = LlamaModel.load(target, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[name])
    engine = make_engine(model, 16, 512, 64)
    params = SamplingParams(max_tokens=64)
    t0 = time.perf_counter()
    seqs = [engine.add_request(f"r{i}", ids, params, False) for i, ids in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    seconds = time.perf_counter() - t0
    n = sum(s.num_output for s in seqs)
    print(name, n, f"{seconds:.1f}s", f"{n / seconds:.1f} tok/s", flush=True)

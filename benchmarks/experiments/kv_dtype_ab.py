"""The KV cache in bf16 against float32 on the CPU kernels: plain greedy decoding, tok/s, side by side.

    python -m benchmarks.experiments.kv_dtype_ab [--target ref] [--batches 1 16] [--tokens 256] [--rounds 4]

A bf16 model's keys and values are bf16, so a bf16 cache holds them exactly (tide.engine.llama.
kv_cache_dtype) and the tokens must be the same; what changes is the bytes decode attention reads.
Each round runs both caches, in alternating order; the report is the median tok/s and the median of
the per-round ratios bf16 / float32, and whether every output was identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from unittest import mock

import torch

from tide.engine import llama
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.sequence import SamplingParams
from tide.prompts import encode_prompt, load_prompts
from tide.target import load_tokenizer, resolve_target


def run(model, prompts: list[list[int]], batch: int, tokens: int, float32: bool) -> tuple[float, list]:
    with mock.patch.object(llama, "kv_cache_dtype", lambda d, dev, hd: torch.float32) if float32 else nullcontext():
        engine = LLMEngine(model, EngineConfig(max_batch=batch, max_seq_len=2048))
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    dt = time.perf_counter() - t0
    return sum(s.num_output for s in seqs) / dt, [list(s.output_ids) for s in seqs]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="ref")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts", default="spec_bench_questions.jsonl[:16]")
    args = ap.parse_args(argv)
    target = resolve_target(args.target)
    model = llama.LlamaModel.load(target, dtype=torch.bfloat16)
    tok = load_tokenizer(target)
    prompts = [encode_prompt(tok, p) for p in load_prompts(args.prompts)]
    out: dict = {"target": args.target, "tokens": args.tokens, "rounds": args.rounds,
                 "cache_dtype": str(llama.kv_cache_dtype(torch.bfloat16, "cpu", model.cfg.head_dim))}
    for b in args.batches:
        batch = prompts[:4] if b == 1 else prompts[:b]  # batch 1: four prompts one after another
        rates: dict[str, list[float]] = {"bf16": [], "float32": []}
        same = True
        for r in range(args.rounds + 1):  # round 0 warms both up, not counted
            order = ["bf16", "float32"] if r % 2 else ["float32", "bf16"]
            outputs = {}
            for name in order:
                rate, outputs[name] = run(model, batch, b, args.tokens, name == "float32")
                if r:
                    rates[name].append(rate)
            same &= outputs["bf16"] == outputs["float32"]
        ratio = statistics.median(a / c for a, c in zip(rates["bf16"], rates["float32"], strict=True))
        out[f"batch_{b}"] = {"bf16_tok_s": round(statistics.median(rates["bf16"]), 2),
                             "float32_tok_s": round(statistics.median(rates["float32"]), 2),
                             "bf16_over_float32": round(ratio, 3), "identical_outputs": same}
        print(f"batch {b}: {out[f'batch_{b}']}", flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

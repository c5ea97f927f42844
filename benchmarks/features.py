"""What logits processing costs: engine tokens/s with and without each feature, side by side.

    .venv/bin/python -m benchmarks.features [--max-tokens 32] [--out docs/results/structured-outputs/features.json]

Reference target (float32, as "auto" picks on a CPU without bf16), n-gram drafter at γ=3, greedy,
the same chat prompts for every row; batch 1 and 16. Rows: none (the fast path), json_schema,
logit_bias (20 tokens), presence + frequency penalties. Then what masking the EAGLE-3 draft to the
grammar buys in accept length on the json_schema workload: a random draft of the production shape
(no trained draft is shipped), so every accepted draft token is one the mask forced.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from tide.engine.drafters import NgramDrafter
from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.profiling import random_draft
from tide.engine.sequence import GrammarKind, GrammarSpec, SamplingParams
from tide.policies import FixedGamma
from tide.prompts import Prompt, encode_prompt
from tide.target import load_tokenizer, resolve_target

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
    "role": {"enum": ["engineer", "manager", "designer"]},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["name", "age", "role", "skills"], "additionalProperties": False}
TOPICS = ["a software engineer", "a chef", "a pilot", "a teacher", "a doctor", "a farmer", "a writer", "a nurse"]


def _features(max_tokens: int) -> dict[str, SamplingParams]:
    base = dict(max_tokens=max_tokens, ignore_eos=True)
    return {
        "none": SamplingParams(**base),
        "json_schema": SamplingParams(max_tokens=max_tokens, grammar=GrammarSpec(GrammarKind.JSON_SCHEMA,
                                                                                json.dumps(SCHEMA))),
        "logit_bias": SamplingParams(**base, logit_bias=tuple((100 + 37 * i, 1.5) for i in range(20))),
        "penalties": SamplingParams(**base, presence_penalty=0.6, frequency_penalty=0.4),
    }


def _run(engine: LLMEngine, prompts, params) -> tuple[float, int, float]:
    """(output tokens/s, tokens, accept length) of one batch run to completion."""
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    out = sum(s.num_output for s in seqs)
    steps = sum(s.verify_steps for s in seqs)
    return out / dt, out, (sum(s.accepted_tokens for s in seqs) + steps) / steps if steps else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--out", default="docs/results/structured-outputs/features.json")
    args = ap.parse_args()
    target = resolve_target("ref")
    tok = load_tokenizer(target)
    model = LlamaModel.load(target, dtype=torch.float32)
    prompts = [encode_prompt(tok, Prompt(f"Describe {t} as JSON with name, age, role and skills.", "json", "bench"))
               for t in TOPICS]
    features = _features(args.max_tokens)
    results: dict = {"machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
                     "max_tokens": args.max_tokens, "throughput": {}, "eagle3_masking": {}}
    engine = LLMEngine(model, EngineConfig(max_batch=16, max_seq_len=512), tokenizer=tok,
                       drafter=NgramDrafter(), policy=FixedGamma(3))
    engine.compile_grammar(features["json_schema"].grammar)  # the worker compiles at submit, off the loop
    _run(engine, prompts[:2], [features["none"]] * 2)  # warm-up
    print(f"{'feature':12} " + " ".join(f"{'batch ' + b + ' tok/s':>16}" for b in args.batches.split(",")))
    for name, params in features.items():
        row = {}
        for b in map(int, args.batches.split(",")):
            batch = [prompts[i % len(prompts)] for i in range(b)]
            tps, out, acc = _run(engine, batch, [params] * b)
            row[b] = {"tokens_per_s": tps, "tokens": out, "accept_length": acc}
        results["throughput"][name] = row
        print(f"{name:12} " + " ".join(f"{r['tokens_per_s']:16.1f}" for r in row.values()))

    drafter = Eagle3Drafter(random_draft(model, draft_vocab=model.cfg.vocab_size), "random", 16, 512)
    engine = LLMEngine(model, EngineConfig(max_batch=16, max_seq_len=512), tokenizer=tok, drafter=drafter,
                       policy=FixedGamma(3))
    for masked in (False, True):
        drafter.mask_to_grammar = masked
        tps, out, acc = _run(engine, prompts, [features["json_schema"]] * len(prompts))
        results["eagle3_masking"]["masked" if masked else "unmasked"] = {"tokens_per_s": tps, "tokens": out,
                                                                         "accept_length": acc}
        print(f"EAGLE-3 (random draft) json_schema, drafts {'masked' if masked else 'unmasked'}: "
              f"accept length {acc:.2f}, {tps:.1f} tok/s (batch {len(prompts)})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

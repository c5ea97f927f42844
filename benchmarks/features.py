"""What logits processing costs: engine tokens/s with and without each feature, side by side.

    .venv/bin/python -m benchmarks.features [--max-tokens 32] [--out docs/results/structured-outputs/features.json]

Reference target (the dtype "auto" picks: bf16 where the CPU has it), greedy, the same chat prompts
for every row, batch 1 and 16, plain decoding and n-gram speculation at γ=3; every row in each of
`--rounds` rounds (order reversed every round), medians and the ratio to "none". Rows: none (the
fast path), json_schema, logit_bias (20 tokens), presence + frequency penalties. Then what masking
the EAGLE-3 draft to the grammar buys in accept length on the json_schema workload (`--draft`, e.g.
the starter draft; else a random draft of the production shape, where every accepted draft token is
one the mask forced).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
from tide.precision import resolve_dtype
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
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds; medians are reported [3]")
    ap.add_argument("--draft", default="", help="an EAGLE-3 draft directory for the masking rows [a random one]")
    ap.add_argument("--out", default="docs/results/structured-outputs/features.json")
    args = ap.parse_args()
    target = resolve_target("ref")
    tok = load_tokenizer(target)
    model = LlamaModel.load(target, dtype=resolve_dtype("auto"))
    prompts = [encode_prompt(tok, Prompt(f"Describe {t} as JSON with name, age, role and skills.", "json", "bench"))
               for t in TOPICS]
    features = _features(args.max_tokens)
    batches = [int(b) for b in args.batches.split(",")]
    results: dict = {"machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                                 "dtype": str(model.dtype)}, "max_tokens": args.max_tokens, "rounds": args.rounds,
                     "throughput": {}, "eagle3_masking": {}}
    modes = {"plain": FixedGamma(0), "ngram_g3": FixedGamma(3)}
    for mode, policy in modes.items():
        engine = LLMEngine(model, EngineConfig(max_batch=16, max_seq_len=512), tokenizer=tok,
                           drafter=NgramDrafter(), policy=policy)
        engine.compile_grammar(features["json_schema"].grammar)  # the worker compiles at submit, off the loop
        _run(engine, prompts[:2], [features["none"]] * 2)  # warm-up
        runs: dict = {(f, b): [] for f in features for b in batches}
        for r in range(args.rounds):  # every feature in every round, order reversed each round: drift hits all
            for name in (list(features) if r % 2 == 0 else list(features)[::-1]):
                for b in batches:
                    batch = [prompts[i % len(prompts)] for i in range(b)]
                    runs[name, b].append(_run(engine, batch, [features[name]] * b))
        table = {}
        for name in features:
            table[name] = {}
            for b in batches:
                tps = statistics.median(x[0] for x in runs[name, b])
                table[name][b] = {"tokens_per_s": round(tps, 1), "vs_none": round(
                    tps / statistics.median(x[0] for x in runs["none", b]), 3),
                    "accept_length": round(statistics.median(x[2] for x in runs[name, b]), 3)}
        results["throughput"][mode] = table
        print(f"{mode}: " + "  ".join(f"{n}: " + ", ".join(f"b{b} {v['tokens_per_s']:.0f} tok/s ({v['vs_none']:.2f}x)"
                                                         for b, v in row.items()) for n, row in table.items()))

    drafter = (Eagle3Drafter.from_checkpoint(args.draft, model, "draft", 16, 512) if args.draft else
               Eagle3Drafter(random_draft(model, draft_vocab=model.cfg.vocab_size), "random", 16, 512))
    results["eagle3_masking"]["draft"] = args.draft or "random"
    engine = LLMEngine(model, EngineConfig(max_batch=16, max_seq_len=512), tokenizer=tok, drafter=drafter,
                       policy=FixedGamma(3))
    for masked in (False, True):
        drafter.mask_to_grammar = masked
        tps, out, acc = _run(engine, prompts, [features["json_schema"]] * len(prompts))
        results["eagle3_masking"]["masked" if masked else "unmasked"] = {"tokens_per_s": round(tps, 1), "tokens": out,
                                                                         "accept_length": round(acc, 3)}
        print(f"EAGLE-3 ({args.draft or 'random draft'}) json_schema, drafts {'masked' if masked else 'unmasked'}: "
              f"accept length {acc:.2f}, {tps:.1f} tok/s (batch {len(prompts)})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

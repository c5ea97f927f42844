"""tide.kernels' GEMMs on AMX tiles (gemm_amx.h) against the same build's AVX-512 (VDPBF16PS) tiles,
side by side in one process on a CPU with AMX-BF16: the packed weights are one layout, so one loaded
model serves both arms (`set_amx`; the bits differ between the arms, never within one).

    python -m benchmarks.experiments.amx_ab --draft tide/starter_drafts/smollm2-135m-instruct \\
        --json docs/results/speculation/amx-ab-spr.json

Per arm, in the order A B B A: T(b, n) (tide.engine.profiling: one target forward of n new tokens
for each of b sequences, a verification's cost) and greedy decoding at batch 1 of --prompts, plain
and with the hybrid drafter (a chain of γ = 4, a 5:3:8 tree): tokens/s and accept length. Refuses
to run where the CPU or the OS gives no AMX.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from benchmarks.engine import SPEC_MAX_LEN, decode_all
from benchmarks.report import cpu_name
from tide import kernels
from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.drafters.hybrid import HybridDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.profiling import profile_target
from tide.policies import FixedGamma, FixedTree
from tide.prompts import encode_prompt, load_prompts
from tide.target import load_tokenizer, resolve_target

ARMS = {"amx": True, "avx512": False}
BATCHES, NS = (1, 16), (1, 2, 4, 8, 16)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True, help="EAGLE-3 checkpoint directory")
    ap.add_argument("--prompts", nargs="+", default=["gsm8k_test.jsonl", "humaneval.jsonl.gz"])
    ap.add_argument("--per-file", type=int, default=8, help="prompts from each file")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    ops = kernels.ops()
    if ops is None or not ops.has_amx:
        print("no AMX here (CPU, build or OS): nothing to compare", file=sys.stderr)
        return 2
    target = resolve_target("ref")
    model = LlamaModel.load(target, dtype=torch.bfloat16)
    tok = load_tokenizer(target)
    prompts = [encode_prompt(tok, p) for f in args.prompts for p in load_prompts(f, limit=args.per_file)]
    eagle = Eagle3Drafter.from_checkpoint(args.draft, model, "draft", 1, SPEC_MAX_LEN + 16)
    cfg = EngineConfig(max_batch=1, max_seq_len=SPEC_MAX_LEN)
    engines = {"plain": lambda: LLMEngine(model, cfg),
               "chain γ=4": lambda: LLMEngine(model, cfg, drafter=HybridDrafter(eagle), policy=FixedGamma(4)),
               "tree 5:3:8": lambda: LLMEngine(model, cfg, drafter=HybridDrafter(eagle), policy=FixedTree(5, 3, 8))}
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    try:
        for arm in ("amx", "avx512", "avx512", "amx"):
            ops.set_amx(ARMS[arm])
            assert ops.amx_enabled() == ARMS[arm]
            run = {"T_ms": profile_target(model, BATCHES, NS, args.reps)}
            for name, make in engines.items():
                run[name] = decode_all(make(), prompts, args.max_tokens)
            runs[arm].append(run)
            print(f"{arm:7s} T(1, n) {run['T_ms'][1]}  " + "  ".join(
                f"{k} {run[k]['tok_s']:.1f} tok/s ({run[k]['accept_length']:.2f})" for k in engines), flush=True)
    finally:
        ops.set_amx(True)
    summary = {}
    for arm, rs in runs.items():
        summary[arm] = {"T_ms": {b: {n: round(statistics.fmean(r["T_ms"][b][n] for r in rs), 3) for n in NS}
                                 for b in BATCHES},
                        **{k: {"tok_s": round(statistics.fmean(r[k]["tok_s"] for r in rs), 2),
                               "accept_length": rs[0][k]["accept_length"]} for k in engines}}
        for k in engines:
            if k != "plain":
                summary[arm][k]["x_plain"] = round(summary[arm][k]["tok_s"] / summary[arm]["plain"]["tok_s"], 3)
    print(f"\n{'':14s}" + "".join(f"{arm:>12s}" for arm in ARMS) + "   amx / avx512")
    for b in BATCHES:
        for n in NS:
            a, v = (summary[arm]["T_ms"][b][n] for arm in ARMS)
            print(f"T({b:2d}, {n:2d}) ms  {a:12.2f}{v:12.2f}   {a / v:.2f}")
    for k in engines:
        a, v = (summary[arm][k]["tok_s"] for arm in ARMS)
        extra = "".join(f"   x plain {summary[arm][k]['x_plain']:.3f} ({arm})" for arm in ARMS) if k != "plain" else ""
        print(f"{k:12s} tok/s {a:10.1f}{v:12.1f}   {a / v:.2f}{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "threads": torch.get_num_threads(), "draft": args.draft,
                       "prompts": args.prompts, "per_file": args.per_file, "max_tokens": args.max_tokens,
                       "order": "amx avx512 avx512 amx", "arms": summary}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

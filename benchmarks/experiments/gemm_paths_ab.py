"""tide.kernels' GEMM on a CPU with AVX-512F but not AVX512_BF16 (Skylake-SP to Ice Lake servers):
its AVX-512F tiles against the AVX2 tiles it used before, side by side in one process.

    python -m benchmarks.experiments.gemm_paths_ab --json docs/results/engine-step/avx512f-gemm-ab.json

Builds the same kernel sources a second time with `-mno-avx512f` (the AVX2 tiles, ~1 minute, under
$TIDE_CACHE_DIR/kernels/<key>-avx2), checks that both give the same bits on the reference model's
projection shapes at 1-33 rows (bf16 and int8), then swaps one build for the other under one loaded
model (the packed weights are the same layout on both) and measures, in the order A B B A:
T(b, n) (tide.engine.profiling: a target forward of n tokens each for b sequences, the cost of a
verification), and greedy plain
decoding at batch 1 and 16. Refuses to run where the machine has AVX512_BF16 (another path) or
no AVX-512F.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys

import torch

from benchmarks.engine import decode_all
from benchmarks.report import cpu_name
from tide import kernels
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.profiling import profile_target
from tide.prompts import encode_prompt, load_prompts
from tide.target import load_tokenizer, resolve_target

SHAPES = [(960, 576), (3072, 576), (576, 1536), (49152, 576)]  # qkv, gate|up, down, lm_head (N, K)


def _flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())


def build_avx2():
    from torch.utils import cpp_extension

    path = kernels.build_dir().with_name(kernels.build_dir().name + "-avx2")
    path.mkdir(parents=True, exist_ok=True)
    sources = []
    for original in kernels.SOURCES + kernels.HEADERS:
        shutil.copy(original, path / original.name)
        if original in kernels.SOURCES:
            sources.append(str(path / original.name))
    module = cpp_extension.load(name="tide_cpu_ops_avx2", sources=sources,
                                extra_cflags=kernels.FLAGS + ["-mno-avx512f"], extra_ldflags=["-fopenmp"],
                                build_directory=str(path), verbose=False)
    module.set_pool(kernels.pool_wanted())
    return module


def same_bits(a, b) -> int:
    """Outputs compared (bf16 and int8, every shape, 1-33 rows); raises where any differs."""
    g = torch.Generator().manual_seed(0)
    checked = 0
    for n, k in SHAPES:
        w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale, bias = torch.rand(n, generator=g), torch.randn(n, generator=g)
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 17, 33):
            x = (torch.randn(m, k, generator=g) * 2).to(torch.bfloat16)
            for name, ya, yb in (
                ("bf16", a.bf16_linear(x, a.bf16_pack(w), None), b.bf16_linear(x, b.bf16_pack(w), None)),
                ("int8", a.int8_linear(x, a.int8_pack(q), scale, bias), b.int8_linear(x, b.int8_pack(q), scale, bias)),
            ):
                if not torch.equal(ya, yb):
                    raise SystemExit(f"different bits: {name} {n}x{k}, {m} rows")
                checked += 1
    return checked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="gsm8k_test.jsonl")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    flags = _flags()
    if "avx512f" not in flags or "avx512_bf16" in flags:
        sys.exit("this compares the AVX-512F and AVX2 tiles: it needs AVX-512F without AVX512_BF16")
    avx512 = kernels.ops()
    avx2 = build_avx2()
    checked = same_bits(avx2, avx512)
    print(f"same bits: {checked} outputs", flush=True)
    target = resolve_target("ref")
    model = LlamaModel.load(target, dtype=torch.bfloat16)
    tok = load_tokenizer(target)
    prompts = [encode_prompt(tok, p) for p in load_prompts(args.prompts, limit=args.limit)]
    arms = {"avx2": avx2, "avx512f": avx512}
    runs: dict[str, list[dict]] = {k: [] for k in arms}
    for name in ("avx2", "avx512f", "avx512f", "avx2"):
        kernels._state["ops"] = arms[name]  # the layer code asks kernels.ops() at every call
        table = profile_target(model, [1, 16], [1, 2, 4, 8], reps=10)
        r = {f"T{b}_{n}_ms": table[b][n] for b in (1, 16) for n in ((1, 2, 4, 8) if b == 1 else (1, 2))}
        for b in (1, 16):
            engine = LLMEngine(model, EngineConfig(max_batch=b, max_seq_len=2048))
            r[f"plain_b{b}_tok_s"] = decode_all(engine, prompts, args.max_tokens)["tok_s"]
        runs[name].append(r)
        print(name, r, flush=True)
    kernels._state["ops"] = avx512
    mean = {k: {m: round(statistics.fmean(r[m] for r in v), 2) for m in v[0]} for k, v in runs.items()}
    out = {"cpu": cpu_name(), "same_bits_outputs": checked, "prompts": args.prompts, "limit": args.limit,
           "max_tokens": args.max_tokens, "runs": runs, "mean": mean,
           "avx512f_over_avx2": {m: round(mean["avx512f"][m] / mean["avx2"][m], 3) for m in mean["avx2"]}}
    print(json.dumps(out["avx512f_over_avx2"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

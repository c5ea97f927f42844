"""Prompts on quantized projections against their bf16 copies (TIDE_PREFILL_WEIGHTS), side by side.

    python -m benchmarks.experiments.prefill_weights_ab --target FILE.gguf [--weights int8] [--prompt-tokens 512]

The same target loaded twice in this process, with prefill_weights "float" (bf16 copies of every
projection for prompts) and "shared" (prompts on the int8 / int4 ones); each round prefills the
same prompts (random token ids, one token generated) on both, in alternating order. Reports the
median prompt tokens/s of each and the median per-round ratio shared / float, and the weight
memory each holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.sequence import SamplingParams
from tide.memory import tensor_bytes
from tide.precision import resolve_weights
from tide.target import resolve_target


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--weights", default="int8", choices=["int8", "int4"])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    dtype, fmt = resolve_weights(args.weights)
    target = resolve_target(args.target)
    models = {mode: LlamaModel.load(target, dtype=dtype, weight_format=fmt, prefill_weights=mode)
              for mode in ("float", "shared")}
    vocab = models["float"].cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    rates: dict[str, list[float]] = {m: [] for m in models}
    for r in range(args.rounds + 1):  # round 0 warms both up, not counted
        for mode in (["float", "shared"] if r % 2 else ["shared", "float"]):
            engine = LLMEngine(models[mode], EngineConfig(max_batch=1, max_seq_len=args.prompt_tokens + 64))
            t0 = time.perf_counter()
            engine.generate(prompts, params)
            if r:
                rates[mode].append(args.prompts * args.prompt_tokens / (time.perf_counter() - t0))
    out = {"target": args.target, "weights": args.weights, "prompt_tokens": args.prompt_tokens,
           "rounds": args.rounds,
           **{f"{m}_prompt_tok_s": round(statistics.median(v), 1) for m, v in rates.items()},
           "shared_over_float": round(statistics.median(a / b for a, b in zip(rates["shared"], rates["float"],
                                                                               strict=True)), 3),
           **{f"{m}_weights_mb": round(tensor_bytes(mod) / 2**20) for m, mod in models.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

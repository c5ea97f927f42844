"""Where a long speculation-memory run's steps go, window by window, on the engine alone.

    python -m benchmarks.experiments.memory_late [--requests 900] [--windows 6] [--modes default+memory]

Serves the repetitive horizon's request stream (benchmarks.adapt_horizon.repetitive_prompts, seed 0) at
4 streams of continuous batching on one engine (the reference model, the starter EAGLE-3 draft with
prompt lookup under the adaptive γ policy, as the worker serves it), with or without a speculation
memory, and splits the run into windows of equal step counts. Per window: tokens/s, steps/s, the
mean of each step's verify / draft / other ms, the verify width (1 + the batch's deepest draft),
the batch size, prefill tokens, the memory's size and the cyclic GC's time. No services: what it
shows is the engine's own, apart from the trainer, collection and the status calls of a served run.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

from benchmarks.adapt_horizon import repetitive_prompts
from benchmarks.speculation_memory import STARTER
from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.drafters.hybrid import HybridDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.sequence import SamplingParams
from tide.policies.registry import make_policy
from tide.precision import resolve_weights
from tide.prompts import encode_prompt
from tide.target import load_tokenizer, resolve_target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=900)
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--memory-mb", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=["default+memory", "default"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    target = resolve_target("ref")
    dtype, weights = resolve_weights("auto", "auto")
    model = LlamaModel.load(target, dtype=dtype, weight_format=weights)
    tok = load_tokenizer(target)
    prompts = [encode_prompt(tok, p) for p in repetitive_prompts(0)[0][:args.requests]]  # the horizon's, seed 0
    out = {"requests": args.requests, "max_tokens": args.max_tokens, "modes": {}}
    for mode in args.modes:
        out["modes"][mode] = one_mode(model, target, prompts, mode, args)
        print(mode, "overall", out["modes"][mode]["tok_s"], "tok/s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


def one_mode(model, target, prompts: list[list[int]], mode: str, args) -> dict:
    """Serve `prompts` with `mode`'s engine; its overall tok/s and the per-window rows."""
    from services.inference.app import start_profile
    from services.inference.settings import InferenceSettings

    mb = args.memory_mb if mode == "default+memory" else 0
    profile = start_profile(InferenceSettings(drafter="eagle3", speculation_memory_mb=mb), model, target.model_id)
    eagle = Eagle3Drafter.from_checkpoint(STARTER, model, "starter", 4, 2048 + 16)
    engine = LLMEngine(model, EngineConfig(max_batch=4, max_seq_len=2048, speculation_memory_mb=mb),
                       drafter=HybridDrafter(eagle), policy=make_policy("adaptive", {}, profile))
    steps: list[tuple] = []
    gc_ms, gc_t = [0.0], [0.0]

    def on_gc(phase, info) -> None:
        if phase == "start":
            gc_t[0] = time.perf_counter()
        else:
            gc_ms[0] += (time.perf_counter() - gc_t[0]) * 1e3

    def on_step(rec) -> None:
        emitted = sum(a + 1 for a in rec.accepted) if rec.gammas else 0
        width = 1 + max(rec.gammas, default=0)
        mem = engine.memory.tokens if engine.memory is not None else 0
        steps.append((time.perf_counter(), emitted, rec.batch_size, width, rec.verify_ms, rec.draft_ms,
                      rec.other_ms, rec.prefill_tokens, mem, gc_ms[0],
                      sum(1 for s in rec.sources if s == "memory")))

    engine.step_listeners.append(on_step)
    gc.callbacks.append(on_gc)
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens))
    wall = time.perf_counter() - t0
    gc.callbacks.remove(on_gc)
    total = sum(s.num_output for s in seqs)
    rows = []
    n = len(steps)
    prev_t, prev_gc = t0, 0.0
    for w in range(args.windows):
        part = steps[w * n // args.windows:(w + 1) * n // args.windows]
        t_end, gc_end = part[-1][0], part[-1][9]
        k = len(part)
        row = {
            "steps": k,
            "seconds": round(t_end - prev_t, 2),
            "tok_s": round(sum(p[1] for p in part) / (t_end - prev_t), 1),
            "steps_s": round(k / (t_end - prev_t), 1),
            "verify_ms": round(sum(p[4] for p in part) / k, 2),
            "draft_ms": round(sum(p[5] for p in part) / k, 2),
            "other_ms": round(sum(p[6] for p in part) / k, 2),
            "unaccounted_ms": round(((t_end - prev_t) * 1e3 - sum(p[4] + p[5] + p[6] for p in part)) / k, 2),
            "width": round(sum(p[3] for p in part) / k, 2),
            "batch": round(sum(p[2] for p in part) / k, 2),
            "prefill_tokens_per_step": round(sum(p[7] for p in part) / k, 1),
            "memory_tokens": part[-1][8],
            "memory_recalls_per_step": round(sum(p[10] for p in part) / k, 2),
            "gc_ms": round(gc_end - prev_gc, 1),
        }
        prev_t, prev_gc = t_end, gc_end
        rows.append(row)
        print(mode, json.dumps(row), flush=True)
    return {"tok_s": round(total / wall, 1), "wall_s": round(wall, 1), "windows": rows}


if __name__ == "__main__":
    raise SystemExit(main())

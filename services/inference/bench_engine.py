"""`tide bench engine`: the engine's latency table, speculative throughput and overheads, one run.

Everything is measured side by side in one process on the same model, dtype and machine:
T(n) target forward latency, D0 draft step latency, the catch-up (switching) cost table,
tokens/s for γ ∈ {0..5} × batch {1, 4, 16} with the n-gram and EAGLE-3 drafters, plain decode
against transformers' `generate`, and the cost of hidden-state capture + hand-off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from services.inference.engine.drafters import NgramDrafter
from services.inference.engine.drafters.eagle3 import Eagle3Drafter
from services.inference.engine.engine import CapturedRows, EngineConfig, LLMEngine
from services.inference.engine.llama import LlamaModel
from services.inference.engine.sequence import SamplingParams
from services.inference.profiling import CONTEXT, profile_draft, profile_target, random_draft
from tide.policies import FixedGamma
from tide.prompts import encode_prompt, load_prompts
from tide.target import load_tokenizer, resolve_target


def throughput(engine: LLMEngine, prompts: list[list[int]], max_tokens: int,
               ignore_eos: bool = False) -> tuple[float, float, int]:
    """(output tokens/s, mean accept length over speculative steps, output tokens) for one batch."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    out = sum(s.num_output for s in seqs)
    steps = sum(s.verify_steps for s in seqs)
    acc = (sum(s.accepted_tokens for s in seqs) + steps) / steps if steps else 1.0
    return out / dt, acc, out


def plain_vs_hf(model: LlamaModel, target, prompt: list[int], tokens: int, rounds: int) -> tuple[float, float]:
    """Median tokens/s of (this engine, transformers' generate): batch 1, greedy, exactly `tokens`
    new tokens each, same model files and dtype, runs alternated so machine load hits both alike."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target.path, dtype=model.dtype).eval()
    ids = torch.tensor([prompt])
    engine = LLMEngine(model, EngineConfig(max_batch=1, max_seq_len=1024))
    ours, theirs = [], []
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up both
        throughput(engine, [prompt], 4)
        for _ in range(rounds):
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            theirs.append(tokens / (time.perf_counter() - t0))
            ours.append(throughput(engine, [prompt], tokens, ignore_eos=True)[0])
    return statistics.median(ours), statistics.median(theirs)


def capture_overhead(model: LlamaModel, prompts, batch: int, max_tokens: int, rounds: int) -> float:
    """1 - (tok/s with a capture listener copying rows to host buffers) / (tok/s without), interleaved."""
    sink: list[torch.Tensor] = []

    def listener(rows: list[CapturedRows]) -> None:
        for r in rows:  # the exporter's hand-off: copy accepted rows out of the engine's tensors
            sink.append(torch.cat([r.aux, r.final], dim=-1).to("cpu", copy=True))
        if len(sink) > 256:
            sink.clear()

    cfg = EngineConfig(max_batch=batch, max_seq_len=1024)
    off, on = [], []
    for _ in range(rounds):
        for mode, acc in (("off", off), ("on", on)):
            engine = LLMEngine(model, cfg, drafter=NgramDrafter(), policy=FixedGamma(0))
            if mode == "on":
                engine.capture_listeners.append(listener)
            acc.append(throughput(engine, prompts[:batch], max_tokens)[0])
    return round(1 - statistics.median(on) / statistics.median(off), 4)


def run(args) -> dict:
    t_start = time.perf_counter()
    target = resolve_target(args.target)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = LlamaModel.load(target, dtype=dtype)
    tok = load_tokenizer(target)
    prompts = [encode_prompt(tok, p) for p in load_prompts(args.prompts, limit=32)]
    quick = args.quick
    reps = 5 if quick else 15
    batches, gammas = [1, 4, 16], list(range(6))
    max_tokens = 32 if quick else 96
    res: dict = {"target": target.model_id, "dtype": args.dtype, "threads": torch.get_num_threads(),
                 "quick": quick, "max_tokens": max_tokens}
    res["T_ms"] = profile_target(model, batches, [1, 2, 4, 8, 16, 32, 64], reps)
    if args.draft:
        drafter = Eagle3Drafter.from_checkpoint(args.draft, model, Path(args.draft).name, 16, 1200)
        res["eagle3_draft"] = str(args.draft)
    else:
        drafter = Eagle3Drafter(random_draft(model), "random", 16, 1200)
        res["eagle3_draft"] = "random (untrained: latency only; acceptance ~0)"
    res["D_ms"], res["switch_ms"] = profile_draft(drafter, model, batches, [1, 4, 16, 64, 256], reps)
    res["D0_ms"] = res["D_ms"][1]
    cfg = EngineConfig(max_batch=16, max_seq_len=1024)
    throughput(LLMEngine(model, cfg), prompts[:16], 8)  # warm-up: kernel JIT for the batch shapes
    res["spec"] = []
    for b in batches:
        base = None
        for name, make in (("ngram", NgramDrafter), ("eagle3", lambda: drafter)):
            for g in gammas:
                if g == 0 and base is not None:
                    tok_s, acc = base
                else:
                    engine = LLMEngine(model, cfg, drafter=make(), policy=FixedGamma(g))
                    tok_s, acc, _ = throughput(engine, prompts[:b], max_tokens)
                    if g == 0:
                        base = (tok_s, acc)
                res["spec"].append({"drafter": name, "gamma": g, "batch": b, "tok_s": round(tok_s, 2),
                                    "accept_length": round(acc, 3)})
                print(f"  {name:6s} γ={g} b={b:2d}: {tok_s:7.1f} tok/s  accept {acc:.2f}", flush=True)
    ours, theirs = plain_vs_hf(model, target, prompts[0], 64, 3 if quick else 7)
    res["plain_tok_s"], res["hf_generate_tok_s"] = round(ours, 2), round(theirs, 2)
    res["plain_vs_hf"] = round(ours / theirs, 3)
    res["capture_overhead"] = {b: capture_overhead(model, prompts, b, max_tokens, 2 if quick else 4) for b in (1, 16)}
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    return res


def print_table(res: dict) -> None:
    print(f"\nT(n) ms at {CONTEXT} cached tokens (rows: batch; cols: new tokens per sequence)")
    ns = list(next(iter(res["T_ms"].values())).keys())
    print("  b\\n " + "".join(f"{n:>8}" for n in ns))
    for b, row in res["T_ms"].items():
        print(f"  {b:>3} " + "".join(f"{row[n]:8.1f}" for n in ns))
    print(f"D(b) ms: {res['D_ms']}   catch-up ms by lag: {res['switch_ms']}")
    print(f"plain {res['plain_tok_s']} tok/s vs HF generate {res['hf_generate_tok_s']} tok/s "
          f"-> {res['plain_vs_hf']}x;  capture overhead {res['capture_overhead']}")


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    parser = parser or argparse.ArgumentParser(prog="tide bench engine", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_cli(args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and tokens (< 5 min)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--target", default="ref")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--draft", help="EAGLE-3 checkpoint dir (default: a random draft, latency only)")
    parser.add_argument("--prompts", default="spec_bench_questions.jsonl")


def run_cli(args) -> int:
    res = run(args)
    print_table(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")
    return 0

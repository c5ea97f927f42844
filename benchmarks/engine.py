"""`tide bench engine`: the engine's latency table, speculative throughput and overheads, one run.

Everything is measured side by side in one process on the same model, dtype and machine:
T(n) target forward latency, D0 draft step latency, the catch-up (switching) cost table,
tokens/s for γ ∈ {0..5} × batch {1, 4, 16} with the n-gram and EAGLE-3 drafters, plain decode
against transformers' `generate`, and the cost of hidden-state capture + hand-off.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import resource
import statistics
import time
import uuid
from pathlib import Path

import torch

from benchmarks.report import cpu_name, write_json
from services.inference.exporter import ChunkExporter
from tide.engine.drafters import NgramDrafter
from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.engine import CapturedRows, EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.profiling import CONTEXT, profile_draft, profile_latency, profile_target, random_draft
from tide.engine.sequence import SamplingParams
from tide.memory import rss_bytes
from tide.policies import FixedGamma, FixedTree, TreeShape
from tide.precision import DTYPE_NAMES, WEIGHTS_NAMES, dtype_name, native_bf16, resolve_weights
from tide.prompts import encode_prompt, load_prompts
from tide.streams import StreamNames
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


# Room for the longest prompts of the public sets (Spec-Bench's summaries run to ~1.1k tokens) and
# the output; longer prompts are left out of the speculation rows.
SPEC_MAX_LEN = 2048
DRAFTERS = ("ngram", "eagle3", "hybrid")  # hybrid: EAGLE-3 with prompt lookup (tide/engine/drafters/hybrid.py)
# hybrid+memory (--drafters, not a default): the hybrid with a speculation memory of the run's
# earlier requests (--speculation-memory-mb; tide/engine/drafters/memory.py)
KNOWN_DRAFTERS = (*DRAFTERS, "hybrid+memory")
TREE_DRAFTERS = ("eagle3", "hybrid", "hybrid+memory")  # the drafters that grow draft trees (propose_tree)


def decode_all(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Greedy decoding of every prompt with the engine's batch (max_batch in flight, continuous
    batching; batch 1: one after another): tok/s over the whole run, accept length over the
    speculative steps (bonus token included), mean γ, the mean draft / verify ms of a step, and per
    source of drafts (the hybrid's copies and draft chains) its drafting steps and accept length."""
    steps: list = []

    def on_step(rec) -> None:
        if rec.batch_size:
            steps.append(rec)

    engine.step_listeners.append(on_step)
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    dt = time.perf_counter() - t0
    engine.step_listeners.remove(on_step)
    out = sum(s.num_output for s in seqs)
    spec = sum(s.verify_steps for s in seqs)
    gammas = [g for rec in steps for g in rec.gammas]
    by_source: dict[str, list[int]] = {}  # drafting requests' accept lengths per source of their drafts
    for rec in steps:
        for g, a, src in zip(rec.gammas, rec.accepted, rec.sources or [rec.drafter] * len(rec.gammas), strict=False):
            if g > 0:
                by_source.setdefault(src, []).append(a + 1)
    return {"tok_s": round(out / dt, 2), "output_tokens": out,
            "accept_length": round((sum(s.accepted_tokens for s in seqs) + spec) / spec, 3) if spec else 1.0,
            "gamma_mean": round(statistics.fmean(gammas), 2) if gammas else 0.0,
            "draft_ms": round(statistics.fmean(r.draft_ms for r in steps), 3) if steps else 0.0,
            "verify_ms": round(statistics.fmean(r.verify_ms for r in steps), 3) if steps else 0.0,
            "by_source": {k: {"steps": len(v), "accept_length": round(statistics.fmean(v), 3)}
                          for k, v in sorted(by_source.items())}}


def spec_sweep(model: LlamaModel, eagle: Eagle3Drafter, prompts: list[list[int]], batches: list[int],
               gammas: list[int], drafters: list[str], max_tokens: int, profile,
               trees: list[TreeShape] = (), memory_mb: int = 64) -> list[dict]:
    """Rows per #30's interface: per batch, plain decoding (γ = 0), each drafter at each γ (chains:
    `tree` null), each drafter that grows trees at each tree shape (`gamma` its depth, `tree`
    {"topk", "tokens"}), and the adaptive γ policy on the last drafter listed (`"policy": "adaptive"`).
    Plain runs first and last in each batch; its tok/s is the mean of the two (drift over the sweep
    hits the ratios `x_plain` less), each run decodes every prompt."""
    from tide.engine.drafters.hybrid import HybridDrafter
    from tide.policies.registry import make_policy

    make = {"ngram": NgramDrafter, "eagle3": lambda: eagle, "hybrid": lambda: HybridDrafter(eagle),
            "hybrid+memory": lambda: HybridDrafter(eagle)}
    rows: list[dict] = []
    for b in batches:
        base = EngineConfig(max_batch=b, max_seq_len=min(SPEC_MAX_LEN, model.cfg.max_position_embeddings))
        # Each run starts with an empty memory: it learns from that run's earlier requests only.
        with_memory = dataclasses.replace(base, speculation_memory_mb=memory_mb)

        def config(name: str, base=base, with_memory=with_memory) -> EngineConfig:
            return with_memory if name == "hybrid+memory" else base

        cfg = base
        runs: list[tuple[dict, dict]] = []
        plain = decode_all(LLMEngine(model, cfg), prompts, max_tokens)
        for name in drafters:
            for g in gammas:
                if g > 0:
                    key = {"drafter": name, "batch": b, "gamma": g, "tree": None}
                    runs.append((key, decode_all(LLMEngine(model, config(name), drafter=make[name](),
                                                           policy=FixedGamma(g)), prompts, max_tokens)))
                    print(f"  {name:6s} γ={g} b={b:2d}: {runs[-1][1]['tok_s']:7.1f} tok/s  accept "
                          f"{runs[-1][1]['accept_length']:.2f}", flush=True)
            for shape in trees if name in TREE_DRAFTERS else ():
                key = {"drafter": name, "batch": b, "gamma": shape.depth,
                       "tree": {"topk": shape.topk, "tokens": shape.tokens}}
                policy = FixedTree(shape.depth, shape.topk, shape.tokens)
                runs.append((key, decode_all(LLMEngine(model, config(name), drafter=make[name](), policy=policy),
                                             prompts, max_tokens)))
                print(f"  {name:6s} tree {shape.key()} b={b:2d}: {runs[-1][1]['tok_s']:7.1f} tok/s  accept "
                      f"{runs[-1][1]['accept_length']:.2f}", flush=True)
        if drafters:
            policy = make_policy("adaptive", {}, profile)
            key = {"drafter": drafters[-1], "batch": b, "gamma": None, "tree": None, "policy": "adaptive"}
            runs.append((key, decode_all(LLMEngine(model, config(drafters[-1]), drafter=make[drafters[-1]](),
                                                   policy=policy), prompts, max_tokens)))
        again = decode_all(LLMEngine(model, cfg), prompts, max_tokens)
        plain["tok_s"] = round((plain["tok_s"] + again["tok_s"]) / 2, 2)
        rows.append({"drafter": "none", "batch": b, "gamma": 0, "tree": None, **plain, "x_plain": 1.0})
        rows += [{**key, **r, "x_plain": round(r["tok_s"] / plain["tok_s"], 3)} for key, r in runs]
        adaptive = f"; adaptive: {rows[-1]['tok_s']:7.1f} tok/s (mean γ {rows[-1]['gamma_mean']})" if drafters else ""
        print(f"  plain b={b:2d}: {plain['tok_s']:7.1f} tok/s{adaptive}", flush=True)
    return rows


def print_spec(res: dict) -> None:
    print(f"\nspeculation, greedy, {res['spec_prompts']} prompts of {' '.join(res['prompts'])}, "
          f"{res['max_tokens']} tokens each "
          f"(batch 1: one after another), draft {res['eagle3_draft']}")
    print(f"  {'drafter':8s} {'batch':>5} {'γ':>8} {'tok/s':>8} {'x plain':>8} {'accept':>7} {'draft ms':>9} "
          f"{'verify ms':>9}")
    for r in res["spec"]:
        g = r.get("policy") or r["gamma"]
        print(f"  {r['drafter']:8s} {r['batch']:5d} {g!s:>8} {r['tok_s']:8.1f} {r['x_plain']:8.3f} "
              f"{r['accept_length']:7.2f} {r['draft_ms']:9.2f} {r['verify_ms']:9.2f}")


def plain_vs_hf(model: LlamaModel, target, prompt: list[int], tokens: int, rounds: int) -> tuple[float, float, float]:
    """(median tokens/s of this engine, of transformers' generate, median of the per-round ratios):
    batch 1, greedy, exactly `tokens` new tokens each, same model files and dtype. The two run
    back to back in every round (order flipped each round), and the ratio is taken within a round:
    this VM's speed moves by 10-40 % over minutes, which a ratio of overall medians would take in."""

    hf = target.transformers_model(model.dtype).eval()
    ids = torch.tensor([prompt])
    # Every round repeats the prompt: without this only our side would skip its prefill (HF keeps no cache).
    engine = LLMEngine(model, EngineConfig(max_batch=1, max_seq_len=1024, prefix_cache=False))

    def run_hf() -> float:
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        return tokens / (time.perf_counter() - t0)

    def run_ours() -> float:
        return throughput(engine, [prompt], tokens, ignore_eos=True)[0]

    ours, theirs = [], []
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up both
        throughput(engine, [prompt], 4)
        for r in range(rounds):
            if r % 2 == 0:
                theirs.append(run_hf())
                ours.append(run_ours())
            else:
                ours.append(run_ours())
                theirs.append(run_hf())
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return statistics.median(ours), statistics.median(theirs), statistics.median(ratios)


# Rows per chunk here: a quarter of the worker's default (2048), so several chunks are encoded and
# uploaded *during* the measured runs at batch 1 too (a pessimistic flush rate, not a flattering one).
CHUNK_ROWS = 512


@contextlib.contextmanager
def chunk_exporter(model: LlamaModel, model_id: str):
    """The worker's real hand-off: a ChunkExporter writing checksummed chunks to S3 and refs to a
    Redis stream, on local servers started here (or TIDE_S3_ENDPOINT / TIDE_REDIS_URL when set)."""
    from tide import blobs
    from tide.servers import local_data_plane

    with contextlib.ExitStack() as stack:
        env = local_data_plane(stack, dict(os.environ))
        storage = blobs.StorageSettings.from_env(env)
        client = storage.s3_client()
        blobs.ensure_bucket(client, storage.s3_bucket)
        exporter = ChunkExporter(client, storage.s3_bucket, storage.redis_client(),
                                 StreamNames(f"bench-{uuid.uuid4().hex[:8]}").chunks, target_model=model_id,
                                 worker_id="bench", hidden_size=model.cfg.hidden_size,
                                 chunk_tokens=CHUNK_ROWS).start()
        stack.callback(exporter.stop)
        yield exporter


def capture_overhead(model: LlamaModel, exporter, prompts, batch: int, max_tokens: int, rounds: int) -> dict:
    """Cost of hidden-state capture + hand-off on plain decode (γ = 0, greedy, EOS ignored).

    One engine serves alternating off/on runs (order flipped every round, so drift hits both
    alike); "on" attaches the worker's capture hook, `ChunkExporter.add`, whose background flusher
    encodes chunks and writes them to S3 and Redis while the engine decodes. Both modes decode the
    same tokens, so tokens per step are equal and the tokens/s ratio is the inverse ratio of step
    latencies. Both figures are medians over rounds of a ratio taken within the round, so that
    speed swings of this shared VM (it alternates between ≈ 15 and ≈ 25 ms steps at batch 1 for
    minutes at a time) hit both sides of every ratio alike: `overhead` from each mode's median
    full-batch decode step, `overhead_wall` from whole-run tokens/s."""
    def hand_off(rows: list[CapturedRows]) -> None:
        exporter.add(rows, {r.request_id: r.num_prompt for r in rows})

    steps: list[float] = []

    def on_step(rec) -> None:
        if rec.batch_size == batch and not rec.prefill_tokens:
            steps.append(rec.draft_ms + rec.verify_ms + rec.other_ms)

    engine = LLMEngine(model, EngineConfig(max_batch=batch, max_seq_len=1024), drafter=NgramDrafter(),
                       policy=FixedGamma(0))
    engine.step_listeners.append(on_step)
    throughput(engine, prompts[:batch], 8, ignore_eos=True)  # warm-up: touch the KV cache pages
    before = exporter.stats.tokens_exported
    wall: dict[str, list[float]] = {"off": [], "on": []}
    step_ms: dict[str, list[float]] = {"off": [], "on": []}  # per round: the mode's median step
    for r in range(rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            if mode == "on":
                engine.capture_listeners.append(hand_off)
            steps.clear()
            wall[mode].append(throughput(engine, prompts[:batch], max_tokens, ignore_eos=True)[0])
            step_ms[mode].append(statistics.median(steps))
            engine.capture_listeners.clear()
    exporter.flush_soon()
    exporter.wait_idle(60)
    step_ratio = [off / on for on, off in zip(step_ms["on"], step_ms["off"], strict=True)]
    wall_ratio = [on / off for on, off in zip(wall["on"], wall["off"], strict=True)]
    return {"overhead": round(1 - statistics.median(step_ratio), 4),
            "overhead_wall": round(1 - statistics.median(wall_ratio), 4),
            "step_ms_off": round(statistics.median(step_ms["off"]), 3),
            "step_ms_on": round(statistics.median(step_ms["on"]), 3), "rounds": rounds,
            "rows_exported": exporter.stats.tokens_exported - before}


def kernels_ab(model: LlamaModel, baseline: LlamaModel, prompts: list[list[int]], max_tokens: int,
               rounds: int, float32: LlamaModel | None = None) -> dict:
    """Plain greedy decoding, tok/s, the engine's CPU paths side by side in one process:
    `torch_ops` (torch ops, oneDNN or torch's own GEMMs: the engine before tide.kernels),
    `fused_ops` (the fused elementwise kernels, the same GEMMs, one Python call an op) and
    `kernels` (what serves: the kernels' GEMMs too, and one call a decoder layer). `baseline` is
    the same model loaded under `tide.kernels.disabled()` (its projections built without the
    kernels' GEMMs). `float32`, where given: the model in float32 on torch ops (`fp32_torch_ops`,
    "auto"'s choice on a CPU without native bf16 before the kernels' AVX2 GEMM). Batch 1 (4 prompts
    one after another) and 16; every round runs each variant once, in rotated order; medians of
    tok/s and of the per-round ratios to the first variant."""
    from tide import kernels

    variants = {"torch_ops": (baseline, False), "fused_ops": (baseline, True), "kernels": (model, True)}
    if float32 is not None:
        variants["fp32_torch_ops"] = (float32, False)
    out: dict = {"rounds": rounds, "max_tokens": max_tokens, "kernels_built": kernels.ops() is not None,
                 "gemm": getattr(model.layers[0][1], "kind", "?"), "baseline_gemm": getattr(baseline.layers[0][1],
                                                                                              "kind", "?")}
    for b, batch_prompts in ((1, prompts[:4]), (16, prompts[:16])):
        tok_s: dict[str, list[float]] = {k: [] for k in variants}
        engine_cfg = EngineConfig(max_batch=b, max_seq_len=1024)
        for r in range(rounds + 1):  # round 0 warms every variant up, not counted
            names = list(variants)
            names = names[r % len(names):] + names[:r % len(names)]
            for name in names:
                m, on = variants[name]
                with contextlib.nullcontext() if on else kernels.disabled():
                    rate = throughput(LLMEngine(m, engine_cfg), batch_prompts, max_tokens, ignore_eos=True)[0]
                if r:
                    tok_s[name].append(rate)
        base = tok_s["torch_ops"]
        out[f"batch_{b}"] = {
            name: {"tok_s": round(statistics.median(v), 2),
                   "x_torch_ops": round(statistics.median(a / c for a, c in zip(v, base, strict=True)), 3)}
            for name, v in tok_s.items()}
        print(f"  batch {b:2d}: " + ", ".join(f"{n} {d['tok_s']} tok/s ({d['x_torch_ops']}x)"
                                              for n, d in out[f"batch_{b}"].items()), flush=True)
    return out


# A stand-in for the processes that share a small machine with the engine (the gateway, the client,
# the worker's gRPC threads: ~1.5 ms of CPU a token at one stream): busy 1.5 ms every 12 ms.
_BUSY = ("import time\nwhile True:\n    t = time.perf_counter()\n    while time.perf_counter() - t < 0.0015: pass\n"
         "    time.sleep(0.0105)\n")


def pool_ab(model: LlamaModel, prompts: list[list[int]], max_tokens: int, rounds: int) -> dict:
    """Plain greedy decoding at batch 1 (the prompts one after another), tok/s, with the kernels on
    OpenMP's static split and on their own pool (tide/kernels/pool.h), on a quiet machine and beside
    another process busy 1.5 ms every 12 ms. Each round runs both threadings under both loads, the
    order flipped every round; medians of tok/s and of the per-round ratio pool / OpenMP."""
    import subprocess
    import sys

    from tide import kernels

    module = kernels.ops()
    if module is None:
        return {"skipped": "no kernels here"}
    engine = LLMEngine(model, EngineConfig(max_batch=1, max_seq_len=1024))
    tok_s: dict[str, list[float]] = {}
    try:
        for r in range(rounds + 1):  # round 0 warms up, not counted
            for load in ("quiet", "busy"):
                busy = subprocess.Popen([sys.executable, "-c", _BUSY]) if load == "busy" else None
                try:
                    for mode in ("openmp", "pool") if r % 2 else ("pool", "openmp"):
                        module.set_pool(mode == "pool")
                        rate = throughput(engine, prompts, max_tokens, ignore_eos=True)[0]
                        if r:
                            tok_s.setdefault(f"{mode}_{load}", []).append(rate)
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
    finally:
        module.set_pool(kernels.pool_wanted())
    out: dict = {"rounds": rounds, "max_tokens": max_tokens, "prompts": len(prompts),
                 "busy": "another process, 1.5 ms busy every 12 ms"}
    for key, v in tok_s.items():
        out[key] = round(statistics.median(v), 2)
    for load in ("quiet", "busy"):
        ratios = [a / b for a, b in zip(tok_s[f"pool_{load}"], tok_s[f"openmp_{load}"], strict=True)]
        out[f"pool_x_openmp_{load}"] = round(statistics.median(ratios), 3)
    print(f"  kernels' pool vs OpenMP, batch 1: quiet {out['pool_quiet']} vs {out['openmp_quiet']} tok/s "
          f"({out['pool_x_openmp_quiet']}x); beside a busy process {out['pool_busy']} vs {out['openmp_busy']} "
          f"({out['pool_x_openmp_busy']}x)", flush=True)
    return out


def run(args) -> dict:
    t_start = time.perf_counter()
    target = resolve_target(args.target)
    dtype, weight_format = resolve_weights(args.weights, args.dtype)
    model = LlamaModel.load(target, dtype=dtype, weight_format=weight_format)
    tok = load_tokenizer(target)
    prompts = [encode_prompt(tok, p) for p in load_prompts(args.prompts[0], limit=32)]
    quick = args.quick
    serving = {}
    if args.serve:  # first, while this process has not yet filled the caches with the tables below
        from benchmarks.serve_breakdown import breakdown

        serving = breakdown(model, args.serve, prompts[:8 if quick else 16], 64, rounds=args.serve_rounds)
        print(f"serving path at batch 1, ms per output token: {serving['serve_breakdown_ms']}", flush=True)
        if args.serve_only:
            return {"target": target.model_id, "dtype": dtype_name(dtype), "weights": weight_format,
                    "threads": torch.get_num_threads(),
                    **serving, "wall_s": round(time.perf_counter() - t_start, 1)}
    if args.kernels_only:
        from tide import kernels

        with kernels.disabled():
            baseline = LlamaModel.load(target, dtype=dtype, weight_format=weight_format)
            float32 = LlamaModel.load(target, dtype=torch.float32) if dtype != torch.float32 else None
        print("CPU kernels vs torch ops, plain greedy decoding:", flush=True)
        return {"target": target.model_id, "dtype": dtype_name(dtype), "weights": weight_format,
                "threads": torch.get_num_threads(), "cpu": cpu_name(), "native_bf16": native_bf16("cpu"),
                "kernels_ab": kernels_ab(model, baseline, prompts, 64, 3 if quick else 7, float32),
                "pool_ab": pool_ab(model, prompts[:4], 48, 3 if quick else 5),
                "wall_s": round(time.perf_counter() - t_start, 1)}
    reps = 5 if quick else 15
    batches = args.batches or [1, 4, 16]
    gammas = args.gammas or list(range(6))
    max_tokens = args.max_tokens or (32 if quick else 96)
    limit = args.prompt_limit or (16 if quick else 64)
    per_file = max(1, limit // len(args.prompts))  # the files share the limit evenly
    spec_prompts = [encode_prompt(tok, p) for f in args.prompts for p in load_prompts(f, limit=per_file)]
    spec_prompts = [p for p in spec_prompts if len(p) + max_tokens + 8 <= SPEC_MAX_LEN]
    res: dict = {"target": target.model_id, "dtype": dtype_name(dtype), "weights": weight_format,
                 "threads": torch.get_num_threads(), "cpu": cpu_name(),
                 "quick": quick, "max_tokens": max_tokens, "prompts": args.prompts, "spec_prompts": len(spec_prompts)}
    res["T_ms"] = profile_target(model, batches, [1, 2, 4, 8, 16, 32, 64], reps)
    if args.draft:
        eagle = Eagle3Drafter.from_checkpoint(args.draft, model, Path(args.draft).name, max(batches), SPEC_MAX_LEN + 16)
        res["eagle3_draft"] = str(args.draft)
    else:
        eagle = Eagle3Drafter(random_draft(model), "random", max(batches), SPEC_MAX_LEN + 16)
        res["eagle3_draft"] = "random (untrained: latency only; acceptance ~0)"
    res["D_ms"], res["switch_ms"] = profile_draft(eagle, model, batches, [1, 4, 16, 64, 256], reps)
    res["D0_ms"] = res["D_ms"][1]
    res["spec"] = spec_sweep(model, eagle, spec_prompts, batches, gammas, args.drafters, max_tokens,
                             profile_latency(model, eagle, batches, list(range(1, max(gammas) + 2)), reps=reps),
                             args.trees or [], args.speculation_memory_mb)
    plain = next((r for r in res["spec"] if r["batch"] == 1 and r["gamma"] == 0), None)
    if plain is not None:
        res["plain_tok_s"] = plain["tok_s"]  # batch 1, every prompt of --prompts one after another
    if args.spec_only:
        res["wall_s"] = round(time.perf_counter() - t_start, 1)
        return res
    ours, theirs, ratio = plain_vs_hf(model, target, prompts[0], 64, 5 if quick else 11)
    res["plain_one_prompt_tok_s"], res["hf_generate_tok_s"] = round(ours, 2), round(theirs, 2)
    res["plain_vs_hf"] = round(ratio, 3)  # median of the per-round ratios
    with chunk_exporter(model, target.model_id) as exporter:
        capture = {b: capture_overhead(model, exporter, prompts, b, 64, 4 if quick else 8) for b in (1, 16)}
    res["capture_overhead"] = {b: c["overhead"] for b, c in capture.items()}
    res["capture_detail"] = capture
    res.update(serving)
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    return res


def print_table(res: dict) -> None:
    if "kernels_ab" in res and "T_ms" not in res:
        return  # printed as it ran
    if "serve_breakdown_ms" in res:
        print("\nserving path, batch 1 (median over requests; ms per output token after the first):")
        for layer, v in res["serve_layers"].items():
            print(f"  {layer:8s} TTFT {v['ttft_ms']:8.1f}  TPOT {v['tpot_ms']:7.2f}")
        print("  parts: " + ", ".join(f"{k} {v:.2f}" for k, v in res["serve_breakdown_ms"].items())
              + f"  (the engine is {res['serve_engine_share']:.0%} of the served token: median of per-round ratios)")
        if "T_ms" not in res:
            return
    print(f"\nT(n) ms at {CONTEXT} cached tokens (rows: batch; cols: new tokens per sequence)")
    ns = list(next(iter(res["T_ms"].values())).keys())
    print("  b\\n " + "".join(f"{n:>8}" for n in ns))
    for b, row in res["T_ms"].items():
        print(f"  {b:>3} " + "".join(f"{row[n]:8.1f}" for n in ns))
    print(f"D(b) ms: {res['D_ms']}   catch-up ms by lag: {res['switch_ms']}")
    print_spec(res)
    if "plain_vs_hf" not in res:
        return
    print(f"plain {res['plain_one_prompt_tok_s']} tok/s (one prompt, 64 tokens) vs HF generate "
          f"{res['hf_generate_tok_s']} tok/s "
          f"-> {res['plain_vs_hf']}x (median of per-round ratios)")
    for b, c in res["capture_detail"].items():
        print(f"capture + hand-off, batch {b}: median step {c['step_ms_off']} -> {c['step_ms_on']} ms "
              f"(overhead {c['overhead']:+.1%}; whole-run tok/s {c['overhead_wall']:+.1%}; medians of {c['rounds']} "
              "per-round ratios)")


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    parser = parser or argparse.ArgumentParser(prog="tide bench engine", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_cli(args)


def _ints(value: str) -> list[int]:
    return [int(v) for v in value.split(",")]


def _trees(value: str) -> list[TreeShape]:
    try:
        return [TreeShape(*(int(x) for x in v.split(":"))) for v in value.split(",") if v]
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"trees are depth:topk:tokens (e.g. 4:2:6): {e}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and tokens (< 5 min)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--target", default="ref")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="auto",
                        help="auto = bf16 where fast (native, or tide.kernels' bf16 GEMM), else fp32")
    parser.add_argument("--weights", choices=WEIGHTS_NAMES, default="auto",
                        help="the target's weights: int8 / int4 = weight-only quantized (tide/quant.py)")
    parser.add_argument("--draft", help="EAGLE-3 checkpoint dir or bootstrap dir (default: a random draft, "
                                        "latency only)")
    parser.add_argument("--prompts", nargs="+", default=["spec_bench_questions.jsonl"],
                        help="prompt files (tide.prompts: a slice such as FILE[1::2] allowed); the speculation rows "
                             "take --prompt-limit prompts shared evenly between them, the other tables the first's")
    parser.add_argument("--prompt-limit", type=int, help="speculation rows: at most this many prompts in all "
                                                         "[64; quick 16]")
    parser.add_argument("--max-tokens", type=int, help="speculation rows: output tokens per prompt [96; quick 32]")
    parser.add_argument("--batches", type=_ints, help="speculation rows: batch sizes [1,4,16]")
    parser.add_argument("--gammas", type=_ints, help="speculation rows: chain lengths, 0 = plain [0,1,2,3,4,5]")
    parser.add_argument("--trees", type=_trees, help="speculation rows: EAGLE-2 draft trees as depth:topk:tokens, "
                             "comma-separated (e.g. 4:2:6,5:4:12), for the drafters that grow trees [none]")
    parser.add_argument("--drafters", type=lambda v: v.split(","), default=list(DRAFTERS),
                        help="speculation rows: drafters, the last also under the adaptive policy "
                             f"[{','.join(DRAFTERS)}; also hybrid+memory]")
    parser.add_argument("--speculation-memory-mb", type=int, default=64,
                        help="MiB of the hybrid+memory drafter's speculation memory (TIDE_SPECULATION_MEMORY_MB) [64]")
    parser.add_argument("--spec-only", action="store_true", help="only T(n), D(b) and the speculation rows")
    parser.add_argument("--serve", metavar="URL", help="also break a served token's time down layer by layer "
                                                       "against the stack whose gateway is at URL (serve_breakdown)")
    parser.add_argument("--kernels-only", action="store_true",
                        help="only compare the engine's fused CPU kernels (tide.kernels) with torch ops, side by side")
    parser.add_argument("--serve-only", action="store_true", help="with --serve: only the breakdown")
    parser.add_argument("--serve-rounds", type=int, default=3, help="with --serve: rounds, the layers' order rotated "
                                                                     "each round [3]")


def run_cli(args) -> int:
    if args.draft:  # a checkpoint or a bootstrap directory, checked before the model loads
        from tide.eagle3.checkpoint import find_checkpoint_dir

        try:
            args = argparse.Namespace(**{**vars(args), "draft": str(find_checkpoint_dir(args.draft))})
        except FileNotFoundError as e:
            raise SystemExit(f"tide bench engine: --draft: {e}") from None
    res = run(args)
    # this process holds the model, its engines' KV caches and the bench's own: peak and at the end
    res["rss_bytes"], res["peak_rss_bytes"] = rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print_table(res)
    print(f"this process: {res['rss_bytes'] / 2**20:.0f} MB resident at the end, peak "
          f"{res['peak_rss_bytes'] / 2**20:.0f} MB")
    write_json(res, args.json, indent=2)
    return 0

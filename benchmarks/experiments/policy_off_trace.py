"""Why the adaptive γ policy decodes plain: a per-step trace of its decisions and the draft's lag.

    .venv/bin/python -m benchmarks.experiments.policy_off_trace --draft DIR [--batch 4] [--prompts 32] \
        [--runs 3] [--json F]

Decodes the horizon's served GSM8K train questions (greedy, 128 tokens, `--batch` in flight) with
the serving defaults (the adaptive policy over the hybrid drafter) and records, for every step with
the batch full, what the policy decided and the largest draft lag among the requests whose next
proposal is the draft's (the hybrid's other requests copy, and copies do not feed the draft). Per run
it prints the share of plain steps (every request γ = 0), how many of those held such a request, and
the median of that lag in plain steps and in drafting ones: a lag that is much larger when the step
is plain is the catch-up trap of docs/results/horizon ("At four streams the adaptive policy stays off
too often"): the catch-up of a long lag is priced over `switch_horizon` steps, so the policy stays
off, and the lag grows.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks import adapt_horizon as horizon
from benchmarks.engine import decode_all
from benchmarks.report import cpu_name
from tide.eagle3.checkpoint import find_checkpoint_dir
from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.drafters.hybrid import HybridDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.profiling import profile_latency
from tide.policies.base import TreeShape
from tide.policies.registry import make_policy
from tide.precision import resolve_weights
from tide.prompts import encode_prompt
from tide.target import load_tokenizer, resolve_target
from tide.telemetry import COPY_SOURCES


def _median(values: list[int]) -> float | None:
    return statistics.median(values) if values else None


def trace_run(engine: LLMEngine, policy, prompts: list[list[int]], batch: int) -> dict:
    """One decode of `prompts` with `policy.decide` wrapped; the summary of its full-batch steps."""
    steps: list[tuple[bool, int | None]] = []  # (plain, largest lag of a drafting-source request or None)
    decide = policy.decide

    def traced(ctx):
        actions = decide(ctx)
        if ctx.batch_size == batch:
            depths = [a.depth if isinstance(a, TreeShape) else a for a in actions]
            lags = [r.lag for r in ctx.requests if r.drafter not in COPY_SOURCES]
            steps.append((max(depths, default=0) == 0, max(lags) if lags else None))
        return actions

    policy.decide = traced
    result = decode_all(engine, prompts, 128)
    plain = [lag for off, lag in steps if off]
    drafting = [lag for off, lag in steps if not off and lag is not None]
    with_draft = [lag for lag in plain if lag is not None]
    return {"tok_s": result["tok_s"], "gamma_mean": result["gamma_mean"], "full_steps": len(steps),
            "plain_steps": len(plain), "plain_with_draft_request": len(with_draft),
            "plain_lag_ge_50": sum(lag >= 50 for lag in with_draft),
            "median_lag_plain": _median(with_draft), "median_lag_drafting": _median(drafting)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True, help="the EAGLE-3 draft served (a checkpoint dir)")
    ap.add_argument("--batch", type=int, default=4, help="sequences in flight [4]")
    ap.add_argument("--prompts", type=int, default=32, help="served GSM8K train questions, from the start")
    ap.add_argument("--runs", type=int, default=3, help="decodes, each with a fresh policy [3]")
    ap.add_argument("--policy-args", default="{}", help="JSON constructor arguments of the adaptive policy")
    ap.add_argument("--json")
    args = ap.parse_args()

    target = resolve_target("ref")
    dtype, weights = resolve_weights("auto", "auto")
    model = LlamaModel.load(target, dtype=dtype, weight_format=weights)
    tok = load_tokenizer(target)
    served, _, _ = horizon.horizon_prompts(0, 1500)
    prompts = [encode_prompt(tok, p) for p in served[:args.prompts]]
    eagle = Eagle3Drafter.from_checkpoint(str(find_checkpoint_dir(args.draft)), model, "draft", 16, 2100)
    buckets = sorted({2 ** i for i in range(args.batch.bit_length())} | {args.batch})
    profile = profile_latency(model, eagle, buckets, list(range(1, 9)), reps=10)
    runs = []
    for _ in range(args.runs):
        policy = make_policy("adaptive", json.loads(args.policy_args), profile)
        engine = LLMEngine(model, EngineConfig(max_batch=args.batch, max_seq_len=2048),
                           drafter=HybridDrafter(eagle), policy=policy)
        runs.append(trace_run(engine, policy, prompts, args.batch))
        print(json.dumps(runs[-1]), flush=True)
    out = {"cpu": cpu_name(), "draft": args.draft, "batch": args.batch, "prompts": args.prompts,
           "policy_args": json.loads(args.policy_args), "runs": runs,
           "catchup_ms_b_L": {f"{args.batch},{lag}": round(profile.catchup_ms(lag, args.batch), 2)
                              for lag in (20, 50, 100, 200)}}
    print(json.dumps(out["catchup_ms_b_L"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Accept length with and without the speculation memory on deployment-like workloads.

    python -m benchmarks.speculation_memory --json memory.json [--max-tokens 64] [--gamma 5]

Per workload (benchmarks/workloads.py, and Spec-Bench questions as the non-repetitive control), the
reference model decodes every prompt greedily at one stream (one after another, in file order, as a
server would see them), with today's default drafter (the starter EAGLE-3 draft with prompt lookup)
and with the same drafter plus a speculation memory (`--memory-mb`). The γ is fixed (`--gamma`) so
that every number is a deterministic count: no timing, no latency profile. Per run: tokens per
speculative step (accept length, the bonus token included) and, per source of drafts (copy =
prompt lookup, memory, draft = EAGLE-3), its steps, accept length and the share of output tokens
that were its accepted drafts. Plain decoding is 1 token a step by definition.

`--fleet N` adds, per workload, the same stream served by N workers in turn (a round-robin router),
each with a memory of its own, and with the fleet's memory shared (TIDE_SPECULATION_MEMORY_FLEET):
what sharing buys over private memories, against one worker that saw everything.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.report import cpu_name, write_json
from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.drafters.hybrid import HybridDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.sequence import SamplingParams
from tide.policies import FixedGamma
from tide.precision import resolve_weights
from tide.prompts import encode_prompt, load_prompts
from tide.target import load_tokenizer, resolve_target

WORKLOADS = Path(__file__).resolve().parent / "workloads"
SETS = {
    "repeated_questions": str(WORKLOADS / "repeated_questions.jsonl.gz"),
    "templated_extraction": str(WORKLOADS / "templated_extraction.jsonl.gz") + "[:24]",
    "coding_agents": str(WORKLOADS / "coding_agents.jsonl.gz") + "[:24]",
    "repair_loop": str(WORKLOADS / "repair_loop.jsonl.gz") + "[:24]",
    "control_spec_bench": "spec_bench_questions.jsonl[0:72:3]",
}
STARTER = Path(__file__).resolve().parents[1] / "tide" / "starter_drafts" / "smollm2-135m-instruct"
SOURCES = {"ngram": "copy", "memory": "memory", "eagle3": "draft"}


def decode(model, drafter, prompts: list[list[int]], gamma: int, max_tokens: int, memory_mb: int,
           more_drafters: tuple = (), share: bool = False) -> dict:
    """Counts of one stream served by `drafter`'s engine, or, with `more_drafters`, by a fleet of
    engines (one a drafter) taking the requests in turn, each with a memory of its own or, `share`,
    each also remembering the others' finished requests (services/inference/fleet_memory.py's path:
    LLMEngine.memory_listeners -> LLMEngine.remember)."""
    engines = [LLMEngine(model, EngineConfig(max_batch=1, max_seq_len=2048, speculation_memory_mb=memory_mb),
                         drafter=d, policy=FixedGamma(gamma)) for d in (drafter, *more_drafters)]
    if share:
        for e in engines:
            for other in engines:
                if other is not e:
                    e.memory_listeners.append(other.remember)
    per: dict[str, list[int]] = {}  # source -> [steps, emitted tokens, accepted drafts]

    def on_step(rec) -> None:
        for g, a, src in zip(rec.gammas, rec.accepted, rec.sources, strict=False):
            if g > 0:
                s = per.setdefault(SOURCES.get(src, src), [0, 0, 0])
                s[0] += 1
                s[1] += a + 1
                s[2] += a

    for e in engines:
        e.step_listeners.append(on_step)
    out = steps = 0
    for i, p in enumerate(prompts):  # one stream: each request finishes (and is remembered) before the next
        seq = engines[i % len(engines)].generate([p], SamplingParams(max_tokens=max_tokens))[0]
        out += seq.num_output
        steps += seq.verify_steps + seq.plain_steps
    spec_steps = sum(s[0] for s in per.values())
    spec_tokens = sum(s[1] for s in per.values())
    return {
        "output_tokens": out,
        "accept_length": round(spec_tokens / spec_steps, 3) if spec_steps else 1.0,
        "tokens_per_step": round((out - len(prompts)) / steps, 3) if steps else 1.0,  # the prefill's token aside
        "by_source": {
            k: {"steps": s[0], "accept_length": round(s[1] / s[0], 3), "token_share": round(s[2] / out, 3)}
            for k, s in sorted(per.items())
        },
        "memory_bytes": sum(e.memory.nbytes for e in engines if e.memory is not None),
    }


def timed(model, prompts: list[list[int]], batch: int, max_tokens: int, memory_mb: int, rounds: int,
          profile, policy=None, memory_profile=None) -> dict:
    """Tokens/s of plain decoding, today's default (the hybrid drafter under the adaptive γ policy, as
    the worker serves) and the default with a speculation memory of `memory_mb`, at `batch` streams
    (1: each request finishes before the next; 4: continuous batching, 4 in flight). Every round runs
    the three in rotated order, each on a fresh engine (so the memory starts empty and learns from
    that run's earlier requests only); medians of tok/s and of the per-round ratios to the default.
    `policy`: a factory of the γ policy instead of the adaptive one (tests: a fixed γ decides alike
    whatever the timing). `memory_profile`: the profile a worker with the memory measures (its deep
    recall rows too; `start_profile`), for the memory's runs (default: `profile`)."""
    from tide.policies.registry import make_policy

    def policy_for(mode: str):
        if policy is not None:
            return policy()
        return make_policy("adaptive", {}, memory_profile if mode == "default+memory" and memory_profile else profile)

    def run(mode: str) -> dict:
        cfg = EngineConfig(max_batch=batch, max_seq_len=2048,
                           speculation_memory_mb=memory_mb if mode == "default+memory" else 0)
        if mode == "plain":
            engine = LLMEngine(model, cfg, drafter=None)
        else:
            eagle = Eagle3Drafter.from_checkpoint(STARTER, model, "starter", batch, 2048 + 16)
            engine = LLMEngine(model, cfg, drafter=HybridDrafter(eagle), policy=policy_for(mode))
        drafter = engine.drafter
        params = SamplingParams(max_tokens=max_tokens)
        t0 = time.perf_counter()
        if batch == 1:
            out = sum(engine.generate([p], params)[0].num_output for p in prompts)
        else:
            out = sum(s.num_output for s in engine.generate(prompts, params))
        return {"tok_s": out / (time.perf_counter() - t0), "output_tokens": out,
                "recalled": getattr(drafter, "recalled", 0)}  # steps whose proposal came from the memory

    modes = ("plain", "default", "default+memory")
    got: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, int] = {}  # greedy: every mode decodes the same tokens
    recalled: dict[str, int] = {}
    for r in range(rounds):
        for mode in modes[r % 3:] + modes[:r % 3]:
            one = run(mode)
            got[mode].append(one["tok_s"])
            tokens[mode], recalled[mode] = one["output_tokens"], one["recalled"]
    med = {m: statistics.median(v) for m, v in got.items()}
    ratio = {m: statistics.median(a / b for a, b in zip(v, got["default"], strict=True)) for m, v in got.items()}
    return {m: {"tok_s": round(med[m], 2), "x_default": round(ratio[m], 3), "runs": [round(x, 2) for x in got[m]],
                "output_tokens": tokens[m], "recalled_steps": recalled[m]}
            for m in modes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--memory-mb", type=int, default=64)
    ap.add_argument("--sets", nargs="+", default=list(SETS))
    ap.add_argument("--fleet", type=int, default=0, metavar="N",
                    help="counts only: also serve each workload by N workers in turn, each with its own memory "
                         "and with the fleet's memory shared (TIDE_SPECULATION_MEMORY_FLEET)")
    ap.add_argument("--timed", action="store_true",
                    help="tokens/s of plain, the default (adaptive γ) and the default with the memory instead")
    ap.add_argument("--batches", default="1,4", help="with --timed: streams")
    ap.add_argument("--rounds", type=int, default=2, help="with --timed: rounds of the three, rotated")
    args = ap.parse_args(argv)
    target = resolve_target("ref")
    dtype, weights = resolve_weights("auto", "auto")
    model = LlamaModel.load(target, dtype=dtype, weight_format=weights)
    tok = load_tokenizer(target)
    res = {
        "cpu": cpu_name(),
        "gamma": args.gamma,
        "max_tokens": args.max_tokens,
        "memory_mb": args.memory_mb,
        "draft": STARTER.name,
        "rows": [],
    }
    t0 = time.perf_counter()
    if args.timed:
        from services.inference.app import start_profile
        from services.inference.settings import InferenceSettings

        # The profile the worker serving the reference model with an EAGLE-3 draft uses (from its cache).
        profile = start_profile(InferenceSettings(drafter="eagle3"), model, target.model_id)
        memory_profile = start_profile(InferenceSettings(drafter="eagle3", speculation_memory_mb=args.memory_mb),
                                       model, target.model_id)
        res["timed"] = []
        for name in args.sets:
            prompts = [encode_prompt(tok, p) for p in load_prompts(SETS[name])]
            for b in (int(x) for x in args.batches.split(",")):
                row = {"workload": name, "batch": b, "prompts": len(prompts),
                       **timed(model, prompts, b, args.max_tokens, args.memory_mb, args.rounds, profile,
                                 memory_profile=memory_profile)}
                res["timed"].append(row)
                print(f"{name:22s} b={b}  " + "  ".join(f"{m} {row[m]['tok_s']:.1f} ({row[m]['x_default']:.3f}x)"
                                                      for m in ("plain", "default", "default+memory")), flush=True)
    for name in [] if args.timed else args.sets:
        prompts = [encode_prompt(tok, p) for p in load_prompts(SETS[name])]
        modes = [("default", 0, 1, False), ("default+memory", args.memory_mb, 1, False)]
        if args.fleet > 1:
            modes += [(f"fleet of {args.fleet}, own memories", args.memory_mb, args.fleet, False),
                      (f"fleet of {args.fleet}, shared memory", args.memory_mb, args.fleet, True)]
        for mode, mb, workers, share in modes:
            drafters = [HybridDrafter(Eagle3Drafter.from_checkpoint(STARTER, model, "starter", 1, 2048 + 16))
                        for _ in range(workers)]
            row = {
                "workload": name,
                "mode": mode,
                "prompts": len(prompts),
                **decode(model, drafters[0], prompts, args.gamma, args.max_tokens, mb, tuple(drafters[1:]), share),
            }
            res["rows"].append(row)
            shares = ", ".join(f"{k} {v['token_share']:.2f}" for k, v in row["by_source"].items())
            print(
                f"{name:22s} {mode:30s} accept {row['accept_length']:.2f}  tokens/step "
                f"{row['tokens_per_step']:.2f}  ({shares})",
                flush=True,
            )
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.json:
        write_json(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The serving default's γ policy (adaptive) with the registry's draft alone and with prompt lookup
(TIDE_PROMPT_LOOKUP, tide/engine/drafters/hybrid.py), the latter with the policy's sources told
apart (the default) or not, against plain decoding, at batch 1:

    python -m benchmarks.experiments.lookup_ab --draft tide/starter_drafts/smollm2-135m-instruct \
        --json docs/results/speculation/default-policy-lookup-ab.json

Every run decodes every prompt one after another (greedy, `--max-tokens` each); the three run in
one order and then in the reverse one, so drift over the run lands on all of them; ratios are of
the two runs' sums. The policy gets the same latency profile in both arms.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.engine import decode_all
from benchmarks.report import cpu_name
from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.drafters.hybrid import HybridDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.profiling import profile_latency
from tide.policies.registry import make_policy
from tide.precision import resolve_weights
from tide.prompts import encode_prompt, load_prompts
from tide.target import load_tokenizer, resolve_target

PROMPTS = ("gsm8k_test.jsonl", "humaneval.jsonl.gz", "spec_bench_questions.jsonl[1::22]")


def load(draft: str, files, per_file: int) -> tuple[LlamaModel, Eagle3Drafter, list[list[int]]]:
    """The reference target at the serving default's precision, the draft, and the encoded prompts."""
    target = resolve_target("ref")
    dtype, weights = resolve_weights("auto", "auto")
    model = LlamaModel.load(target, dtype=dtype, weight_format=weights)
    tok = load_tokenizer(target)
    eagle = Eagle3Drafter.from_checkpoint(draft, model, "draft", 16, 2100)
    return model, eagle, [encode_prompt(tok, p) for f in files for p in load_prompts(f, limit=per_file)]


def count_trees(engine: LLMEngine):
    """A counter of the requests' steps that verified a draft tree (the policy hears each step's
    shapes; the benchmark listens in on its `observe`)."""
    seen = [0]
    observe = engine.policy.observe

    def counting(feedback) -> None:
        seen[0] += sum(shape is not None for shape in feedback.shapes)
        observe(feedback)

    engine.policy.observe = counting
    return lambda: seen[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True, help="EAGLE-3 checkpoint directory")
    ap.add_argument("--prompts", nargs="+", default=list(PROMPTS))
    ap.add_argument("--per-file", type=int, default=21, help="prompts from each file")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=1, help="requests in flight (1: one prompt after another)")
    ap.add_argument("--arms", nargs="+", default=["plain", "adaptive-eagle3", "adaptive-hybrid-one-source",
                                                  "adaptive-hybrid"],
                    help="which of: plain, adaptive-eagle3 (the draft alone), adaptive-hybrid-one-source "
                         "(draft + lookup, one acceptance estimate for both), adaptive-hybrid-by-match "
                         "(copies of each match length apart too), adaptive-hybrid-chains (the default "
                         "without draft trees), adaptive-hybrid (the default: draft + lookup, each source "
                         "learnt and priced apart, trees where they pay)")
    ap.add_argument("--lookups", nargs="*", default=[], metavar="MIN:MAX",
                    help="also adaptive-hybrid arms whose copies need MIN..MAX matching tokens (default 1:3)")
    ap.add_argument("--json")
    args = ap.parse_args()
    model, eagle, prompts = load(args.draft, args.prompts, args.per_file)
    cfg = EngineConfig(max_batch=args.batch, max_seq_len=2048)
    profile = profile_latency(model, eagle, [1, 16], list(range(1, 6)), reps=10)
    arms = {"plain": lambda: LLMEngine(model, cfg),
            "adaptive-eagle3": lambda: LLMEngine(model, cfg, drafter=eagle,
                                                 policy=make_policy("adaptive", {}, profile)),
            "adaptive-hybrid-one-source": lambda: LLMEngine(
                model, cfg, drafter=HybridDrafter(eagle),
                policy=make_policy("adaptive", {"per_source": False}, profile)),
            "adaptive-hybrid-by-match": lambda: LLMEngine(
                model, cfg, drafter=HybridDrafter(eagle),
                policy=make_policy("adaptive", {"by_match": True}, profile)),
            "adaptive-hybrid-chains": lambda: LLMEngine(model, cfg, drafter=HybridDrafter(eagle),
                                                        policy=make_policy("adaptive", {"trees": False}, profile)),
            "adaptive-hybrid": lambda: LLMEngine(model, cfg, drafter=HybridDrafter(eagle),
                                                 policy=make_policy("adaptive", {}, profile))}
    arms = {k: v for k, v in arms.items() if k in args.arms}
    for spec in args.lookups:  # the default policy and hybrid with other n-gram match lengths
        lo, hi = (int(x) for x in spec.split(":"))
        arms[f"adaptive-hybrid-m{lo}n{hi}"] = lambda lo=lo, hi=hi: LLMEngine(
            model, cfg, drafter=HybridDrafter(eagle, min_match=lo, max_n=hi),
            policy=make_policy("adaptive", {}, profile))
    runs: dict[str, list[dict]] = {k: [] for k in arms}
    for order in (list(arms), list(arms)[::-1]):
        for name in order:
            engine = arms[name]()
            trees = count_trees(engine)
            r = decode_all(engine, prompts, args.max_tokens)
            r["tree_steps"] = trees()
            runs[name].append(r)
            print(f"{name:26s} {r['tok_s']:6.1f} tok/s  accept {r['accept_length']:.2f}  mean γ {r['gamma_mean']}"
                  f"  requests' tree steps {r['tree_steps']}", flush=True)
    plain = sum(r["tok_s"] for r in runs.get("plain", ())) or float("nan")
    out = {"cpu": cpu_name(), "draft": args.draft, "prompts": args.prompts, "per_file": args.per_file,
           "max_tokens": args.max_tokens, "batch": args.batch,
           "tok_s": {k: [r["tok_s"] for r in v] for k, v in runs.items()},
           "accept_length": {k: [r["accept_length"] for r in v] for k, v in runs.items()},
           "gamma_mean": {k: [r["gamma_mean"] for r in v] for k, v in runs.items()},
           "tree_steps": {k: [r["tree_steps"] for r in v] for k, v in runs.items()},
           "x_plain": {k: round(sum(r["tok_s"] for r in v) / plain, 3) for k, v in runs.items()}}
    print(out["x_plain"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

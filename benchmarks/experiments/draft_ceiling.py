"""What a better draft can buy in tokens/s when the loop costs nothing: the ceiling of #34's ratio.

    .venv/bin/python -m benchmarks.experiments.draft_ceiling --draft static=DIR [--tune 600] \
        [--draft starter=tide/starter_drafts/smollm2-135m-instruct] [--lookup NAME=MIN] [--prompts 40] \
        [--fixed NAME=GAMMA] [--adaptive NAME=JSON] [--batch 1] [--rounds 2] [--json F]

The horizon scenario's last-third criterion is online tokens/s ≥ 1.15x static's, where online
serves a draft the loop trained on the new domain and static the chat-bootstrapped one. Here no
loop runs at all: one engine in this process decodes the scenario's served GSM8K train questions
(the same chat template, greedy, `--max-tokens` each, one after another: batch 1, the horizon's
one-client run; `--batch 4`: four in flight, as its four closed-loop clients) with the serving
defaults (the adaptive γ policy over the hybrid drafter: copies where the context repeats, the
draft's chains or trees elsewhere) and each draft in turn, plus plain decoding. No trainer beside
it, no collection, no hot swap: so `x first draft` is the most a draft of that quality could give
the online mode on this machine.

Each draft is also judged as the horizon judges it (accept length at fixed γ = 3 on the held-out
GSM8K chunks, `eval g3`). Arms run in one order and then the reverse, `--rounds` times; tokens/s
ratios are of sums over all runs (drift lands on every arm). Also printed per arm: accept length
per speculative step, mean γ, the share of drafting steps that were copies, and per source (the
draft's chains and trees, the copies) its drafting steps and their accept length. `--fixed NAME=G`
adds an arm serving draft NAME at the fixed depth G (copies and chains alike) instead of the
adaptive policy's: what the policy's choice of depth is worth for that draft; `--adaptive NAME=JSON`
one serving it under the adaptive policy built with other arguments.
"""

from __future__ import annotations

import argparse
import json
import shutil
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
from tide.policies.registry import make_policy
from tide.precision import resolve_weights
from tide.prompts import encode_prompt
from tide.target import cache_dir, load_tokenizer, resolve_target


def tune(draft: Path, questions: list, heldout: Path, work: Path, budget_s: float) -> tuple[Path, float]:
    """`draft` fine-tuned offline on the target's greedy continuations of `questions` (captured
    now, chat-templated as served, 128 tokens) as the horizon's offline reference is trained."""
    from services.trainer.settings import TrainerSettings
    from tools.draft.draft_eval import evaluate_on_prompts

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "train.jsonl").write_text("".join(json.dumps({"prompt": p.text}) + "\n" for p in questions))
    evaluate_on_prompts(draft, [str(work / "train.jsonl")], "ref", gammas=(3,), max_tokens=128, batch=16,
                        chunks_dir=work / "chunks", progress=False)
    f = TrainerSettings.model_fields
    ref = horizon.offline_reference(draft, work / "chunks", heldout, "ref", work / "tuned", budget_s,
                                    f["lr"].default, f["batch_rows"].default, f["max_len"].default)
    return work / "tuned", ref["eval_accept_length_g3"]  # its eval on `heldout`, done there


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", action="append", required=True, metavar="NAME=DIR",
                    help="a draft to serve (repeat; the first is the one the others are compared with)")
    ap.add_argument("--lookup", action="append", default=[], metavar="NAME=MIN",
                    help="also serve draft NAME with copies only from MIN+ matching tokens (arm NAME/mMIN; the "
                         "default hybrid copies from 1; above 3, the longest match looked up: never)")
    ap.add_argument("--fixed", action="append", default=[], metavar="NAME=GAMMA",
                    help="also serve draft NAME at a fixed depth GAMMA (the `static` policy) instead of the "
                         "adaptive one (arm NAME/gGAMMA): is the policy's depth worth what it costs?")
    ap.add_argument("--adaptive", action="append", default=[], metavar="NAME=JSON",
                    help="also serve draft NAME under the adaptive policy with these constructor arguments, "
                         "e.g. 'static={\"switch_horizon\": 64}' (arms NAME/a1, NAME/a2, ... in order given)")
    ap.add_argument("--tune", type=int, default=0, metavar="N",
                    help="also serve the first draft fine-tuned offline (arm `tuned`) on the target's greedy "
                         "continuations of N served questions after the decoded ones, as the horizon's offline "
                         "reference trains (the trainer's lr, rows and row length, <= 10 passes, --tune-s)")
    ap.add_argument("--tune-s", type=float, default=600.0, help="the fine-tune's time budget [600]")
    ap.add_argument("--work-dir", default="/tmp/draft-ceiling", help="the tuned draft and its chunks go here")
    ap.add_argument("--no-plain", action="store_true", help="leave plain decoding out")
    ap.add_argument("--prompts", type=int, default=40, help="served GSM8K train questions, from the start")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences in flight (continuous batching; 4 = the horizon's 4 closed-loop clients) [1]")
    ap.add_argument("--rounds", type=int, default=2, help="each round: every arm in order, then reversed")
    ap.add_argument("--seed", type=int, default=0, help="the horizon's seed (which questions are served)")
    ap.add_argument("--json")
    args = ap.parse_args()
    drafts = dict(d.split("=", 1) for d in args.draft)

    target = resolve_target("ref")
    dtype, weights = resolve_weights("auto", "auto")
    model = LlamaModel.load(target, dtype=dtype, weight_format=weights)
    tok = load_tokenizer(target)
    served, held, _ = horizon.horizon_prompts(args.seed, 1500)
    if args.tune and args.prompts > 200:
        ap.error("--tune trains on the questions after the first 200: decode at most 200")
    prompts = [encode_prompt(tok, p) for p in served[:args.prompts]]
    first = next(iter(drafts.values()))
    heldout, start = horizon.heldout_chunks(find_checkpoint_dir(first), "ref", held, 128, cache_dir() / "bench-adapt")
    evals = {name: start["eval_accept_length_g3"] if d == first else
             horizon.evaluate_g3(find_checkpoint_dir(d), heldout, "ref")["eval_accept_length_g3"]
             for name, d in drafts.items()}  # the first draft's eval comes with the held-out chunks
    if args.tune:
        tuned, evals["tuned"] = tune(find_checkpoint_dir(first), served[200:200 + args.tune], heldout,
                                     Path(args.work_dir), args.tune_s)
        drafts["tuned"] = str(tuned)
    eagles = {name: Eagle3Drafter.from_checkpoint(str(find_checkpoint_dir(d)), model, name, 16, 2100)
              for name, d in drafts.items()}
    # one latency profile for every arm (the drafts share an architecture, so the same costs)
    buckets = sorted({2 ** i for i in range(args.batch.bit_length())} | {args.batch})  # the policy's, and B
    profile = profile_latency(model, next(iter(eagles.values())), buckets, list(range(1, 9)), reps=10)
    cfg = EngineConfig(max_batch=args.batch, max_seq_len=2048)
    hybrids: dict[str, HybridDrafter] = {}

    lookups = {f"{k}/m{v}": (k, int(v)) for k, v in (x.split("=", 1) for x in args.lookup)}
    fixed = {f"{k}/g{v}": (k, int(v)) for k, v in (x.split("=", 1) for x in args.fixed)}
    tuned_policy = {f"{k}/a{i}": (k, json.loads(v))
                    for i, (k, v) in enumerate((x.split("=", 1) for x in args.adaptive), 1)}

    def arm(name: str) -> LLMEngine:
        if name == "plain":
            return LLMEngine(model, cfg)
        if name in fixed:
            (draft, gamma), min_match = fixed[name], 1
            policy = make_policy("static", {"gamma": gamma})
        else:
            draft, params = tuned_policy.get(name, (name, {}))
            draft, min_match = lookups.get(name, (draft, 1))
            policy = make_policy("adaptive", params, profile)
        hybrids[name] = HybridDrafter(eagles[draft], min_match=min_match)
        return LLMEngine(model, cfg, drafter=hybrids[name], policy=policy)

    names = [*([] if args.no_plain else ["plain"]), *drafts, *lookups, *fixed, *tuned_policy]
    runs: dict[str, list[dict]] = {k: [] for k in names}
    for _ in range(args.rounds):
        for order in (names, names[::-1]):
            for name in order:
                r = decode_all(arm(name), prompts, args.max_tokens)
                h = hybrids.get(name)
                r["copy_share"] = round(h.copied / max(1, h.copied + h.drafted), 3) if h else None
                runs[name].append(r)
                print(f"{name:10s} {r['tok_s']:6.1f} tok/s  accept {r['accept_length']:.2f}  mean γ "
                      f"{r['gamma_mean']}  copies {r['copy_share']}  by source {r['by_source']}", flush=True)
    total = {k: sum(r["tok_s"] for r in v) for k, v in runs.items()}
    base = next(iter(drafts))
    out = {"cpu": cpu_name(), "drafts": drafts, "prompts": args.prompts, "max_tokens": args.max_tokens,
           "batch": args.batch,
           "rounds": args.rounds, "eval_accept_length_g3": evals,
           "tok_s": {k: [r["tok_s"] for r in v] for k, v in runs.items()},
           "accept_length": {k: [r["accept_length"] for r in v] for k, v in runs.items()},
           "gamma_mean": {k: [r["gamma_mean"] for r in v] for k, v in runs.items()},
           "copy_share": {k: [r["copy_share"] for r in v] for k, v in runs.items()},
           "draft_ms": {k: [r["draft_ms"] for r in v] for k, v in runs.items()},
           "verify_ms": {k: [r["verify_ms"] for r in v] for k, v in runs.items()},
           "by_source": {k: [r["by_source"] for r in v] for k, v in runs.items()},
           "x_plain": {k: round(total[k] / total["plain"], 3) for k in names} if "plain" in total else None,
           f"x_{base}": {k: round(total[k] / total[base], 3) for k in names},
           "profile_t1_ms": [round(profile.target_ms(1, n), 2) for n in range(1, 9)],
           "profile_d1_ms": round(profile.draft_ms(1), 2),
           f"profile_t{args.batch}_ms": [round(profile.target_ms(args.batch, n), 2) for n in range(1, 9)]}
    shown = ("eval_accept_length_g3", "x_plain", f"x_{base}", "profile_t1_ms", "profile_d1_ms",
             f"profile_t{args.batch}_ms")
    print(json.dumps({k: out[k] for k in shown}))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

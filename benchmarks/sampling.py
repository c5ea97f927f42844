"""`tide bench sampling`: how many drafted tokens sampled requests accept, coupled against rejection sampling.

Both verification schemes are exact (tide.engine.sampling); they differ in what a draft must guess.
Rejection sampling accepts an EAGLE-3 token drawn from the draft's q with probability min(1, p/q)
(Σ min(p, q) a token on average). Coupled sampling draws the target's token at each position from
a uniform keyed by (seed, position), so a drafted token is accepted when it is that token: the
draft draws its guess from its own q with the same uniform (`coupled`), or guesses q's argmax
(`coupled-argmax`, accepted with probability p(argmax q)). Copies (prompt lookup) are accepted
with probability p(copied token) under both.

Arms, on the same prompts, draft, γ or tree, temperatures, one engine each (batch 8; acceptance
does not depend on the batch): `rejection` (unseeded requests, EngineConfig.unseeded_sampling =
rejection), `coupled` and `coupled-argmax` (seeded requests). Prints, per temperature and arm, the
accept length (tokens a speculative step emits, bonus included) and the share of drafted tokens
accepted; `--json` keeps them. Results: docs/results/sampling.

`--agreement`: in the rejection arm, the target's p and the draft's q at each chain's first draft,
and how often each scheme would accept a first draft there: Σ min(p, q) (rejection sampling),
p(argmax q) (coupled, argmax draft), the inverse-CDF coupling (coupled, the draft drawn with the
target's uniform) and a shared exponential race (Gumbel-max with one noise vector a position, what
a coupled scheme with V random numbers a position would accept).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import tide.engine.engine as engine_module
from benchmarks.report import cpu_name
from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.drafters.hybrid import HybridDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.sampling import SamplingScheme, verify_sampling
from tide.engine.sequence import SamplingParams
from tide.policies import FixedGamma, FixedTree
from tide.precision import resolve_dtype
from tide.prompts import encode_prompt, load_prompts
from tide.target import load_tokenizer, resolve_target

STARTER = Path(__file__).resolve().parents[1] / "tide" / "starter_drafts" / "smollm2-135m-instruct"
ARMS = ("rejection", "coupled", "coupled-argmax")
BATCH = 8


def agreement(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Mean first-draft acceptance per scheme over (p, q) rows (see the module docstring)."""
    g = torch.Generator().manual_seed(0)
    total = dict(rejection=0.0, argmax=0.0, inverse_cdf=0.0, race=0.0)
    for p, q in pairs:
        p, q = p.double() / p.sum(), q.double() / q.sum()
        total["rejection"] += float(torch.minimum(p, q).sum())
        total["argmax"] += float(p[q.argmax()])
        cp, cq = p.cumsum(0), q.cumsum(0)  # the u-intervals of each token under both CDFs overlap
        total["inverse_cdf"] += float((torch.minimum(cp, cq) - torch.maximum(cp - p, cq - q)).clamp_min(0).sum())
        e = -torch.log1p(-torch.rand(64, p.numel(), generator=g, dtype=torch.float64))  # 64 races a row
        total["race"] += float(((p / e).argmax(-1) == (q / e).argmax(-1)).double().mean())
    return {k: round(v / max(len(pairs), 1), 3) for k, v in total.items()} | {"rows": len(pairs)}


def run_arm(model, draft: str, arm: str, prompts: list[list[int]], temperature: float, shape, lookup: bool,
            max_tokens: int, record: bool = False) -> dict:
    max_len = max(map(len, prompts)) + max_tokens + 16
    eagle = Eagle3Drafter.from_checkpoint(draft, model, Path(draft).name, BATCH, max_len)
    eagle.coupled_drafts = arm == "coupled"
    scheme = SamplingScheme.REJECTION if arm == "rejection" else SamplingScheme.COUPLED
    config = EngineConfig(max_batch=BATCH, max_seq_len=max_len, unseeded_sampling=scheme)
    policy = FixedTree(*shape) if isinstance(shape, tuple) else FixedGamma(shape)
    engine = LLMEngine(model, config, drafter=HybridDrafter(eagle) if lookup else eagle, policy=policy)
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                             seed=None if arm == "rejection" else i) for i in range(len(prompts))]
    pairs: list = []
    if record:  # the first draft's (p, q) of each rejection-sampled chain
        def recording(probs, drafts, draft_probs, generator):
            if draft_probs is not None and drafts and len(pairs) < 2000:
                pairs.append((probs[0].clone(), draft_probs[0].clone()))
            return verify_sampling(probs, drafts, draft_probs, generator)
        engine_module.verify_sampling = recording
    t0 = time.perf_counter()
    try:
        seqs = engine.generate(prompts, params)
    finally:
        engine_module.verify_sampling = verify_sampling
    steps = sum(s.verify_steps for s in seqs)
    accepted = sum(s.accepted_tokens for s in seqs)
    drafted = sum(s.draft_tokens for s in seqs)
    return {"arm": arm, "temperature": temperature, "accept_length": round((accepted + steps) / max(steps, 1), 3),
            "accepted_of_drafted": round(accepted / max(drafted, 1), 3), "verify_steps": steps,
            "tokens": sum(s.num_output for s in seqs), "wall_s": round(time.perf_counter() - t0, 1),
            **({"first_draft_agreement": agreement(pairs)} if record else {})}


def run(args) -> dict:
    target = resolve_target(args.target)
    model = LlamaModel.load(target, dtype=resolve_dtype(args.dtype, "cpu"))
    tok = load_tokenizer(target)
    prompts = [encode_prompt(tok, p) for f in args.prompts for p in load_prompts(f, limit=args.limit)]
    shape = tuple(int(x) for x in args.tree.split(",")) if args.tree else args.gamma
    draft = Path(args.draft).resolve()
    shown = draft.relative_to(STARTER.parents[2]) if draft.is_relative_to(STARTER.parents[2]) else draft
    res = {"target": target.model_id, "draft": str(shown), "cpu": cpu_name(), "prompts": args.prompts,
           "n_prompts": len(prompts), "max_tokens": args.max_tokens, "prompt_lookup": args.lookup,
           "gamma" if not args.tree else "tree": args.gamma if not args.tree else args.tree, "rows": []}
    for temperature in args.temperatures:
        for arm in ARMS:
            row = run_arm(model, str(args.draft), arm, prompts, temperature, shape, args.lookup, args.max_tokens,
                          record=args.agreement and arm == "rejection")
            res["rows"].append(row)
            print(f"T={temperature:<4} {arm:<15} accept length {row['accept_length']:.3f}   accepted of drafted "
                  f"{row['accepted_of_drafted']:.3f}   ({row['verify_steps']} steps, {row['wall_s']} s)", flush=True)
            if "first_draft_agreement" in row:
                print(f"         first-draft acceptance by scheme: {row['first_draft_agreement']}", flush=True)
    return res


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="ref")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--draft", default=str(STARTER), help="EAGLE-3 draft checkpoint directory")
    p.add_argument("--prompts", nargs="+", default=["spec_bench_questions.jsonl"])
    p.add_argument("--limit", type=int, default=32, help="prompts per file")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    p.add_argument("--gamma", type=int, default=4, help="chain length (every step drafts)")
    p.add_argument("--tree", default="", help="depth,topk,tokens: draft trees instead of chains")
    p.add_argument("--lookup", action="store_true", help="prompt lookup copies beside the draft (the hybrid)")
    p.add_argument("--agreement", action="store_true", help="first-draft acceptance per scheme (the docstring)")
    p.add_argument("--json", default="", help="write the results here")


def run_cli(args) -> int:
    res = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0

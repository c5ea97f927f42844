"""`python -m tools.draft.card`: make a starter draft of a bootstrapped one — the checkpoint, its
`card.json` (what the registry reads: services/registry/starter.py) and a model card README.

    python -m tools.draft.card --draft var/starter/draft --out tide/starter_drafts/smollm2-135m-instruct \
        --eval-prompts "gsm8k_test.jsonl[:14]" "humaneval.jsonl.gz[:13]" "spec_bench_questions.jsonl[1:287:22]" \
        --command "tide draft bootstrap ..."

It measures, with the serving engine (greedy, batch 8, forced γ):
- `eval_metrics.accept_length_g1..g5`: tokens per verify step on the held-out prompts (the files
  taken in turn; default 40 GSM8K test questions), 128 new tokens each — prompts the bootstrap never saw;
- `check`: the same at γ = 3 on the first CHECK_PROMPTS of them, 64 tokens each, with the prompt
  texts stored in the card: tests/inference/engine/test_starter_draft.py replays exactly this and
  requires the accept length within 5 % (greedy is deterministic on one machine; across CPUs bf16
  kernels may round differently, which 5 % covers).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.sequence import SamplingParams
from tide.policies import FixedGamma
from tide.prompts import encode_prompt, load_prompts
from tide.target import load_tokenizer, reference_gguf_path, resolve_target

CHECK_PROMPTS, CHECK_TOKENS, CHECK_GAMMA = 8, 64, 3
CONTEXT = 1024  # the engine's max_seq_len here and in the test that replays the check
FILES = ("config.json", "model.safetensors")


def accept_length(model: LlamaModel, draft_dir: Path, prompts: list[list[int]], gamma: int, max_tokens: int,
                  batch: int = 8) -> tuple[float, int]:
    """(tokens per verify step, output tokens) of greedy decoding with the draft at fixed γ."""
    drafter = Eagle3Drafter.from_checkpoint(draft_dir, model, draft_dir.name, batch, CONTEXT)
    engine = LLMEngine(model, EngineConfig(max_batch=batch, max_seq_len=CONTEXT), drafter=drafter,
                       policy=FixedGamma(gamma))
    accepted = steps = out = 0
    for i in range(0, len(prompts), batch):
        seqs = engine.generate(prompts[i:i + batch], SamplingParams(max_tokens=max_tokens), speculative=True)
        accepted += sum(s.accepted_tokens for s in seqs)
        steps += sum(s.verify_steps for s in seqs)
        out += sum(s.num_output for s in seqs)
    return (accepted + steps) / steps if steps else 1.0, out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_card(args) -> dict:
    target = resolve_target(args.target)
    model = LlamaModel.load(target, dtype=torch.bfloat16)
    tok = load_tokenizer(target)
    # Files taken in turn (round robin), so the check's first prompts cover every file's domain.
    per_file = [load_prompts(f) for f in args.eval_prompts]
    held_out = [p for group in itertools.zip_longest(*per_file) for p in group if p is not None]
    # Only prompts that fit the engine's context with their new tokens (Spec-Bench has 1k-token ones).
    fits = [(p, e) for p in held_out if len(e := encode_prompt(tok, p)) + args.max_tokens <= CONTEXT]
    held_out, encoded = [p for p, _ in fits], [e for _, e in fits]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copyfile(Path(args.draft) / name, out / name)
    t0 = time.perf_counter()
    metrics = {}
    for g in range(1, 6):
        metrics[f"accept_length_g{g}"], _ = accept_length(model, out, encoded, g, args.max_tokens)
        print(f"γ={g}: accept length {metrics[f'accept_length_g{g}']:.3f}", flush=True)
    check = held_out[:CHECK_PROMPTS]
    check_len, _ = accept_length(model, out, encoded[:CHECK_PROMPTS], CHECK_GAMMA, CHECK_TOKENS)
    report = Path(args.draft).parent / "report.json"  # the bootstrap's report, beside its draft/
    card = {
        "target_model": target.model_id,
        "target_gguf_sha256": sha256(reference_gguf_path()) if args.target == "ref" else None,
        "format": "EAGLE-3 (SGLang / vLLM layout: config.json + model.safetensors)",
        "command": args.command,
        "eval": {"prompts": " ".join(args.eval_prompts), "count": len(held_out), "max_tokens": args.max_tokens,
                 "decoding": "greedy, batch 8, forced γ, bf16 target", "seconds": round(time.perf_counter() - t0, 1)},
        "eval_metrics": {k: round(v, 4) for k, v in metrics.items()},
        "check": {"gamma": CHECK_GAMMA, "max_tokens": CHECK_TOKENS, "accept_length": round(check_len, 4),
                  "prompts": [{"text": p.text, "chat": p.chat} for p in check]},
        "files": {name: {"sha256": sha256(out / name), "bytes": (out / name).stat().st_size} for name in FILES},
        "bootstrap": bootstrap_summary(json.loads(report.read_text())) if report.exists() else None,
        "machine": {"threads": torch.get_num_threads(), "torch": torch.__version__},
    }
    (out / "card.json").write_text(json.dumps(card, indent=1) + "\n")
    (out / "README.md").write_text(readme(card))
    return card


def bootstrap_summary(report: dict) -> dict:
    """What the card keeps of a bootstrap report: its own held-out accept length (train-distribution
    prompts it held out), data and time."""
    gen, train = report.get("generation") or {}, report.get("training") or {}
    return {"held_out_accept_length": {g: round(v, 4) for g, v in (report.get("accept_length") or {}).items()},
            "output_tokens_train": gen.get("output_tokens_train"), "generation_tok_s": gen.get("tokens_per_s"),
            "train_steps": train.get("steps"), "minutes": report.get("spent_minutes")}


def _bootstrap_lines(b: dict | None) -> str:
    """The bootstrap's own numbers, from the card (empty when its report was not beside the draft)."""
    if not b:
        return ""
    held = " / ".join(f"{v:.2f}" for _, v in sorted(b["held_out_accept_length"].items()))
    minutes = b.get("minutes") or {}
    spent = ", ".join(f"{k} {v:.1f}" for k, v in minutes.items())
    return (f"\nIt generated {b['output_tokens_train']:,} training tokens ({b['generation_tok_s']:.0f} tokens/s) and "
            f"trained {b['train_steps']:,} steps (minutes: {spent}); on its own held-out split (train-distribution "
            f"prompts it did not train on) it reached {held} at γ = 1..{len(b['held_out_accept_length'])}.\n")


def readme(card: dict) -> str:
    rows = "\n".join(f"| {k.rsplit('g', 1)[1]} | {v:.3f} |" for k, v in card["eval_metrics"].items())
    files = "\n".join(f"| `{n}` | {f['bytes'] / 1e6:.1f} MB | `{f['sha256']}` |" for n, f in card["files"].items())
    return f"""# Starter EAGLE-3 draft for {card['target_model']}

The registry registers and promotes this draft as the first version of `{card['target_model']}`
when it has none (services/registry/starter.py), so `make run` speculates with EAGLE-3 from the
first request; the online loop then adapts it to the traffic it serves.

Made with the project's own bootstrap from prompts under ../shared/data that the evaluation below
never uses:

    {card['command']}
{_bootstrap_lines(card.get("bootstrap"))}
## Held-out accept length

{card['eval']['count']} prompts the bootstrap never saw (`{card['eval']['prompts']}`), {card['eval']['max_tokens']}
new tokens each, {card['eval']['decoding']}; tokens per verification step, bonus token included:

| γ | accept length |
|---|---:|
{rows}

`tests/inference/engine/test_starter_draft.py` replays the card's `check` (γ = {card['check']['gamma']},
{len(card['check']['prompts'])} prompts, {card['check']['max_tokens']} tokens: {card['check']['accept_length']:.3f})
and requires it within 5 %.

## Files

| file | size | SHA-256 |
|---|---:|---|
{files}

Target GGUF SHA-256: `{card['target_gguf_sha256']}`. Remade with `python -m tools.draft.card` (its docstring).
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.draft.card", description=__doc__.split("\n")[0])
    p.add_argument("--draft", required=True, help="the bootstrap's exported draft directory")
    p.add_argument("--out", required=True, help="where the starter goes (tide/starter_drafts/<name>)")
    p.add_argument("--target", default="ref")
    p.add_argument("--eval-prompts", nargs="+", default=["gsm8k_test.jsonl[:40]"],
                   help="held-out prompt files (slices allowed), taken in turn")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--command", required=True, help="the command that made the draft (for the card)")
    card = make_card(p.parse_args(argv))
    print(json.dumps(card["eval_metrics"]), "check", card["check"]["accept_length"])
    return 0


if __name__ == "__main__":
    sys.exit(main())


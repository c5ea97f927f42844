"""`tide draft bootstrap|eval|finetune`: make, measure and fine-tune EAGLE-3 drafts.

    tide draft bootstrap --target ref --prompts FILE... --minutes N --out DIR
    tide draft eval --draft DIR --prompts FILE... [--gamma 1..5] --json FILE
    tide draft finetune --from DIR --chunks PATH|s3://... --out DIR

See tools.draft.bootstrap for the bootstrap pipeline and the evaluator's two acceptance
numbers (`accept_length`: the serving engine's tokens per verification, predicted from chunks;
`accept_length_all_rows`: the mean over every start row).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from tide.precision import DTYPE_NAMES
from tools.draft.bootstrap import BootstrapConfig, bootstrap

_DEFAULTS = BootstrapConfig()


def _gammas(text: str) -> list[int]:
    """'3', '1,3,5' or '1..5'."""
    if ".." in text:
        a, b = text.split("..", 1)
        out = list(range(int(a), int(b) + 1))
    else:
        out = [int(x) for x in text.split(",") if x.strip()]
    if not out or min(out) < 1 or max(out) > 8:
        raise argparse.ArgumentTypeError(f"gammas must be in 1..8, got {text!r}")
    return out


def add_bootstrap_arguments(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    p.add_argument("--target", default=d.target, help="'ref', a HF directory or a .gguf file [ref]")
    p.add_argument("--prompts", nargs="+", required=True,
                   help="prompt files (tide.prompts formats; names are also looked up in the data directory)")
    p.add_argument("--minutes", type=float, required=True,
                   help="wall-time budget for the whole run: generation + training + export")
    p.add_argument("--out", required=True, help="output directory (rerun with the same --out to resume)")
    p.add_argument("--gen-fraction", type=float, default=d.gen_fraction,
                   help=f"share of the budget generation may use, held-out prompts included [{d.gen_fraction}]")
    p.add_argument("--gen-tokens", type=int, default=None,
                   help="stop generating once the training set has this many output tokens [no limit]")
    p.add_argument("--limit", type=int, default=None, help="prompts read per file [all]")
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts, help=f"held-out prompts [{d.eval_prompts}]")
    p.add_argument("--batch", type=int, default=d.batch, help=f"engine slots while generating [{d.batch}]")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help=f"output tokens per prompt [{d.max_tokens}]")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                   help=f"skip longer prompts [{d.max_prompt_tokens}]")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=d.dtype,
                   help="target dtype for generation; auto = bf16 where the CPU/GPU has it natively, else fp32 [auto]")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab, help=f"draft vocabulary [{d.draft_vocab}]")
    p.add_argument("--max-epochs", type=float, default=d.max_epochs,
                   help=f"cap on passes over the data [{d.max_epochs}]")
    p.add_argument("--evals", type=int, default=d.evals, help=f"held-out evaluations during training [{d.evals}]")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--batch-rows", type=int, default=d.batch_rows)
    p.add_argument("--learn-prompt-rows", action=argparse.BooleanOptionalAction, default=d.learn_prompt_rows,
                   help="also train on prompt rows (the target's distribution there) "
                        f"[{'on' if d.learn_prompt_rows else 'off'}]")
    p.add_argument("--max-len", type=int, default=d.max_len)
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps)
    p.add_argument("--ttt-mask", choices=("specforge", "inference"), default=d.ttt_mask,
                   help=f"attention mask of the unrolled steps (training.objective.TTTAttention) [{d.ttt_mask}]")
    p.add_argument("--ttt-ramp", type=float, default=d.ttt_ramp,
                   help=f"share of the schedule over which the unroll grows from 1 to --ttt-steps [{d.ttt_ramp}]")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--freeze-head", action=argparse.BooleanOptionalAction, default=d.freeze_head,
                   help="keep the draft's lm_head and norm at the target's [off]")
    p.add_argument("--feature-noise", type=float, default=d.feature_noise,
                   help=f"training noise on the aux states, in units of their RMS [{d.feature_noise}]")
    p.add_argument("--aux-norm", action=argparse.BooleanOptionalAction, default=d.aux_norm,
                   help="train fc on the aux states scaled per layer to about unit RMS (exported unscaled) [on]")
    p.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 autocast for the training forward [on]")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=None, help="torch threads [torch's default]")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", required=True, help="draft checkpoint directory, or a bootstrap --out directory")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", nargs="+", help="prompt files (tide.prompts formats): generate, then evaluate")
    source.add_argument("--chunks", help="evaluate on chunks captured before instead (directory or s3://bucket/prefix, "
                                         "e.g. a bootstrap's chunks/eval): drafts compared on the same sequences")
    p.add_argument("--gamma", type=_gammas, default=[1, 2, 3, 4, 5], help="γ values: 3, 1,3,5 or 1..5 [1..5]")
    p.add_argument("--json", type=Path, required=True, help="write the result here")
    p.add_argument("--target", default=None, help="target (default: the one in the draft's training record)")
    p.add_argument("--limit", type=int, default=None, help="prompts read per file [all]")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per prompt [256]")
    p.add_argument("--max-prompt-tokens", type=int, default=768, help="skip longer prompts [768]")
    p.add_argument("--batch", type=int, default=32, help="engine slots [32]")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="auto", help="target dtype (see bootstrap --dtype) [auto]")
    p.add_argument("--engine-gamma", type=int, default=0,
                   help="also serve the prompts with the draft at this γ and report the engine's measured "
                        "acceptance (0: plain generation) [0]")
    p.add_argument("--ttt-steps", type=int, default=3, help="unrolled steps for the per-step top-1 [3]")
    p.add_argument("--chunks-dir", type=Path, default=None, help="keep the captured chunks here")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-progress", action="store_true")


def add_finetune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="init", required=True, help="draft checkpoint (or bootstrap directory) to start from")
    p.add_argument("--chunks", required=True, help="directory of chunk files or s3://bucket/prefix")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--target", default=None, help="target (default: the one in the draft's training record)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps [one pass: --epochs]")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-rows", type=int, default=8)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--eval-fraction", type=float, default=0.1, help="chunks held out to compare before/after [0.1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    p.add_argument("--threads", type=int, default=None, help="torch threads [torch's default]")
    p.add_argument("--no-progress", action="store_true")


def add_draft_parser(subparsers) -> None:
    """`tide draft bootstrap|eval|finetune`."""
    draft = subparsers.add_parser("draft", help="bootstrap, evaluate or fine-tune an EAGLE-3 draft",
                                  description=__doc__.splitlines()[0])
    kinds = draft.add_subparsers(dest="draft_command", required=True)
    for name, add_arguments, handler, help_text in (
            ("bootstrap", add_bootstrap_arguments, run_bootstrap,
             "generate with the target, train a draft from scratch, export it with its eval report"),
            ("eval", add_eval_arguments, run_eval,
             "acceptance length and per-step top-1 of a draft on continuations of the given prompts"),
            ("finetune", add_finetune_arguments, run_finetune, "fine-tune a draft on chunks")):
        p = kinds.add_parser(name, help=help_text)
        add_arguments(p)
        p.set_defaults(handler=handler)
    draft.set_defaults(func=run_cli)


def run_cli(args) -> int:
    """Run the draft command's `handler` (set by its parser); errors it expects are one line on stderr."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"tide draft {args.draft_command}: {e}", file=sys.stderr)
        return 1


def process_age_s() -> float:
    """Seconds since this process started (interpreter start-up and imports: ~3 s with torch); 0
    where /proc is missing."""
    try:
        # field 22 of /proc/self/stat: the start in clock ticks after boot (fields after the
        # parenthesised command name, which may itself hold spaces, start at field 3)
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def bootstrap_config(args) -> BootstrapConfig:
    """The settings that `tide draft bootstrap`'s arguments ask for."""
    return BootstrapConfig(
        target=args.target, prompts=list(args.prompts), out=args.out, minutes=args.minutes,
        gen_fraction=args.gen_fraction, gen_tokens=args.gen_tokens, prompt_limit=args.limit,
        eval_prompts=args.eval_prompts, batch=args.batch, max_tokens=args.max_tokens,
        max_prompt_tokens=args.max_prompt_tokens, dtype=args.dtype, draft_vocab=args.draft_vocab,
        max_epochs=args.max_epochs, evals=args.evals, lr=args.lr, batch_rows=args.batch_rows, max_len=args.max_len,
        learn_prompt_rows=args.learn_prompt_rows, ttt_steps=args.ttt_steps, ttt_mask=args.ttt_mask,
        ttt_ramp=args.ttt_ramp, warmup_steps=args.warmup_steps, freeze_head=args.freeze_head,
        feature_noise=args.feature_noise, aux_norm=args.aux_norm, autocast=args.autocast, seed=args.seed,
        threads=args.threads,
        progress=not args.no_progress)


def run_bootstrap(args, run=bootstrap) -> int:
    """`tide draft bootstrap`: `run` (`bootstrap.bootstrap`) on the arguments' settings, its budget
    counted from this process's start; prints a summary of its report."""
    if args.minutes <= 0 or not 0 < args.gen_fraction < 1:
        print("tide draft bootstrap: --minutes must be > 0 and --gen-fraction in (0, 1)", file=sys.stderr)
        return 2
    report = run(bootstrap_config(args), started=time.monotonic() - process_age_s())
    out = Path(args.out)
    print(json.dumps({"draft": report["draft"], "report": str(out / "report.json"), "plot": str(out / "report.png"),
                      "accept_length": report["accept_length"], "top1": report["top1"],
                      "wall_minutes": round(report["wall_minutes"], 2),
                      "output_tokens_train": report["generation"]["output_tokens_train"],
                      "train_steps": report["training"]["steps"]}, indent=2))
    return 0


def run_eval(args) -> int:
    from tools.draft.draft_eval import evaluate_on_chunks, evaluate_on_prompts

    if args.chunks and args.engine_gamma:
        print("tide draft eval: --engine-gamma serves prompts; it does not apply to --chunks", file=sys.stderr)
        return 2
    if args.chunks:
        result = evaluate_on_chunks(args.draft, args.chunks, target=args.target, gammas=args.gamma,
                                    ttt_steps=args.ttt_steps, max_len=args.max_prompt_tokens + args.max_tokens + 1,
                                    threads=args.threads)
    else:
        result = evaluate_on_prompts(
            args.draft, list(args.prompts), target=args.target, gammas=args.gamma, limit=args.limit,
            max_tokens=args.max_tokens, batch=args.batch, max_prompt_tokens=args.max_prompt_tokens, dtype=args.dtype,
            engine_gamma=args.engine_gamma, ttt_steps=args.ttt_steps, chunks_dir=args.chunks_dir,
            progress=not args.no_progress, threads=args.threads)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    acc = " ".join(f"γ={g}:{v:.3f}" for g, v in result["accept_length"].items())
    print(f"accept_length {acc}  top1 {[round(x, 3) for x in result['top1']]}"
          + (f"  engine γ={args.engine_gamma}: {result['engine']['accept_length']:.3f}" if "engine" in result else ""))
    return 0


def run_finetune(args) -> int:
    from services.trainer.training.loop import TrainConfig
    from services.trainer.training.run import train_draft
    from tide.eagle3.checkpoint import find_checkpoint_dir
    from tools.draft.draft_eval import draft_target
    from tools.draft.generation import torch_threads

    init = find_checkpoint_dir(args.init)
    target = args.target or draft_target(init)
    cfg = TrainConfig(steps=args.steps, epochs=args.epochs, lr=args.lr, batch_rows=args.batch_rows,
                      max_len=args.max_len, warmup_steps=args.warmup_steps, seed=args.seed,
                      progress=not args.no_progress)
    with torch_threads(args.threads):
        summary = train_draft(target, args.chunks, args.out, init=init, cfg=cfg, eval_fraction=args.eval_fraction)
    out = {k: summary[k] for k in ("train", "baseline", "candidate")}
    out["target"], out["from"], out["out"] = str(target), str(init), str(args.out)
    if summary["baseline"] and summary["candidate"]:
        b, c = summary["baseline"]["served"]["3"], summary["candidate"]["served"]["3"]
        out["accept_length_3"] = {"before": b, "after": c, "better": c > b}
    text = json.dumps(out, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tide")
    add_draft_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

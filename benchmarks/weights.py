"""`tide bench weights`: what quantized weights cost in quality and buy in speed, side by side.

Every format in `--formats` is loaded in this one process from the same target files. The first
format is the reference (bf16 by default: the values the reference GGUF holds, exactly).

- quality, teacher-forced on held-out text the project never trained on (GSM8K test questions with
  their reference answers in the chat template, HumanEval prompts with their canonical solutions):
  perplexity, and next-token agreement = the share of positions whose argmax equals the reference
  format's argmax;
- greedy generations of chat prompts: the share of outputs identical to the reference format's,
  and the mean share of each output before its first differing token;
- speed: plain greedy decoding at batch 1 (each prompt alone, one after another) and at batch 16,
  rounds alternating the formats' order; each round gives a ratio to the reference, the report
  their median (this VM's speed drifts by 10-40 % over minutes);
- memory: bytes of weights a decode step reads, and bytes held (with quantized weights, prompts
  go through float copies: LlamaModel.prefill_linears).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.engine import throughput
from benchmarks.report import standalone_main, write_json
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import ForwardBatch, LlamaModel
from tide.engine.sequence import SamplingParams
from tide.precision import WEIGHTS_NAMES, resolve_weights, weights_label
from tide.prompts import encode_prompt, load_prompts, read_rows, resolve_prompt_file, split_slice
from tide.quant import QUANT_FORMATS
from tide.target import load_tokenizer, resolve_target

# Teacher-forced sequences are cut to this many tokens: long enough for a full GSM8K answer or
# HumanEval solution, short enough for one prefill forward.
MAX_TEXT_TOKENS = 512


def reference_texts(tokenizer, specs: list[str]) -> list[list[int]]:
    """Token ids of held-out text with reference continuations: GSM8K rows as a chat turn
    (question, then the reference answer as the assistant's reply), HumanEval rows as prompt +
    canonical solution. A spec is a file name with an optional slice, as `load_prompts` takes."""
    out = []
    for spec in specs:
        name, part = split_slice(spec)
        rows = list(read_rows(resolve_prompt_file(name)))
        for row in rows[part] if part is not None else rows:
            if "answer" in row and not getattr(tokenizer, "chat_template", None):  # a base model: plain text
                ids = tokenizer.encode(f"{row['question']}\n{row['answer']}")
            elif "answer" in row:
                ids = tokenizer.apply_chat_template(
                    [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}],
                    tokenize=True)
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            elif "canonical_solution" in row:
                ids = tokenizer.encode(row["prompt"] + row["canonical_solution"])
            else:
                raise ValueError(f"{name}: rows need question+answer (GSM8K) or prompt+canonical_solution (HumanEval)")
            out.append(ids[:MAX_TEXT_TOKENS])
    return out


@torch.inference_mode()
def teacher_forced(model: LlamaModel, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax [T-1], negative log-likelihood [T-1]) of each next token of `ids`, one forward. Not
    marked `prefill`: the quality measured is that of the weights generated tokens go through
    (LlamaModel.prefill_linears would give the float model's)."""
    T = len(ids)
    cache = model.new_cache(1, T + 1)
    pos = torch.arange(T)[None]
    fb = ForwardBatch(input_ids=torch.tensor([ids]), positions=pos, slots=torch.tensor([0]), kv_len=T,
                      mask=(torch.arange(T)[None, :] <= torch.arange(T)[:, None])[None, None], slot_range=(0, 1))
    logits, _, _ = model.forward(fb, cache)
    logits = logits[:-1].float()
    nll = F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
    return logits.argmax(-1), nll


def quality(models: dict[str, LlamaModel], texts: list[list[int]]) -> dict:
    ref = next(iter(models))
    out = {}
    argmax: dict[str, list[torch.Tensor]] = {}
    for name, model in models.items():
        nlls, argmax[name] = [], []
        for ids in texts:
            a, nll = teacher_forced(model, ids)
            argmax[name].append(a)
            nlls.append(nll)
        nll = torch.cat(nlls)
        agree = torch.cat([(a == b).float() for a, b in zip(argmax[name], argmax[ref], strict=True)])
        out[name] = {"perplexity": round(math.exp(float(nll.mean())), 4),
                     "next_token_agreement": round(float(agree.mean()), 5), "tokens": int(nll.numel())}
    return out


def context(model: LlamaModel) -> int:
    """Prompt + output tokens an engine here allows: 1024, or less for a model with a shorter context."""
    return min(1024, model.cfg.max_position_embeddings)


def greedy_agreement(models: dict[str, LlamaModel], prompts: list[list[int]], tokens: int) -> dict:
    params = SamplingParams(max_tokens=tokens)
    outs = {}
    for name, model in models.items():
        engine = LLMEngine(model, EngineConfig(max_batch=len(prompts), max_seq_len=context(model)))
        outs[name] = [s.output_ids for s in engine.generate(prompts, params)]
    ref = next(iter(models))
    res = {}
    for name, seqs in outs.items():
        prefix = []
        for a, b in zip(seqs, outs[ref], strict=True):
            same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            prefix.append(same / max(len(b), 1))
        same_out = sum(a == b for a, b in zip(seqs, outs[ref], strict=True)) / len(seqs)
        res[name] = {"identical_outputs": round(same_out, 4), "mean_prefix_share": round(statistics.fmean(prefix), 4)}
    return res


def decode_tok_s(model: LlamaModel, prompts: list[list[int]], batch: int, tokens: int) -> float:
    """Plain greedy output tokens/s: `batch` prompts at a time (batch 1: each prompt alone)."""
    engine = LLMEngine(model, EngineConfig(max_batch=batch, max_seq_len=context(model)))
    t0 = time.perf_counter()
    out = sum(throughput(engine, prompts[i:i + batch], tokens, ignore_eos=True)[2]
              for i in range(0, len(prompts), batch))
    return out / (time.perf_counter() - t0)


def speed(models: dict[str, LlamaModel], prompts: list[list[int]], rounds: int, tokens: int) -> dict:
    names = list(models)
    ref = names[0]
    res: dict = {}
    for batch, plist in ((1, prompts[:4]), (16, prompts[:16])):
        decode_tok_s(models[ref], plist[:1], 1, 8)  # warm-up
        per_round: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                per_round[name].append(decode_tok_s(models[name], plist, batch, tokens))
        for name in names:
            ratios = [a / b for a, b in zip(per_round[name], per_round[ref], strict=True)]
            res.setdefault(name, {})[f"batch{batch}"] = {"tok_s": round(statistics.median(per_round[name]), 2),
                                                         "ratio": round(statistics.median(ratios), 3)}
        print(f"  batch {batch}: " + ", ".join(f"{n} {res[n][f'batch{batch}']['tok_s']} tok/s" for n in names),
              flush=True)
    return res


def _nbytes(lin) -> int:
    return lin.nbytes()  # Linear, Int8Linear and Int4Linear all report the bytes a call reads


def weight_bytes(model: LlamaModel) -> tuple[int, int]:
    """(bytes a decode step reads: projections + lm_head, bytes held: those + the embedding and,
    with quantized weights, the float copies prompts take)."""
    step = sum(_nbytes(m) for layer in model.layers for m in (layer[1], layer[2], layer[4], layer[5]))
    step += _nbytes(model.head)
    held = step + model.embed.numel() * model.embed.element_size()
    held += sum(_nbytes(m) for layer in model.prefill_linears for m in layer)
    if model.prefill_head is not model.head:
        held += _nbytes(model.prefill_head)
    return step, held


def run(args) -> dict:
    t0 = time.perf_counter()
    target = resolve_target(args.target)
    tok = load_tokenizer(target)
    models = {}
    for name in args.formats:
        dtype, fmt = resolve_weights(name, args.dtype if name in QUANT_FORMATS + ("auto",) else "auto")
        models[name] = LlamaModel.load(target, dtype=dtype, weight_format=fmt)
    res: dict = {"target": target.model_id, "threads": torch.get_num_threads(), "reference": args.formats[0],
                 "labels": {n: weights_label(m.dtype, m.weight_format) for n, m in models.items()},
                 "step_weights_mb": {n: round(weight_bytes(m)[0] / 1e6, 1) for n, m in models.items()},
                 "held_weights_mb": {n: round(weight_bytes(m)[1] / 1e6, 1) for n, m in models.items()}}
    texts = reference_texts(tok, args.texts)
    res["quality"] = quality(models, texts)
    print(f"teacher-forced on {len(texts)} texts: {res['quality']}", flush=True)
    prompts = [encode_prompt(tok, p) for spec in args.prompts for p in load_prompts(spec)]
    res["greedy"] = greedy_agreement(models, prompts[:16], args.tokens)
    print(f"greedy generations vs {args.formats[0]}: {res['greedy']}", flush=True)
    res["speed"] = speed(models, prompts, args.rounds, args.tokens)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def print_table(res: dict) -> None:
    print(f"\n{'weights':>8} {'step MB':>7} {'ppl':>8} {'agree':>7} {'same out':>8} {'b1 tok/s':>9} {'x':>6} "
          f"{'b16 tok/s':>9} {'x':>6}")
    for name, q in res["quality"].items():
        s, g = res["speed"][name], res["greedy"][name]
        print(f"{name:>8} {res['step_weights_mb'][name]:7.1f} {q['perplexity']:8.3f} {q['next_token_agreement']:7.2%} "
              f"{g['identical_outputs']:8.0%} {s['batch1']['tok_s']:9.1f} {s['batch1']['ratio']:6.2f} "
              f"{s['batch16']['tok_s']:9.1f} {s['batch16']['ratio']:6.2f}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--formats", nargs="+", choices=WEIGHTS_NAMES, default=["bf16", "int8", "int4"],
                        help="TIDE_WEIGHTS values to compare; the first is the reference [bf16 int8 int4]")
    parser.add_argument("--dtype", default="auto", help="compute dtype of the quantized formats [auto]")
    parser.add_argument("--target", default="ref")
    parser.add_argument("--texts", nargs="+", default=["gsm8k_test.jsonl[:60]", "humaneval.jsonl.gz[:40]"],
                        help="held-out text with reference continuations (GSM8K, HumanEval rows)")
    parser.add_argument("--prompts", nargs="+", default=["spec_bench_questions.jsonl[:16]"],
                        help="chat prompts for the greedy generations and the speed runs")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per generation [64]")
    parser.add_argument("--rounds", type=int, default=5, help="speed rounds [5]")
    parser.add_argument("--json", type=Path, help="write the results here")


def run_cli(args) -> int:
    res = run(args)
    print_table(res)
    write_json(res, args.json, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    return standalone_main("tide bench weights", __doc__, add_arguments, run_cli, argv)


if __name__ == "__main__":
    raise SystemExit(main())

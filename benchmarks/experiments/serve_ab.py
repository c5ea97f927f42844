"""Several stacks' served time per token side by side, each against the engine alone (issue #29's
engine share), for A/B tests of a serving-path setting:

    TIDE_WEIGHTS=bf16 TIDE_STREAM_INTERVAL_MS=0 tide up --no-collection --port 8001 --data-dir D1 &
    TIDE_WEIGHTS=bf16 TIDE_STREAM_INTERVAL_MS=50 tide up --no-collection --port 8002 --data-dir D2 &
    python -m benchmarks.experiments.serve_ab --base-url http://127.0.0.1:8001 http://127.0.0.1:8002 \
        --label i0 i50 --rounds 8 --json stream-interval-ab.json

Every round decodes the same prompts (token ids, greedy, `ignore_eos`, no speculation, one request
at a time) with an LLMEngine in this process and through each stack's /v1/completions (SSE), the
order rotated from round to round (tide bench engine --serve's layers, benchmarks.serve_breakdown);
per layer the round's median TPOT (ms a token after the first). The share of a stack is the median
over rounds of engine TPOT / its TPOT, each ratio taken within one round, so that the machine's
slow spells land on every layer. The stacks must serve the reference target with the dtype given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics

import torch

from benchmarks import serve
from benchmarks.serve_breakdown import engine_alone, gateway_sse, timings
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.target import resolve_target

PROMPT_LENGTHS = (40, 80, 120, 60, 30, 100, 50, 90)  # random token ids (no prefix is shared between them)


def target(url: str, max_tokens: int) -> serve.Target:
    probe = serve.Target(serve.endpoint_url(url, "completions"), "completions", "", max_tokens, 0.0, {}, {}, 30.0)
    return serve.Target(url=probe.url, api="completions", model=serve.discover_model(probe), max_tokens=max_tokens,
                        temperature=0.0, extra_body={"speculative": False, "ignore_eos": True}, headers={},
                        timeout=300.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", nargs="+", required=True)
    ap.add_argument("--label", nargs="+", help="one per --base-url [host:port]")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--json")
    args = ap.parse_args()
    labels = args.label or [u.split("//")[-1] for u in args.base_url]
    if len(labels) != len(args.base_url):
        ap.error("--label: one per --base-url")
    model = LlamaModel.load(resolve_target("ref"), dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    engine = LLMEngine(model, EngineConfig(max_batch=1, max_seq_len=4096))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    runs = {"engine": lambda sink: engine_alone(engine, prompts, args.max_tokens, sink)}
    for label, url in zip(labels, args.base_url, strict=True):
        t = target(url, args.max_tokens)
        runs[label] = lambda sink, t=t: asyncio.run(gateway_sse(t, prompts, sink))
    for run in runs.values():  # warm-up, counted nowhere
        run(timings())
    tpot: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name in list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]:
            t = timings()
            runs[name](t)
            tpot[name].append(statistics.median(t["tpot"]) * 1e3)
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in tpot.items()), flush=True)
    out: dict = {"prompts": len(prompts), "max_tokens": args.max_tokens, "rounds": args.rounds,
                 "stacks": dict(zip(labels, args.base_url, strict=True)),
                 "tpot_ms": {k: [round(x, 2) for x in v] for k, v in tpot.items()}}
    for label in labels:
        shares = [e / x for e, x in zip(tpot["engine"], tpot[label], strict=True)]
        out[f"share_{label}"] = round(statistics.median(shares), 3)
        out[f"share_{label}_by_round"] = [round(x, 3) for x in shares]
        print(f"{label}: TPOT median {statistics.median(tpot[label]):.2f} ms, engine share {out[f'share_{label}']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""Does the default stack ever serve slower than no speculation? (issue #31's "defaults that never hurt")

    python -m benchmarks.experiments.defaults_ab --base-url http://127.0.0.1:8000 --minutes 15 \
        --prompts spec_bench_questions.jsonl "gsm8k_test.jsonl[40:]" humaneval.jsonl.gz --json ab.json

Against a running stack (`make run`: the default settings, the online loop collecting and training).
The two kinds of traffic alternate at the request level: a *phase* is `c` concurrent clients each
sending one streamed request (128 tokens, greedy) of one mode — the default request, or the same
with `speculative: false`. A pair is the two modes' phases on the same `c` prompts, back to back,
in alternating order (A B, then B A), `--pairs` pairs at one concurrency, then at the next, round
after round, until `--minutes` have passed. The same number of pairs at every concurrency: a
concurrency-16 pair takes ~30 s and a concurrency-1 pair ~8 s, and a fixed time per concurrency
left a 5-minute window two concurrency-16 pairs, too few to tell a 3 % difference from the ±2 %
that two phases doing the same work differ by on this machine. So a training cycle of
the loop (~80 s) or a promotion spans many phases of both modes, and no request of one mode shares
a batch with the other's. Prompts advance through the files, mixed, from pair to pair, and never
repeat within the run (beyond their pair) while they last.

The criterion is per 5-minute window of the run (tumbling, and sliding by one minute) and per
concurrency: the median over the window's requests of each request's default / plain output tokens/s
(tokens over its end-to-end time), a request's two runs being the same prompt in the two phases of
its pair (`paired_ratio`). Also reported: the ratio of the two modes' medians over the window
(`ratio`: prompts cancel out, but not a shift of the machine's pace between pairs: two pairs doing
identical work at concurrency 16 gave it 0.88 and 1.02), each window's throughput ratio (tokens
over phase wall time, summed per mode) and, per round, what the loop was doing (`/v1/status`: the
serving draft, collection, the trainer's state and chunks consumed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks import serve
from tide.prompts import Prompt, load_prompts

MODES = {"default": {}, "plain": {"speculative": False}}
WINDOW_S = 300.0  # the window: 5 minutes
SLIDE_S = 60.0  # sliding windows start every minute


@dataclass
class Phase:
    """One phase: `c` concurrent requests of one mode (times in seconds from the run's start)."""

    round: int
    pair: int  # the pair's number in the run: its two phases served the same prompts
    concurrency: int
    mode: str
    t0: float
    t1: float
    by_prompt: list[float | None]  # each prompt's output tok/s, in the pair's prompt order (None: failed)
    tokens: int
    failed: int
    accept_lengths: list[float]

    @property
    def per_request_tok_s(self) -> list[float]:
        return [x for x in self.by_prompt if x is not None]

    def summary(self) -> dict:
        return {"round": self.round, "pair": self.pair, "c": self.concurrency, "mode": self.mode,
                "t0": round(self.t0, 1), "t1": round(self.t1, 1), "requests": len(self.per_request_tok_s),
                "failed": self.failed,
                "tokens": self.tokens, "tok_s": round(self.tokens / max(self.t1 - self.t0, 1e-9), 2),
                "median_request_tok_s": _median(self.per_request_tok_s),
                "accept_length": _median(self.accept_lengths)}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def mixed_prompts(files: list[str]) -> list[Prompt]:
    """The files' prompts interleaved one from each file in turn, so every phase mixes domains."""
    by_file: dict[str, list[Prompt]] = {}
    for q in (q for f in files for q in load_prompts(f)):
        by_file.setdefault(q.source, []).append(q)
    longest = max(len(v) for v in by_file.values())
    return [v[i] for i in range(longest) for v in by_file.values() if i < len(v)]


async def run_phase(client: httpx.AsyncClient, base: serve.Target, mode: str, prompts: list[Prompt],
                    rnd: int, pair: int, t_start: float) -> Phase:
    target = serve.Target(**{**base.__dict__, "extra_body": {**base.extra_body, **MODES[mode]}})
    t0 = time.monotonic() - t_start
    outcomes = await asyncio.gather(*(serve.send(client, target, p) for p in prompts))
    t1 = time.monotonic() - t_start
    ok = [o for o in outcomes if o.ok]
    accept = [float(o.speculation["accept_length"]) for o in ok
              if o.speculation and o.speculation.get("accept_length") is not None]
    by_prompt = [o.output_tokens / o.e2e if o.ok and o.e2e > 0 else None for o in outcomes]
    return Phase(rnd, pair, len(prompts), mode, t0, t1, by_prompt, sum(o.output_tokens for o in ok),
                 len(outcomes) - len(ok), accept)


def paired_ratios(phases: list[Phase]) -> list[float]:
    """Each prompt's default / plain output tok/s, over the pairs among `phases` (both modes present)."""
    by_pair: dict[int, dict[str, Phase]] = {}
    for p in phases:
        by_pair.setdefault(p.pair, {})[p.mode] = p
    return [d / b for modes in by_pair.values() if len(modes) == 2
            for d, b in zip(modes["default"].by_prompt, modes["plain"].by_prompt, strict=True)
            if d is not None and b]


async def loop_state(client: httpx.AsyncClient, base_url: str) -> dict:
    """What the loop is doing now, from the gateway's /v1/status (empty when unavailable)."""
    try:
        doc = (await client.get(base_url.rstrip("/") + "/v1/status", timeout=10)).json()
    except (httpx.HTTPError, ValueError):
        return {}
    reg, ctl, tr = doc.get("registry") or {}, doc.get("controller") or {}, doc.get("trainer") or {}
    return {"draft": (reg.get("pointer") or {}).get("effective"),
            "collection": (ctl.get("collection") or {}).get("enabled"),
            "trainer": tr.get("state"), "chunks_consumed": tr.get("chunks_consumed"),
            "versions": len(reg.get("versions") or [])}


def windows(phases: list[Phase], concurrency: list[int], end_s: float) -> list[dict]:
    """Per window [start, start + WINDOW_S) and concurrency: the request-median ratio and the
    throughput ratio over the phases that started in it. Tumbling windows first, then sliding."""
    starts = sorted({*(k * WINDOW_S for k in range(max(1, int(end_s // WINDOW_S)))),
                     *(k * SLIDE_S for k in range(max(1, int((end_s - WINDOW_S) // SLIDE_S) + 1)))})
    out = []
    for s in starts:
        row = {"start_s": s, "tumbling": s % WINDOW_S == 0, "by_concurrency": {}}
        for c in concurrency:
            pair_start = {}
            for p in phases:
                pair_start.setdefault(p.pair, p.t0)
            inside = [p for p in phases if p.concurrency == c and s <= pair_start[p.pair] < s + WINDOW_S]
            per = {m: [x for p in inside if p.mode == m for x in p.per_request_tok_s] for m in MODES}
            thr = {m: sum(p.tokens for p in inside if p.mode == m) /
                   max(sum(p.t1 - p.t0 for p in inside if p.mode == m), 1e-9) for m in MODES}
            if not per["default"] or not per["plain"]:
                continue
            row["by_concurrency"][c] = {
                "requests": {m: len(v) for m, v in per.items()},
                "median_request_tok_s": {m: _median(v) for m, v in per.items()},
                "ratio": round(statistics.median(per["default"]) / statistics.median(per["plain"]), 3),
                "paired_ratio": _median(paired_ratios(inside)),
                "throughput_ratio": round(thr["default"] / thr["plain"], 3) if thr["plain"] else None}
        out.append(row)
    return out


async def run(args) -> dict:
    pool = mixed_prompts(args.prompts)
    base = serve.Target(url=serve.endpoint_url(args.base_url, "chat"), api="chat", model=args.model or "",
                        max_tokens=args.max_tokens, temperature=0.0, extra_body={}, headers={}, timeout=600.0)
    if not base.model:
        base = serve.Target(**{**base.__dict__, "model": serve.discover_model(base)})
    phases: list[Phase] = []
    rounds: list[dict] = []
    cursor = 0
    limits = httpx.Limits(max_connections=max(args.concurrency) + 2)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as client:
        t_start = time.monotonic()
        deadline = t_start + args.minutes * 60
        while time.monotonic() < deadline:
            rnd = len(rounds)
            rounds.append({"round": rnd, "t_s": round(time.monotonic() - t_start, 1),
                           "loop": await loop_state(client, args.base_url)})
            for c in args.concurrency:
                flip = rnd % 2
                for _ in range(args.pairs):
                    if time.monotonic() >= deadline:
                        break
                    order = list(MODES) if flip % 2 == 0 else list(MODES)[::-1]
                    flip += 1
                    # a pair: the same c prompts in both modes, back to back (the engine keeps no
                    # prefix cache, so the second phase gains nothing from the first). Different
                    # prompts per mode made windows disagree by the prompts' lengths alone.
                    batch = [pool[(cursor + i) % len(pool)] for i in range(c)]
                    cursor += c
                    pair = len(phases) // 2
                    for mode in order:
                        phase = await run_phase(client, base, mode, batch, rnd, pair, t_start)
                        phases.append(phase)
                got = {m: _median([x for p in phases if (p.round, p.concurrency, p.mode) == (rnd, c, m)
                                   for x in p.per_request_tok_s]) for m in MODES}
                print(f"round {rnd} t={rounds[-1]['t_s']:6.0f}s c={c:2d}: median tok/s per request "
                      f"default {got['default']} plain {got['plain']}  loop {rounds[-1]['loop']}", flush=True)
        end_s = time.monotonic() - t_start
    wins = windows(phases, args.concurrency, end_s)
    summary = {}
    for c in args.concurrency:
        def window_min(key: str, tumbling_only: bool, c: int = c) -> float | None:
            return min((w["by_concurrency"][c][key] for w in wins if c in w["by_concurrency"]
                        and (w["tumbling"] or not tumbling_only) and w["by_concurrency"][c][key] is not None),
                       default=None)

        every = {m: [x for p in phases if p.concurrency == c and p.mode == m for x in p.per_request_tok_s]
                 for m in MODES}
        summary[c] = {"paired_ratio_whole_run": _median(paired_ratios([p for p in phases if p.concurrency == c])),
                      "min_tumbling_window_paired": window_min("paired_ratio", True),
                      "min_sliding_window_paired": window_min("paired_ratio", False),
                      "ratio_whole_run": round(statistics.median(every["default"]) /
                                               statistics.median(every["plain"]), 3),
                      "min_tumbling_window": window_min("ratio", True),
                      "min_sliding_window": window_min("ratio", False),
                      "requests": {m: len(v) for m, v in every.items()},
                      "failed": sum(p.failed for p in phases if p.concurrency == c)}
        print(f"c={c:2d}: default/plain, median over requests of each prompt's ratio: whole run "
              f"{summary[c]['paired_ratio_whole_run']}  min over 5-min windows: tumbling "
              f"{summary[c]['min_tumbling_window_paired']} sliding {summary[c]['min_sliding_window_paired']}  "
              f"(ratio of the modes' medians: whole run {summary[c]['ratio_whole_run']}, windows "
              f"{summary[c]['min_tumbling_window']} / {summary[c]['min_sliding_window']})", flush=True)
    return {"config": vars(args), "duration_s": round(end_s, 1), "summary": summary, "windows": wins,
            "rounds": rounds, "phases": [p.summary() for p in phases]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", help="the model name sent [the first of GET /v1/models]")
    p.add_argument("--prompts", nargs="+", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--pairs", type=int, default=3, help="pairs of phases per concurrency per round [3]")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    res = asyncio.run(run(args))
    Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if all(s["failed"] == 0 for s in res["summary"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""`tide bench policies`: every γ policy on the real engine, one seeded load trace (seed 001 Table 2's shape).

One process, one model (the reference target in bf16 unless `--target`), one drafter (EAGLE-3 from
`--draft DIR`, else the n-gram drafter), one profiled LatencyProfile (tide.engine.profiling,
disk-cached) given to every policy that takes one. The trace is wall-clock: phases of open-loop
arrivals — Poisson at several rates and a bursty phase (`burst` requests at once, on a jittered
period) — and closed-loop phases (a fixed number of requests in flight: the low- and high-load
regimes, where tokens/s measures the policy rather than the offered load), carrying prompts mixed
from ../shared/data (Spec-Bench, GSM8K, HumanEval, Alpaca; greedy,
max_tokens drawn per request). The same trace replays for: no speculation (static γ = 0), static
γ ∈ {1..5}, the peers (vllm, sglang, dsd, nightjar, onthefly, fsm, cache-fsm) and ours (tide,
adaptive), each on a fresh engine.

Per policy and phase (requests belong to the phase they arrive in; tokens to the phase in which
they are emitted; `overall` is the whole trace window; tokens of the drain after it are only counted
in `drain` — a policy that leaves a backlog behind gets no credit for it):
  tok_s           output tokens emitted in the phase / phase seconds
  mean_latency_s  p99_latency_s   arrival → last token, seconds (requests unfinished when the drain
                  ends, `completed` < `requests`, count with their latency so far: a lower bound)
  tpot_ms         mean (finish − first token) / (output tokens − 1), ms
  mean_gamma      mean γ over the phase's decode rows;  accept_length: mean tokens per speculative row
The oracle per phase is the best static γ (0 included) by tok_s in that phase. `--repeat N` runs N
interleaved rounds, every other one in reverse order, and reports medians (and each round's tok/s
under `rounds`); the done-when `checks` are medians over rounds of ratios taken within a round,
between runs placed next to each other (`policy_list`). `--quick` runs
3 phases × 10 s (1 client, 16 clients, bursts) and drops static γ = 2 and 4 (oracle over
{0, 1, 3, 5}). `--clock cpu --threads 1` replaces wall time by this thread's CPU time (arrivals in
virtual time): for shared, loaded machines.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.report import standalone_main, write_json
from tide.engine.drafters import NgramDrafter
from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.profiling import cached_profile, cpu_timer, default_grid
from tide.engine.sequence import SamplingParams
from tide.policies import FixedGamma
from tide.policies.profile import LatencyProfile
from tide.policies.registry import make_policy
from tide.precision import DTYPE_NAMES, resolve_dtype
from tide.prompts import encode_prompt, load_prompts

PEERS = ("vllm", "sglang", "dsd", "nightjar", "onthefly", "fsm", "cache-fsm")
OURS = ("tide", "adaptive")
PROMPT_FILES = ("spec_bench_questions.jsonl", "gsm8k_test.jsonl", "humaneval.jsonl.gz", "alpaca_seed_tasks.jsonl")


@dataclass(frozen=True)
class PhaseSpec:
    """`rate_rps` Poisson arrivals for `duration_s` s; `burst` > 1: bursts of `burst` requests at once,
    round(duration·rate/burst) of them spread evenly over the phase (± 25 % jitter): load spikes.
    `clients` > 0 makes the phase closed-loop instead: that many requests in flight, each replaced
    by the next as soon as it finishes, until the phase ends (rate and burst unused)."""

    name: str
    duration_s: float
    rate_rps: float = 0.0
    burst: float = 1.0
    clients: int = 0

    def __post_init__(self) -> None:
        if self.clients and self.rate_rps:
            raise ValueError(f"phase {self.name!r}: closed-loop (clients) or open-loop (rate_rps), not both")

    @property
    def load(self) -> float:
        """For ranking phases by load: requests in flight (closed) or arriving per second (open)."""
        return self.clients if self.clients else self.rate_rps


# Open-loop phases whose rate stays under the engine's capacity give every policy that keeps up the
# same tokens/s (the offered load): only latency tells them apart. Closed-loop phases keep the
# engine busy at a set concurrency, so their tokens/s is the policy's own throughput there. On the
# reference model (2 CPU cores) a 64-token request takes several seconds alone: 1 client is the
# low-load regime where speculation pays most, 16 clients fill every slot (the high-load regime),
# and the bursty phase brings 6 requests at once every ≈ 6 s (open loop: spikes and idle gaps).
QUICK_PHASES = (PhaseSpec("low", 10, clients=1), PhaseSpec("high", 10, clients=16),
                PhaseSpec("bursty", 10, 1.0, burst=6))
FULL_PHASES = (PhaseSpec("low", 30, clients=1), PhaseSpec("mid", 30, 1.2), PhaseSpec("high", 30, clients=16),
               PhaseSpec("bursty", 30, 1.0, burst=6), PhaseSpec("low-2", 30, 0.5))


@dataclass(frozen=True)
class Arrival:
    t_s: float
    phase: int
    prompt: int
    max_tokens: int


def make_trace(phases, n_prompts: int, seed: int, tokens: tuple[int, int]) -> list[Arrival]:
    """Seeded arrivals (times in s from the trace start), each with a prompt index and max_tokens."""
    rng, out, start = random.Random(seed), [], 0.0
    for i, ph in enumerate(phases):
        times: list[float] = []  # none for a closed-loop phase (rate 0): its arrivals follow completions
        if ph.rate_rps > 0 and ph.burst > 1:  # `burst` requests at once, evenly spread bursts ± 25 % jitter
            n_bursts = max(1, round(ph.duration_s * ph.rate_rps / ph.burst))
            period = ph.duration_s / n_bursts
            for j in range(n_bursts):
                times += [start + period * (j + 0.5 + rng.uniform(-0.25, 0.25))] * round(ph.burst)
        elif ph.rate_rps > 0:
            t = start + rng.expovariate(ph.rate_rps)
            while t < start + ph.duration_s:
                times.append(t)
                t += rng.expovariate(ph.rate_rps)
        out += [Arrival(t, i, rng.randrange(n_prompts), rng.randint(*tokens)) for t in times]
        start += ph.duration_s
    return out


class ClosedLoop:
    """The requests of closed-loop phases: one seeded (prompt, max_tokens) sequence per phase, so
    every policy gets the same requests in the same order (a faster one gets further into it)."""

    def __init__(self, phases, n_prompts: int, seed: int, tokens: tuple[int, int]) -> None:
        self.phases, self.n_prompts, self.tokens = phases, n_prompts, tokens
        self.rngs = {i: random.Random(f"{seed}:closed:{i}") for i, ph in enumerate(phases) if ph.clients}
        self.in_flight = dict.fromkeys(self.rngs, 0)

    def due(self, phase: int, t: float) -> list[Arrival]:
        """Requests to submit now to keep `phase`'s clients busy (none outside a closed phase)."""
        if phase not in self.rngs:
            return []
        rng, missing = self.rngs[phase], self.phases[phase].clients - self.in_flight[phase]
        self.in_flight[phase] += max(0, missing)
        return [Arrival(t, phase, rng.randrange(self.n_prompts), rng.randint(*self.tokens)) for _ in range(missing)]

    def finished(self, phase: int) -> None:
        if phase in self.in_flight:
            self.in_flight[phase] -= 1


def policy_list(quick: bool) -> list[tuple[str, str, dict]]:
    """(label, registry name, params) in run order. Every done-when check of our best policy
    (adaptive) divides its run by a run placed next to it or one further: the low-load oracle
    (static-1 on the reference CPU), no speculation, dsd (the peer that runs closest to it) and
    static γ = 3. This VM's speed drifts over minutes, and runs a policy apart are ≈ 35 s apart in
    --quick, where the first and last of a round are seven minutes apart."""
    statics = (5,) if quick else (2, 4, 5)
    static = lambda g: (f"static-{g}", "static", {"gamma": g})  # noqa: E731
    far_peers = [(p, p, {}) for p in PEERS if p != "dsd"]
    closing = [("tide", "tide", {}), static(1), ("none", "static", {"gamma": 0}), ("adaptive", "adaptive", {}),
               ("dsd", "dsd", {}), static(3)]
    return [static(g) for g in statics] + far_peers + closing


def select(policies: list[tuple[str, str, dict]], only: list[str] | None) -> list[tuple[str, str, dict]]:
    """The policies labelled in `only` (all when None), in run order; an unknown label is an error."""
    if not only:
        return policies
    labels = [label for label, _, _ in policies]
    unknown = sorted(set(only) - set(labels))
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; choose from {labels}")
    return [p for p in policies if p[0] in only]


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] if s else math.nan


class _Acc:
    def __init__(self) -> None:
        self.tokens = self.rows = self.gamma = self.spec_rows = self.spec_tokens = self.steps = self.batch = 0


def _stats(acc: _Acc, seconds: float, reqs: list[dict], censor_s: float) -> dict:
    """Requests still unfinished at `censor_s` count with latency censor_s − arrival (a lower bound)."""
    done = [r for r in reqs if r["finish"] is not None]
    lat = [(r["finish"] if r["finish"] is not None else censor_s) - r["arrival"] for r in reqs]
    tpot = [(r["finish"] - r["first"]) / (r["n"] - 1) * 1e3 for r in done if r["n"] > 1]
    mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else math.nan  # noqa: E731
    return {"tok_s": round(acc.tokens / seconds, 2) if seconds > 0 else math.nan, "tokens": acc.tokens,
            "seconds": round(seconds, 2), "requests": len(reqs), "completed": len(done),
            "mean_latency_s": mean(lat), "p99_latency_s": round(_pct(lat, 0.99), 4), "tpot_ms": mean(tpot),
            "mean_gamma": round(acc.gamma / acc.rows, 3) if acc.rows else 0.0,
            "accept_length": round(acc.spec_tokens / acc.spec_rows, 3) if acc.spec_rows else 1.0,
            "mean_batch": round(acc.batch / acc.steps, 2) if acc.steps else 0.0, "steps": acc.steps}


class Clock:
    """Seconds since the trace start. "wall": perf_counter; idle waits sleep. "cpu": this thread's CPU
    time plus the idle gaps it skips (virtual arrivals): other processes on a shared machine move it
    far less than wall time (here, at load 4–6: ±10 % vs several-fold). cpu needs torch threads = 1
    (all compute in this thread); the engine's step timer is switched to the same clock
    (`engine_clock`) so the policies' step_ms feedback agrees with it."""

    def __init__(self, kind: str = "wall") -> None:
        self.kind, self.fn = kind, time.perf_counter if kind == "wall" else time.thread_time
        self.t0, self.skipped = self.fn(), 0.0

    def __call__(self) -> float:
        return self.fn() - self.t0 + self.skipped

    def wait_until(self, t: float) -> None:
        gap = t - self()
        if gap > 0 and self.kind == "wall":
            time.sleep(min(gap, 0.05))
        elif gap > 0:
            self.skipped += gap


@contextlib.contextmanager
def engine_clock(kind: str):
    """For the cpu clock: the engine times its draft/verify phases in thread CPU time too."""
    import tide.engine.engine as engine_module

    saved = engine_module.time
    if kind == "cpu":
        engine_module.time = types.SimpleNamespace(perf_counter=time.thread_time, monotonic=time.monotonic,
                                                   time=time.time)
    try:
        yield
    finally:
        engine_module.time = saved


def run_policy(model, drafter, policy, prompts: list[list[int]], trace: list[Arrival], phases, cfg: EngineConfig,
               drain_s: float, clock: str = "wall", bin_s: float = 0.5, seed: int = 0,
               tokens: tuple[int, int] = (32, 96)) -> dict:
    """Replay `trace` (open-loop arrivals) plus the closed-loop phases' requests (seeded by `seed`,
    max_tokens in `tokens`) on a fresh engine under `policy`; stats per phase and overall."""
    engine = LLMEngine(model, cfg, drafter=drafter, policy=policy)
    starts = [sum(p.duration_s for p in phases[:i]) for i in range(len(phases))]
    end = sum(p.duration_s for p in phases)
    accs, drain = [_Acc() for _ in phases], _Acc()
    reqs: list[dict] = []  # in submission order; request id "r<index>"
    bins: dict[int, list[float]] = {}
    now = Clock(clock)
    acc_at = lambda t: drain if t >= end else accs[max(i for i, s in enumerate(starts) if s <= t)]  # noqa: E731

    def on_step(rec) -> None:
        if not rec.batch_size:
            return
        t = now()
        a, g = acc_at(t), sum(rec.gammas)
        a.steps, a.batch, a.rows, a.gamma = a.steps + 1, a.batch + rec.batch_size, a.rows + rec.batch_size, a.gamma + g
        spec = [v + 1 for gg, v in zip(rec.gammas, rec.accepted, strict=True) if gg > 0]
        a.spec_rows, a.spec_tokens = a.spec_rows + len(spec), a.spec_tokens + sum(spec)
        b = bins.setdefault(int(t / bin_s), [0, 0, 0])
        b[0], b[1], b[2] = b[0] + 1, b[1] + rec.batch_size, b[2] + g / rec.batch_size

    engine.step_listeners.append(on_step)
    closed = ClosedLoop(phases, len(prompts), seed, tokens)
    closed_starts = [s for s, ph in zip(starts, phases, strict=True) if ph.clients]

    def submit(a: Arrival) -> None:
        reqs.append({"arrival": a.t_s, "phase": a.phase, "first": None, "finish": None, "n": 0})
        engine.add_request(f"r{len(reqs) - 1}", prompts[a.prompt], SamplingParams(max_tokens=a.max_tokens))

    nxt = 0
    with engine_clock(clock):
        while True:
            t = now()
            while nxt < len(trace) and trace[nxt].t_s <= t:
                submit(trace[nxt])
                nxt += 1
            if t < end:
                for a in closed.due(max(i for i, s in enumerate(starts) if s <= t), t):
                    submit(a)
            if engine.has_work() and t <= end + drain_s:
                outs = engine.step()
                t = now()
                for o in outs:
                    r = reqs[int(o.request_id[1:])]
                    if o.new_token_ids and r["first"] is None:
                        r["first"] = t
                    r["n"] += len(o.new_token_ids)
                    acc_at(t).tokens += len(o.new_token_ids)
                    if o.finished:
                        r["finish"] = t
                        closed.finished(r["phase"])
            else:  # idle until the next open-loop arrival or closed-loop phase, if any
                upcoming = [s for s in closed_starts if s > t] + ([trace[nxt].t_s] if nxt < len(trace) else [])
                if not upcoming:
                    break
                now.wait_until(min(upcoming))
    stop = now()
    total = _Acc()
    for a in accs:
        for k in vars(total):
            setattr(total, k, getattr(total, k) + getattr(a, k))
    by_phase = [[r for r in reqs if r["phase"] == i] for i in range(len(phases))]
    return {"phases": {ph.name: _stats(accs[i], ph.duration_s, by_phase[i], stop) for i, ph in enumerate(phases)},
            "overall": _stats(total, end, reqs, stop),
            "drain": {"tokens": drain.tokens, "seconds": round(stop - end, 2)},
            "unfinished": sum(r["finish"] is None for r in reqs),
            "timeline": [[round(k * bin_s, 2), round(v[1] / v[0], 2), round(v[2] / v[0], 3)]
                         for k, v in sorted(bins.items())]}


def oracle(results: dict, phases) -> dict:
    """Best static γ (0 = none included) per phase by tok_s."""
    statics = {k: v for k, v in results.items() if k == "none" or k.startswith("static-")}
    out = {}
    for ph in phases:
        best = max(statics, key=lambda k: statics[k]["phases"][ph.name]["tok_s"])
        out[ph.name] = {"policy": best, "gamma": 0 if best == "none" else int(best.split("-")[1]),
                        "tok_s": statics[best]["phases"][ph.name]["tok_s"]}
    return out


def _meets(r: dict) -> dict:
    """The issue's thresholds applied to one policy's ratios."""
    return {"static3_x1.10": r["vs_static3_overall"] >= 1.10, "none_high_x0.97": r["vs_none_high"] >= 0.97,
            "oracle_low_x0.97": r["vs_oracle_low"] >= 0.97,
            "beats_all_peers": all(v > 1.0 for v in r["vs_peers_overall"].values())}


def checks(results: dict, orc: dict, low: str = "low", high: str = "high") -> dict:
    """The issue's done-when ratios for each of our policies (and which one is best overall)."""
    tok = lambda k, ph=None: results[k]["overall"]["tok_s"] if ph is None else results[k]["phases"][ph]["tok_s"]  # noqa: E731
    ratio = lambda a, b: round(a / b, 3) if b > 0 else math.nan  # noqa: E731
    out = {}
    for ours in [p for p in OURS if p in results]:
        r = {"vs_static3_overall": ratio(tok(ours), tok("static-3")),
             "vs_none_high": ratio(tok(ours, high), tok("none", high)),
             "vs_oracle_low": ratio(tok(ours, low), orc[low]["tok_s"]),
             "vs_peers_overall": {p: ratio(tok(ours), tok(p)) for p in PEERS if p in results}}
        r["meets"] = _meets(r)
        out[ours] = r
    if out:
        out["best"] = max(out, key=lambda k: tok(k))
    return out


def paired_checks(rounds: dict[str, list[dict]], phases, low: str, high: str) -> dict:
    """`checks` taken within each round, then the median of every ratio over the rounds: a ratio of
    two runs of one round, not of two medians that may come from different rounds (minutes apart on
    a drifting machine). `per_round` keeps each round's ratios.

    The oracle's γ per phase is chosen once, from the medians over rounds; each round then divides
    by that γ's run of the round. Choosing it anew in every round would divide by the luckiest of
    the static runs: with γ = 0, 1, 3, 5 within noise of each other at low load, the maximum of four
    noisy runs overstates the best one's speed (winner's curse)."""
    n = min(len(runs) for runs in rounds.values())
    best = oracle({label: _median_run(runs) for label, runs in rounds.items()}, phases)
    per_round = []
    for i in range(n):
        results = {label: runs[i] for label, runs in rounds.items()}
        orc = {ph: {**o, "tok_s": results[o["policy"]]["phases"][ph]["tok_s"]} for ph, o in best.items()}
        per_round.append(checks(results, orc, low, high))
    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    out: dict = {}
    for ours in [p for p in OURS if p in per_round[0]]:
        rs = [c[ours] for c in per_round]
        r = {k: med([x[k] for x in rs]) for k in ("vs_static3_overall", "vs_none_high", "vs_oracle_low")}
        r["vs_peers_overall"] = {p: med([x["vs_peers_overall"][p] for x in rs]) for p in rs[0]["vs_peers_overall"]}
        r["meets"] = _meets(r)
        r["per_round"] = [{k: x[k] for k in ("vs_static3_overall", "vs_none_high", "vs_oracle_low")} for x in rs]
        out[ours] = r
    if out:
        tok = lambda k: statistics.median(run["overall"]["tok_s"] for run in rounds[k])  # noqa: E731
        out["best"] = max(out, key=tok)
    return out


def plots(res: dict, out_dir: Path) -> list[str]:
    """throughput.png (tok/s per phase per policy) and gamma.png (γ and batch over time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    pols, phases = list(res["policies"]), [p["name"] for p in res["trace"]["phases"]]
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(pols) * len(phases) / 2), 4.5))
    w = 0.8 / len(pols)
    for j, p in enumerate(pols):
        ax.bar([i + j * w for i in range(len(phases))], [res["policies"][p]["phases"][ph]["tok_s"] for ph in phases],
               w, label=p, color=plt.cm.tab20(j % 20))
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(phases))], phases)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"throughput per phase ({res['drafter']} drafter)")
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out_dir / "throughput.png", dpi=110)
    plt.close(fig)
    fig, (top, bot) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for j, p in enumerate(pols):
        tl = res["policies"][p]["timeline"]
        if p == "none":
            top.plot([x[0] for x in tl], [x[1] for x in tl], color="k", label="batch (none)")
        if not p.startswith("static") and p != "none":
            bot.plot([x[0] for x in tl], [x[2] for x in tl], label=p, lw=1.6 if p in OURS else 0.7,
                     color=plt.cm.tab20(j % 20))
    edge = 0.0
    for ph in res["trace"]["phases"]:
        for a in (top, bot):
            a.axvline(edge, color="grey", ls=":", lw=0.8)
        top.text(edge + 0.2, 0.5, ph["name"], fontsize=8)
        edge += ph["duration_s"]
    top.set_ylabel("running batch")
    bot.set_ylabel("mean γ per step")
    bot.set_xlabel("seconds since trace start")
    bot.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(out_dir / "gamma.png", dpi=110)
    plt.close(fig)
    return [str(out_dir / "throughput.png"), str(out_dir / "gamma.png")]


def load_prompt_mix(tokenizer, files, per_file: int, max_len: int, seed: int) -> list[list[int]]:
    """Token ids of up to `per_file` prompts from each file (≤ max_len tokens), shuffled with `seed`."""
    enc = []
    for f in files:
        enc += [ids for ids in (encode_prompt(tokenizer, p) for p in load_prompts(f, limit=per_file))
                if len(ids) <= max_len]
    random.Random(seed).shuffle(enc)
    return enc


def run(args, model=None, tokenizer=None, model_id: str | None = None) -> dict:
    """The benchmark; `model`/`tokenizer`/`model_id` may be passed in (tests), else `args.target` is loaded."""
    t_start = time.perf_counter()
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu needs --threads 1 (CPU time of one thread is the clock)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if model is None:
        from tide.engine.llama import LlamaModel
        from tide.target import load_tokenizer, resolve_target

        target = resolve_target(args.target)
        model = LlamaModel.load(target, dtype=resolve_dtype(args.dtype))
        tokenizer, model_id = load_tokenizer(target), target.model_id
    phases = args.phases or (QUICK_PHASES if args.quick else FULL_PHASES)
    drain_s = args.drain_s if args.drain_s is not None else 5.0 if args.quick else 20.0
    cfg = EngineConfig(max_batch=args.max_batch, max_seq_len=args.max_prompt + args.max_tokens + 8,
                       max_gamma=args.max_gamma, seed=args.seed)
    prompts = args.prompt_ids or load_prompt_mix(tokenizer, args.prompts, 60, args.max_prompt, args.seed)
    if args.draft:
        base = Eagle3Drafter.from_checkpoint(args.draft, model, Path(args.draft).name, cfg.max_batch, cfg.max_seq_len)
        new_drafter = lambda: Eagle3Drafter(base.draft, base.version, cfg.max_batch, cfg.max_seq_len)  # noqa: E731
        drafter_name = f"eagle3:{args.draft}"
    else:
        new_drafter, drafter_name = NgramDrafter, "ngram"
    batches, ns, lags = default_grid(cfg.max_batch, cfg.max_gamma)
    with cpu_timer() if args.clock == "cpu" else contextlib.nullcontext():
        prof, prof_path, hit = cached_profile(model, new_drafter(), model_id=model_id or "model", batches=batches,
                                              ns=ns, lags=lags, reps=args.profile_reps or (3 if args.quick else 5),
                                              directory=args.profile_cache, refresh=args.reprofile)
    print(f"profile {'from cache' if hit else 'measured'}: {prof_path}", flush=True)
    trace = make_trace(phases, len(prompts), args.seed, (args.min_tokens, args.max_tokens))
    LLMEngine(model, cfg, drafter=new_drafter(), policy=FixedGamma(2)).generate(  # warm-up: batch shapes
        prompts[: cfg.max_batch], SamplingParams(max_tokens=4))
    res: dict = {"target": model_id, "dtype": str(model.dtype).removeprefix("torch."), "drafter": drafter_name,
                 "threads": torch.get_num_threads(), "clock": args.clock, "quick": bool(args.quick),
                 "max_batch": cfg.max_batch, "max_gamma": cfg.max_gamma,
                 "profile": {"path": str(prof_path), "cached": hit, **prof.to_dict()},
                 "trace": {"seed": args.seed, "requests": len(trace), "phases": [asdict(p) for p in phases],
                           "tokens": [args.min_tokens, args.max_tokens], "prompts": len(prompts)},
                 "policies": {}}
    rounds: dict[str, list[dict]] = {}
    order = args.policies or select(policy_list(args.quick), args.only)
    for rnd in range(args.repeat):
        # Rounds interleave the policies, so slow drift in load hits all alike; every other round
        # runs them in reverse (ABBA), so a policy's place in the round does not favour it either.
        for label, name, params in (order if rnd % 2 == 0 else order[::-1]):
            pol = FixedGamma(params["gamma"]) if name == "static" else make_policy(name, params, _copy(prof))
            load = os.getloadavg()[0]
            r = run_policy(model, new_drafter(), pol, prompts, trace, phases, cfg, drain_s, args.clock,
                           seed=args.seed, tokens=(args.min_tokens, args.max_tokens))
            r["loadavg_1m"] = round(load, 2)
            if getattr(pol, "kv", None):  # adaptive's learnt measured/profiled verify ms per (batch bucket, n)
                r["verify_ratio"] = {f"{b},{n}": round(v, 3) for (b, n), v in sorted(pol.kv.items())}
                r["draft_ratio"] = {str(b): round(v, 3) for b, v in sorted(pol.kd.items())}
                r["catchup_ratio"] = {str(b): round(v, 3) for b, v in sorted(pol.kc.items())}
            rounds.setdefault(label, []).append(r)
            o = r["overall"]
            print(f"  {label:10s} {o['tok_s']:7.1f} tok/s  lat {o['mean_latency_s']:6.2f}s  γ {o['mean_gamma']:.2f}  "
                  f"acc {o['accept_length']:.2f}  " + "  ".join(f"{k} {v['tok_s']:.1f}" for k, v in r["phases"].items())
                  + f"  (load {load:.1f})", flush=True)
    res["policies"] = {label: _median_run(runs) for label, runs in rounds.items()}
    has_static = any(k == "none" or k.startswith("static-") for k in res["policies"])
    res["oracle"] = oracle(res["policies"], phases) if has_static else {}
    names = [p.name for p in phases]
    high = max(phases, key=lambda p: p.load).name
    needed = {"none", "static-3"} <= set(res["policies"])
    # the done-when ratios: medians of within-round ratios (see paired_checks); `checks_of_medians`
    # divides the per-policy medians instead, for comparison
    res["checks"] = paired_checks(rounds, phases, names[0], high) if needed else {}
    res["checks_of_medians"] = checks(res["policies"], res["oracle"], names[0], high) if needed else {}
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    return res


def _median_run(runs: list[dict]) -> dict:
    """One run's record whose per-phase and overall numbers are the medians over the rounds."""
    out = dict(runs[0])
    if len(runs) > 1:
        med = lambda key, sect, ph=None: statistics.median(  # noqa: E731
            (r[sect] if ph is None else r[sect][ph])[key] for r in runs)
        out["phases"] = {ph: {k: med(k, "phases", ph) for k in st} for ph, st in runs[0]["phases"].items()}
        out["overall"] = {k: med(k, "overall") for k in runs[0]["overall"]}
        out["rounds"] = [{"overall_tok_s": r["overall"]["tok_s"], "loadavg_1m": r["loadavg_1m"],
                          **{ph: st["tok_s"] for ph, st in r["phases"].items()}} for r in runs]
    return out


def _copy(prof: LatencyProfile) -> LatencyProfile:
    return LatencyProfile.from_dict(prof.to_dict())  # policies must not share memo state


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="3 phases x 10 s, static γ ∈ {1, 3, 5} (< 10 min)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plots", type=Path, help="directory for throughput.png and gamma.png")
    parser.add_argument("--target", default="ref")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="auto",
                        help="auto = bf16 where fast (native, or tide.kernels' bf16 GEMM), else fp32")
    parser.add_argument("--draft", help="EAGLE-3 checkpoint dir (default: the n-gram drafter)")
    parser.add_argument("--prompts", nargs="+", default=list(PROMPT_FILES), help="prompt files mixed into the trace")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-gamma", type=int, default=6)
    parser.add_argument("--max-prompt", type=int, default=192, help="prompts longer than this are skipped")
    parser.add_argument("--min-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--drain-s", type=float, default=None,
                        help="most seconds to finish requests after the trace (latency only) [quick 5, full 20]")
    parser.add_argument("--profile-reps", type=int, default=None, help="timed runs per profile point [quick 3, full 5]")
    parser.add_argument("--profile-cache", type=Path, default=None, help="profile cache dir [$TIDE_PROFILE_CACHE_DIR]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: real time; cpu: one thread's CPU time, for shared machines (needs --threads 1)")
    parser.add_argument("--reprofile", action="store_true", help="re-measure the profile even if cached")
    parser.add_argument("--only", nargs="+", metavar="POLICY",
                        help="run only these (labels as in the table, e.g. none static-3 tide adaptive); the oracle "
                             "and checks use the static ones among them")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds over all policies; per-phase numbers are the medians (noisy machines)")
    parser.set_defaults(phases=None, policies=None, prompt_ids=None)


def print_table(res: dict) -> None:
    phases = [p["name"] for p in res["trace"]["phases"]]
    print(f"\n{'policy':11s}{'overall':>9s}" + "".join(f"{p:>9s}" for p in phases) + "  lat_s  p99_s  tpot  γ    acc")
    for k, r in res["policies"].items():
        o = r["overall"]
        print(f"{k:11s}{o['tok_s']:9.1f}" + "".join(f"{r['phases'][p]['tok_s']:9.1f}" for p in phases)
              + f"  {o['mean_latency_s']:5.2f}  {o['p99_latency_s']:5.2f}  {o['tpot_ms']:4.0f}  "
              f"{o['mean_gamma']:.2f} {o['accept_length']:.2f}")
    print("oracle: " + ", ".join(f"{p}: {v['policy']} {v['tok_s']:.1f}" for p, v in res["oracle"].items()))
    print("checks: " + json.dumps(res["checks"]))


def run_cli(args) -> int:
    res = run(args)
    if args.plots:
        res["plots"] = plots(res, args.plots)
    print_table(res)
    write_json(res, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    return standalone_main("tide bench policies", __doc__, add_arguments, run_cli, argv)

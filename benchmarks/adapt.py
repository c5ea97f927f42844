"""`tide bench adapt`: what online adaptation buys after domain shifts (seed 000 Fig. 6 / Fig. 9 shapes).

    tide bench adapt [--quick] --json FILE --plots DIR [--draft DIR]

A workload that shifts domains at steady concurrency — Spec-Bench chat (the MT-bench conversation
categories and qa) → GSM8K → HumanEval (raw code completion), equal phase durations — is driven
through the OpenAI gateway over real HTTP (greedy, `--max-tokens` per request, `--concurrency`
closed-loop clients) against a whole stack started in this process (tools.launcher.Stack: Redis,
S3, registry, trainer, controller, one inference worker with TIDE_DRAFTER=eagle3, gateway), twice,
each time on a fresh stack:

  static  the starting draft, never changed: no collection, no training (trainer auto-train off).
  online  the loop on: the controller decides collection (TIDE_CONTROLLER_COLLECTION=auto), the
          trainer trains and promotes by itself (TIDE_TRAINER_AUTO_TRAIN=1, AUTO_PROMOTE=1, a small
          TIDE_TRAINER_MIN_TOKENS so cycles fit in a phase), workers hot-swap what gets promoted.

In both modes the worker and the trainer run on separate CPUs (`--worker-cpus`, `--trainer-cpus`;
auto: the trainer gets the upper half, on the 2-CPU reference machine CPU 1, the worker CPU 0),
which is how one machine stands in for the issue's "train online on separate hardware": the static
mode's worker gets exactly the cores the online mode's worker gets, so the ratio reads what the loop
buys, not a CPU tug-of-war. The worker's CPUs are its alone: the stack starts its other processes on
the rest (tide.resources), and this process's load generator runs there too; `worker_cpu` reports
the worker's CPU time and its time waiting for a CPU, per second of traffic. Both run the same γ
policy (`--policy`, default adaptive: it decides whether and how far to speculate from the latency
profile the worker measures at start and the live acceptance).

Both start from the same draft, registered and promoted in the fresh registry before traffic:
`--draft DIR`, else a draft bootstrapped once (tools.draft.bootstrap, `--bootstrap-minutes`) on
prompts no phase serves: Spec-Bench and Alpaca less the phases' prompts (Spec-Bench's chat
categories, and its math_reasoning, which is GSM8K's test set). A draft bootstrapped on the served
prompts memorises the very sequences greedy decoding regenerates
(docs/results/adapt, "The first full run on Zen 4": 3.06 at γ = 3 on them against
1.39 on held-out chat); that inflated the static mode's chat phase and made the trainer's held-out
chunks favour the base draft. Cached under
$TIDE_CACHE_DIR/drafts/bootstrap-start-<key>/.

Measured (adapt_stats has the exact definitions): per mode and phase, client-side completion
tokens/s (from `usage`) and accept length (tokens per verify step, from each response's
`speculation`), the online/static ratio per phase and overall; every ~2 s the collection state,
draft version, trainer state and chunk bytes (adapt_stack.Poller); promotions (registry
pointer history, with the trainer's eval acceptance), training time per cycle (outcomes'
duration_s). Collection overhead: after the static phases, on the static stack, the same fixed
request list is served in windows with collection forced off / on / on / off (ABBA, `--ab-rounds`
times) by admin decisions to the worker; greedy, so every window generates identical tokens; the
cost is 1 − median(on tok/s) / median(off tok/s), trainer ingesting the chunks included.
Plots (adapt_plots): adapt.png, loop.png, policy.png. `--quick`: 3 × 150 s phases per mode and one A/B
round of 4 requests (≈ 17 min on the 2-core CPU machine when idle, with a cached starting draft: the
first run bootstraps it, `--bootstrap-minutes` more); full: 3 × 300 s, two A/B rounds of 12 requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks import adapt_horizon as horizon
from benchmarks import adapt_stats as stats
from benchmarks.adapt_stack import (
    Gateway,
    Poller,
    chunk_bytes,
    drive,
    fetch_drafts,
    run_batch,
    set_collection,
    start_draft,
    trainer_accepted_tokens,
    worker_status,
)
from benchmarks.report import standalone_main, write_json
from tide.policies.registry import POLICY_NAMES
from tide.prompts import Prompt, load_prompts
from tide.resources import cpu_seconds, run_and_wait_s, started_on

MODES = ("static", "online")
# (phase name, prompt file, Spec-Bench categories kept or None = all)
PHASES = (("chat", "spec_bench_questions.jsonl",
           ("writing", "roleplay", "reasoning", "stem", "humanities", "extraction", "qa")),
          ("gsm8k", "gsm8k_test.jsonl", None),
          ("humaneval", "humaneval.jsonl.gz", None))
BOOTSTRAP_PROMPTS = ("spec_bench_questions.jsonl", "alpaca_seed_tasks.jsonl")  # less what a phase serves


def phase_prompts(seed: int, max_chars: int) -> list[list[Prompt]]:
    """Each phase's prompts (at most `max_chars` characters: bounded prefill), shuffled with `seed`."""
    out = []
    for i, (_, path, keep) in enumerate(PHASES):
        ps = [p for p in load_prompts(path) if (keep is None or p.domain in keep) and len(p.text) <= max_chars]
        random.Random(seed * 31 + i).shuffle(ps)
        out.append(ps)
    return out


def bounds(phase_s: float) -> list[tuple[str, float, float]]:
    return [(name, i * phase_s, (i + 1) * phase_s) for i, (name, _, _) in enumerate(PHASES)]


def bootstrap_prompt_file(directory: Path) -> Path:
    """BOOTSTRAP_PROMPTS less every prompt a phase may serve (Spec-Bench's chat categories, and its
    math_reasoning: GSM8K test questions), as one JSONL prompt file in `directory` named by its
    content (the same prompts give the same file, hence the same cached draft)."""
    served = {p.text for phase in phase_prompts(0, max_chars=10**9) for p in phase}
    texts = [p.text for name in BOOTSTRAP_PROMPTS for p in load_prompts(name) if p.text not in served]
    body = "".join(json.dumps({"prompt": t}) + "\n" for t in texts)
    path = directory / f"bootstrap-prompts-{hashlib.sha256(body.encode()).hexdigest()[:12]}.jsonl"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(body)
        tmp.replace(path)
    return path


def starting_draft(target: str, minutes: float, seed: int) -> tuple[Path, dict]:
    """The cached starting draft (bootstrapped now when missing) and its summary."""
    from tide.eagle3.checkpoint import find_checkpoint_dir
    from tide.target import cache_dir, resolve_target
    from tools.draft.bootstrap import BootstrapConfig, bootstrap

    model_id = resolve_target(target).model_id
    prompts = bootstrap_prompt_file(cache_dir() / "drafts")
    cfg = BootstrapConfig(target=target, prompts=[str(prompts)], out="", minutes=minutes, seed=seed,
                          progress=False)
    # every setting of the bootstrap is in the key (a changed default makes another draft), the
    # target by its content id
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "progress", "target")}
    key = hashlib.sha256(json.dumps([model_id, settings], sort_keys=True, default=str).encode()).hexdigest()[:12]
    out = cache_dir() / "drafts" / f"bootstrap-start-{key}"
    cached = (out / "report.json").exists()
    if not cached:
        print(f"bootstrapping the starting draft ({minutes:g} min budget) into {out}", flush=True)
    report = bootstrap(dataclasses.replace(cfg, out=str(out)))
    gc.collect()
    return find_checkpoint_dir(out), {"path": str(out), "cached": cached, "bootstrap_minutes": minutes,
                                      "prompts": str(prompts),
                                      "prompt_files": list(BOOTSTRAP_PROMPTS),
                                      "accept_length": report.get("accept_length"),
                                      "wall_minutes": report.get("wall_minutes")}


def parse_env(items: list[str]) -> dict[str, dict[str, str]]:
    """["trainer:TIDE_TRAINER_EPOCHS=4", ...] -> {"trainer": {"TIDE_TRAINER_EPOCHS": "4"}}."""
    out: dict[str, dict[str, str]] = {}
    for item in items or []:
        service, sep, kv = item.partition(":")
        key, eq, value = kv.partition("=")
        if not sep or not eq or not key:
            raise SystemExit(f"--env/--online-env: expected SERVICE:KEY=VALUE, got {item!r}")
        out.setdefault(service, {})[key] = value
    return out


def placement(worker_cpus: str, trainer_cpus: str) -> tuple[str, str]:
    """(worker CPUs, trainer CPUs) as TIDE_CPUS / TIDE_TRAINER_CPUS values; "auto" splits the CPUs this
    process may use (the trainer gets the upper half, at least one; the worker the rest), "" = all.
    The issue's "train on separate hardware", on one machine: the trainer never takes the worker's
    cores, in both modes, so online/static reads what the loop buys and not a CPU tug-of-war."""
    cpus = sorted(os.sched_getaffinity(0))
    cut = len(cpus) - max(1, len(cpus) // 2) if len(cpus) > 1 else 0  # one CPU: nothing to split
    auto = (",".join(map(str, cpus[:cut])), ",".join(map(str, cpus[cut:])) if cut else "")
    return (auto[0] if worker_cpus == "auto" else worker_cpus, auto[1] if trainer_cpus == "auto" else trainer_cpus)


def policy_params(policy: str) -> dict:
    """TIDE_POLICY_PARAMS for `--policy`: static runs γ = 3 (the stack's default); the others their defaults."""
    return {"gamma": 3} if policy == "static" else {}


def mode_env(mode: str, args, mode_dir: Path) -> dict[str, dict[str, str]]:
    """Per-service overrides of the stack (tools.launcher.StackConfig.env) for `mode`."""
    resolve_defaults(args)
    worker_cpus, trainer_cpus = placement(args.worker_cpus, args.trainer_cpus)
    env = {"inference": {"TIDE_DRAFT_CACHE_DIR": str(mode_dir / "draft-cache"), "TIDE_CPUS": worker_cpus,
                         "TIDE_POLICY": args.policy, "TIDE_POLICY_PARAMS": json.dumps(policy_params(args.policy)),
                         "TIDE_CHUNK_TOKENS": str(args.chunk_tokens), "TIDE_FLUSH_INTERVAL_S": str(args.flush_s)},
           "trainer": {"TIDE_TRAINER_CPUS": trainer_cpus}}
    if args.scenario == "horizon" and args.traffic == "repetitive":  # online learns text too, static nothing
        env["inference"]["TIDE_SPECULATION_MEMORY_MB"] = f"{args.memory_mb if mode == 'online' else 0:g}"
    if mode == "static":
        env["trainer"].update({"TIDE_TRAINER_AUTO_TRAIN": "0", "TIDE_TRAINER_AUTO_PROMOTE": "0"})
    else:
        need, steps = str(args.min_tokens), args.train_steps
        env["controller"] = {"TIDE_CONTROLLER_COLLECTION": "auto", "TIDE_CONTROLLER_TOKENS_NEEDED": need}
        # a cycle = `--train-steps` steps of 4 packed rows x 512 tokens, at most `--max-epochs` passes over
        # the new chunks and the replayed ones (`--replay` x their tokens, `--replay-recent` of those the newest)
        env["trainer"].update({"TIDE_TRAINER_AUTO_TRAIN": "1", "TIDE_TRAINER_AUTO_PROMOTE": "1",
                               "TIDE_TRAINER_MIN_TOKENS": need, "TIDE_TRAINER_STEPS": str(steps),
                               "TIDE_TRAINER_BATCH_ROWS": "4", "TIDE_TRAINER_WARMUP_STEPS": str(max(1, steps // 6)),
                               "TIDE_TRAINER_MAX_EPOCHS": str(args.max_epochs), "TIDE_TRAINER_REPLAY": str(args.replay),
                               "TIDE_TRAINER_REPLAY_RECENT": str(args.replay_recent)})
        if args.cycle_growth > 0:
            # growing cycles: each waits for `--cycle-growth` x the tokens trained on so far and makes
            # `--max-epochs` passes over its new and replayed tokens, so its steps grow with the data
            env["trainer"].update({"TIDE_TRAINER_MIN_TOKENS_GROWTH": str(args.cycle_growth),
                                   "TIDE_TRAINER_STEPS": "0", "TIDE_TRAINER_EPOCHS": str(args.max_epochs),
                                   "TIDE_TRAINER_MAX_EPOCHS": "0"})
    extra = [parse_env(args.env)] + ([parse_env(args.online_env)] if mode == "online" else [])
    for e in extra:
        for service, kv in e.items():
            env.setdefault(service, {}).update(kv)
    return env


def run_mode(mode: str, args, draft_dir: Path, prompts: list[list[Prompt]], bnds, work: Path,
             warm: list[Prompt] | None = None) -> dict:
    """One mode on a fresh stack: start, starting draft, warm-up, timed phases (+ the A/B when static).
    `warm`: the warm-up prompts (default: each phase's first)."""
    from tools.launcher import Stack, StackConfig

    mode_dir = work / mode
    env = mode_env(mode, args, mode_dir)
    cfg = StackConfig(port=0, workers=1, target=args.target, drafter="eagle3", data_dir=mode_dir, collection=False,
                      env=env, startup_timeout_s=args.startup_timeout)
    stack, t_start = Stack(cfg), time.monotonic()
    print(f"[{mode}] starting the stack in {mode_dir}", flush=True)
    ep = stack.start()
    try:
        # the load generator keeps off the worker's CPUs too, as the stack's other processes do
        with started_on(stack.service_cpus):
            return _serve_mode(mode, args, stack, ep, env, draft_dir, prompts, bnds, t_start, warm)
    finally:
        stack.stop()
        print(f"[{mode}] stack stopped ({time.monotonic() - t_start:.0f} s in all)", flush=True)


def _serve_mode(mode: str, args, stack, ep, env: dict, draft_dir: Path, prompts, bnds, t_start: float,
                warm_prompts: list[Prompt] | None) -> dict:
    """run_mode's traffic on a started stack: starting draft, warm-up, timed phases, the A/B (static),
    the collected chunks (online, horizon scenario)."""
    model_id = worker_status(ep, ep.workers[0]).model_id
    version = start_draft(stack, ep, model_id, draft_dir)
    base = f"http://{ep.gateway_host}:{ep.gateway_port}"
    new_gw = lambda: Gateway(base, model_id, args.max_tokens)  # noqa: E731
    warm = ([(p, bnds[0][0]) for p in warm_prompts] if warm_prompts else
            [(ps[0], name) for ps, (name, _, _) in zip(prompts, bnds, strict=True)])
    run_batch(lambda: Gateway(base, model_id, 16), warm * max(1, args.concurrency // len(warm)), args.concurrency)
    startup_s = time.monotonic() - t_start
    print(f"[{mode}] ready in {startup_s:.0f} s, draft {version}; traffic for {bnds[-1][2]:.0f} s", flush=True)
    worker_pid = next(p.proc.pid for p in stack.processes if p.name.startswith("inference"))
    trainer_pid = next(p.proc.pid for p in stack.processes if p.name == "trainer")
    sched0, cpu0 = run_and_wait_s(worker_pid), cpu_seconds(trainer_pid)
    load0, t0, t0_unix = os.getloadavg()[0], time.monotonic(), time.time()
    clock = lambda: time.monotonic() - t0  # noqa: E731
    poller = Poller(ep, model_id, clock, args.poll_s, cpu_pids={"trainer": trainer_pid})
    poller.start()
    records = drive(new_gw, prompts, bnds, args.concurrency, clock)
    poller.stop()
    sched1, wall = run_and_wait_s(worker_pid), time.monotonic() - t0
    cpu1 = cpu_seconds(trainer_pid)
    end = bnds[-1][2]
    res = {**stats.phase_table(records, bnds), "timeline": stats.timeline(records, end, args.bin_s),
           "collection_intervals": stats.intervals(poller.samples, "collection", end),
           "promotions": stats.promotions(poller.events.values(), poller.drafts,
                                          {o["candidate_version"]: o for o in poller.outcomes.values()},
                                          t0_unix, version),
           "rollbacks": [{**e, "t_s": round(e["time_unix_s"] - t0_unix, 2)} for e in poller.events.values()
                         if e["action"] == "rollback"],
           "training": stats.training_cycles(poller.outcomes.values(), t0_unix),
           "chunk_bytes": next((s["chunk_bytes"] for s in reversed(poller.samples)
                                if s.get("chunk_bytes") is not None), None),
           "starting_version": version, "model_id": model_id, "startup_s": round(startup_s, 1),
           "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],  # at traffic start, end
           # the worker's seconds on a CPU / waiting for one, per second of traffic (all its threads)
           "worker_cpu": None if None in (sched0, sched1) else {
               "run_share": round((sched1[0] - sched0[0]) / wall, 3),
               "wait_share": round((sched1[1] - sched0[1]) / wall, 3)},
           "service_cpus": sorted(stack.service_cpus) if stack.service_cpus else None,
           # the trainer's CPU-seconds (user + system) from traffic start until traffic and the poller ended
           "trainer_cpu_s": None if None in (cpu0, cpu1) else round(cpu1 - cpu0, 1),
           "collected_tokens": trainer_accepted_tokens(ep),
           "run_dir": str(stack.run_dir), "env": env, "samples": poller.samples, "requests": records}
    if mode == "static" and args.ab_rounds > 0:
        res["collection_ab"] = collection_ab(ep, model_id, base, prompts, bnds, args)
    if mode == "online" and args.scenario == "horizon":  # the offline reference trains on these
        from tide.blobs import StorageSettings
        from tools.launcher import BUCKET, service_env

        time.sleep(args.flush_s + 1)  # the workers' last partial chunks
        s3 = StorageSettings.from_env(service_env("trainer", stack.cfg, ep)).s3_client()
        res["collected_chunks"] = horizon.download_chunks(s3, BUCKET, "chunks/",
                                                          Path(stack.cfg.data_dir) / "collected-chunks",
                                                          ep.data_key_file)
        res["collected_tokens"] = trainer_accepted_tokens(ep)
        res["candidates"] = [{**c, "t_s": round(c.pop("created_unix_s") - t0_unix, 2)} for c in
                             fetch_drafts(stack, ep, model_id, Path(stack.cfg.data_dir) / "draft-cache")]
    return res


def collection_ab(ep, model_id: str, base: str, prompts, bnds, args) -> dict:
    """Collection off/on/on/off windows over one fixed request list (see the module doc)."""
    # the last prompts of each phase's list, round-robin over the phases
    items = [(prompts[i % len(prompts)][-1 - i // len(prompts)], bnds[i % len(prompts)][0])
             for i in range(args.ab_requests)]
    new_gw = lambda: Gateway(base, model_id, args.max_tokens)  # noqa: E731
    windows = []
    for rnd in range(args.ab_rounds):
        for on in (False, True, True, False):
            set_collection(ep, model_id, on)
            b0, t = chunk_bytes(ep), time.monotonic()
            recs = run_batch(new_gw, items, args.concurrency)
            w = {"round": rnd, "collection": on, "tokens": sum(r["tokens"] for r in recs),
                 "seconds": round(time.monotonic() - t, 3), "errors": sum(bool(r["error"]) for r in recs),
                 "worker_collection": any(worker_status(ep, a).collection_enabled for a in ep.workers)}
            if on:  # let this window's last chunk flush outside the timed windows
                time.sleep(args.flush_s + 1)
            b1 = chunk_bytes(ep)
            w["chunk_bytes"] = None if None in (b0, b1) else b1 - b0
            windows.append(w)
            print(f"  A/B collection {'on ' if on else 'off'}: {w['tokens'] / w['seconds']:.1f} tok/s, "
                  f"{(w['chunk_bytes'] or 0) / 1e6:.1f} MB of chunks", flush=True)
    set_collection(ep, model_id, False)
    method = (f"static stack after its phases: {len(items)} fixed requests (the last prompts of each phase, greedy, "
              f"max_tokens {args.max_tokens}, concurrency {args.concurrency}) per window, collection forced off/on "
              f"by admin decisions to the worker in ABBA order x {args.ab_rounds}; tok/s = completion tokens / "
              f"window wall time; cost_pct = 100 (1 - median on / median off)")
    return stats.collection_overhead(windows, method)


def resolve_defaults(args) -> None:
    """Fill the options left unset (None) with the scenario's and --quick's defaults (idempotent)."""
    quick = {"phase_s": 150.0, "ab_rounds": 1, "ab_requests": 4, "horizon_s": 900.0, "offline_budget_s": 300.0}
    full = {"phase_s": 300.0, "ab_rounds": 2, "ab_requests": 12, "horizon_s": 2400.0,
            "offline_budget_s": horizon.OFFLINE_MAX_S}
    # the horizon's cycles grow with the data (services.trainer.auto's module doc); the phases' are fixed
    per_scenario = {"cycle_growth": (0.5, 0.0), "replay": (2.0, 4.0), "max_epochs": (2.0, 3.0)}
    defaults = {**(quick if args.quick else full),
                **{k: h if args.scenario == "horizon" else p for k, (h, p) in per_scenario.items()}}
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.scenario == "horizon":
        args.ab_rounds = 0  # the three-phase bench measures collection's cost; here it would eat the horizon


def run(args) -> dict:
    t_start = time.perf_counter()
    resolve_defaults(args)
    if args.draft:
        from tide.eagle3.checkpoint import find_checkpoint_dir

        draft_dir, draft_info = find_checkpoint_dir(args.draft), {"path": str(args.draft), "cached": None}
    else:
        draft_dir, draft_info = starting_draft(args.target, args.bootstrap_minutes, args.seed)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="tide-bench-adapt-"))
    warm, heldout = None, None
    if args.scenario == "horizon":
        from tide.target import cache_dir

        served, held, warm = horizon.horizon_prompts(args.seed, args.max_prompt_chars, args.traffic)
        prompts, bnds = [served], horizon.bounds(args.horizon_s, args.traffic)
        order = horizon.mode_order(args.seed, args.modes)
        heldout, start_eval = horizon.heldout_chunks(draft_dir, args.target, held, args.max_tokens,
                                                     cache_dir() / "bench-adapt")
        draft_info["eval_accept_length_g3"] = start_eval["eval_accept_length_g3"]
    else:
        prompts, bnds, order = phase_prompts(args.seed, args.max_prompt_chars), bounds(args.phase_s), args.modes
    modes = {}
    for mode in order:
        modes[mode] = run_mode(mode, args, draft_dir, prompts, bnds, work, warm=warm)
        if heldout is not None:
            horizon.evaluate_mode(modes[mode], work / mode, draft_dir, heldout, args.horizon_s, args.target)
    res = {"scenario": args.scenario, "target": args.target, "quick": bool(args.quick),
           **({"traffic": args.traffic, "memory_mb": args.memory_mb} if args.scenario == "horizon" else {}),
           "concurrency": args.concurrency,
           "cpus": dict(zip(("worker", "trainer"), placement(args.worker_cpus, args.trainer_cpus), strict=True)),
           "max_tokens": args.max_tokens, "bin_s": args.bin_s, "poll_s": args.poll_s, "seed": args.seed,
           "starting_draft": draft_info, "work_dir": str(work), "modes_order": list(order),
           "phases": [{"name": n, "start_s": a, "end_s": b, "prompts": len(ps)}
                      for (n, a, b), ps in zip(bnds, prompts, strict=True)],
           **modes}
    if set(MODES) <= set(modes):
        res["ratio"] = stats.ratios(modes["static"], modes["online"])
        if heldout is None:
            res["checks"] = stats.checks(modes["static"], modes["online"], bnds)
    res["promotions"] = modes.get("online", {}).get("promotions", [])
    res["collection_overhead"] = modes.get("static", {}).get("collection_ab")
    res["chunk_bytes"] = {m: r["chunk_bytes"] for m, r in modes.items()}
    res["training"] = modes.get("online", {}).get("training")
    res["trainer_cpu_s"] = {m: r.get("trainer_cpu_s") for m, r in modes.items()}
    if heldout is not None and "online" in modes:
        horizon.finish(res, work / "online", draft_dir, heldout, args.target, args.horizon_s, args.offline_budget_s,
                       horizon_trainer_env(args))
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    if not args.keep_data:  # S3 data, trainer outputs, downloaded drafts; the services' logs stay
        for mode in modes:
            for sub in ("s3", "trainer", "draft-cache", "collected-chunks", "offline-reference"):
                shutil.rmtree(work / mode / sub, ignore_errors=True)
    return res


def horizon_trainer_env(args) -> dict[str, str]:
    """The online trainer's variables as this run set them (mode_env), for the offline recipe."""
    return mode_env("online", args, Path("/"))["trainer"]


def print_table(res: dict) -> None:
    if res.get("scenario") == "horizon":
        horizon.print_table(res)
        return
    names = [p["name"] for p in res["phases"]]
    fmt = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    print(f"\n{'':14s}" + "".join(f"{n:>20s}" for n in names + ["overall"]))
    print(f"{'':14s}" + "".join(f"{'tok/s':>11s}{'acc':>9s}" for _ in names + ["overall"]))
    for mode in (m for m in MODES if m in res):
        cells = [res[mode]["phases"][n] for n in names] + [res[mode]["overall"]]
        print(f"{mode:14s}" + "".join(f"{fmt(c['tok_s']):>11s}{fmt(c['accept_length'], 2):>9s}" for c in cells))
    for mode in (m for m in MODES if m in res):  # how much of the output the γ policy chose to speculate
        cells = [res[mode]["phases"][n] for n in names] + [res[mode]["overall"]]
        print(f"{mode + ' drafted':14s}" + "".join(f"{fmt(c.get('drafted_share'), 2):>20s}" for c in cells))
    if "ratio" in res:
        cells = [res["ratio"]["phases"][n] for n in names] + [res["ratio"]["overall"]]
        print(f"{'online/static':14s}" + "".join(f"{fmt(c['tok_s'], 3):>11s}{fmt(c['accept_length'], 3):>9s}"
                                                  for c in cells))
    for p in res["promotions"]:
        print(f"promotion at {p['t_s']:.0f} s: {p['version']} (eval accept length {fmt(p['eval_accept_length'], 2)})")
    tr, co = res.get("training") or {}, res.get("collection_overhead") or {}
    print("trainer CPU-seconds during traffic: " + ", ".join(f"{m} {fmt(c)}" for m, c in
                                                           (res.get("trainer_cpu_s") or {}).items()))
    print(f"training cycles: {tr.get('count', 0)}, mean {fmt(tr.get('mean_duration_s'))} s; chunk bytes: "
          + ", ".join(f"{m} {fmt(None if b is None else b / 1e6, 2)} MB" for m, b in res["chunk_bytes"].items()))
    print(f"collection overhead: off {fmt(co.get('off_tok_s'))} tok/s, on {fmt(co.get('on_tok_s'))} tok/s, "
          f"cost {fmt(co.get('cost_pct'), 2)} %")
    if "checks" in res:
        print("checks: " + json.dumps(res["checks"]["meets"]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", choices=("shifts", "horizon"), default="shifts",
                        help="shifts: chat -> GSM8K -> HumanEval phases; horizon: GSM8K train questions for a long "
                             "horizon, with held-out evals and an offline reference (benchmarks.adapt_horizon)")
    parser.add_argument("--traffic", choices=("gsm8k", "repetitive"), default="gsm8k",
                        help="horizon: GSM8K train questions, or deployment-like traffic that repeats across requests "
                             "(FAQ questions, templated extraction, coding agents; benchmarks.workloads), where online "
                             "adds the speculation memory to the fine-tune [gsm8k]")
    parser.add_argument("--memory-mb", type=float, default=64.0,
                        help="horizon, repetitive traffic: the online worker's TIDE_SPECULATION_MEMORY_MB [64]")
    parser.add_argument("--quick", action="store_true", help="shifts: 3 x 150 s phases per mode, one A/B round "
                                                             "(< 20 min); horizon: 15 minutes per mode")
    parser.add_argument("--horizon-s", type=float, default=None,
                        help="horizon: seconds of traffic per mode [quick 900, full 2400]")
    parser.add_argument("--offline-budget-s", type=float, default=None,
                        help="horizon: the offline reference's training seconds at most [quick 300, full 1200]")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plots", type=Path, help="directory for adapt.png, loop.png and policy.png")
    parser.add_argument("--target", default="ref")
    parser.add_argument("--draft", help="starting EAGLE-3 checkpoint dir (default: the cached bootstrap on prompts "
                                        "no phase serves)")
    # 5 minutes left a 2-CPU machine at 100 tok/s with 5 training steps: accept length 1.02, no draft at
    # all; 15 gave 1.35 on held-out chat (docs/results/adapt, "The trainer on its own core")
    parser.add_argument("--bootstrap-minutes", type=float, default=15.0,
                        help="budget of the starting draft's bootstrap when it is not cached [15]")
    parser.add_argument("--phase-s", type=float, default=None, help="seconds per phase [quick 150, full 300]")
    parser.add_argument("--concurrency", type=int, default=4, help="closed-loop clients [4]")
    parser.add_argument("--policy", default="adaptive", choices=POLICY_NAMES,
                        help="the workers' γ policy in both modes (TIDE_POLICY) [adaptive: whether and how far to "
                             "speculate, from the latency profile and live acceptance]")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request [128]")
    parser.add_argument("--max-prompt-chars", type=int, default=1500, help="longer prompts are skipped [1500]")
    parser.add_argument("--min-tokens", type=int, default=2048,
                        help="online trainer: TIDE_TRAINER_MIN_TOKENS, buffered tokens a cycle needs [2048]")
    parser.add_argument("--train-steps", type=int, default=24,
                        help="online trainer: TIDE_TRAINER_STEPS, optimizer steps per cycle (batches of 4 x 512) [24]")
    # 24 steps on one cycle's ≈ 2k new + 2k replayed tokens are ≈ 10 passes: candidates memorised them and
    # 14 of 16 were not better (docs/results/adapt, run b1); a window of the
    # newest chunks, 3 passes
    parser.add_argument("--max-epochs", type=float, default=None,
                        help="online trainer: TIDE_TRAINER_MAX_EPOCHS, passes over a cycle's data at most (with "
                             "--cycle-growth: the passes) [shifts 3, horizon 2]")
    parser.add_argument("--replay", type=float, default=None,
                        help="online trainer: TIDE_TRAINER_REPLAY, replayed tokens per new token [shifts 4, horizon 2]")
    parser.add_argument("--cycle-growth", type=float, default=None,
                        help="online trainer: TIDE_TRAINER_MIN_TOKENS_GROWTH; > 0 also trains --max-epochs passes per "
                             "cycle instead of --train-steps steps (cycles that grow with the data) "
                             "[shifts 0, horizon 0.5]")
    parser.add_argument("--replay-recent", type=float, default=0.75,
                        help="online trainer: TIDE_TRAINER_REPLAY_RECENT, share of them from the newest chunks [0.75]")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="workers' TIDE_CHUNK_TOKENS (rows per chunk)")
    parser.add_argument("--flush-s", type=float, default=10.0, help="workers' TIDE_FLUSH_INTERVAL_S [10]")
    parser.add_argument("--worker-cpus", default="auto",
                        help='the worker\'s TIDE_CPUS in both modes: "auto" = the CPUs the trainer does not get, '
                             '"" = all')
    parser.add_argument("--trainer-cpus", default="auto",
                        help='the trainer\'s TIDE_TRAINER_CPUS in both modes: "auto" = the upper half of the CPUs '
                             '(at least one), "" = all (it then competes with the worker at nice 10)')
    parser.add_argument("--env", action="append", default=[], metavar="SERVICE:KEY=VALUE",
                        help="extra service variable for both modes (repeatable)")
    parser.add_argument("--online-env", action="append", default=[], metavar="SERVICE:KEY=VALUE",
                        help="extra service variable for the online mode, e.g. trainer:TIDE_TRAINER_EPOCHS=4")
    parser.add_argument("--ab-rounds", type=int, default=None, help="ABBA rounds of the collection A/B [quick 1, 2]")
    parser.add_argument("--ab-requests", type=int, default=None, help="requests per A/B window [quick 4, full 12]")
    parser.add_argument("--poll-s", type=float, default=2.0, help="seconds between state samples [2]")
    parser.add_argument("--bin-s", type=float, default=10.0, help="timeline bin width in seconds [10]")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="modes to run [both]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", help="stacks' data and logs [a new temp dir]")
    parser.add_argument("--keep-data", action="store_true", help="keep S3 data, trainer outputs, drafts (logs stay)")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds each service may take to start")


def run_cli(args) -> int:
    from benchmarks.adapt_plots import plot, plot_horizon

    res = run(args)
    if args.plots and set(MODES) <= set(res):
        res["plots"] = plot_horizon(res, args.plots) if res.get("scenario") == "horizon" else plot(res, args.plots)
    print_table(res)
    write_json(res, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    return standalone_main("tide bench adapt", __doc__, add_arguments, run_cli, argv)

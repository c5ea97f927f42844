"""Where does the online loop's cost to serving come from: the trainer's compute, or collection? (#34)

    .venv/bin/python -m benchmarks.experiments.loop_tax [--rounds 4] [--window-requests 16] [--json F]

Every quick horizon run so far served 5-13 % slower in its online mode from the first minute, before
any promotion. Three things run there that static lacks: the trainer (SCHED_IDLE, on the other
CPU), the capture and export of hidden states (in the worker's process, on its CPU), and hot swaps.
This experiment serves the same fixed request list in windows over a 2 x 2 design on one stack:

- trainer running or paused (SIGSTOP / SIGCONT to its process: a paused trainer holds its memory
  and does nothing; the only way to take it off the machine without a restart between windows);
- collection on or off (admin decisions to the worker, as `tide bench adapt`'s collection A/B).

The stack is the horizon bench's (`tide bench adapt --scenario horizon`): worker on CPU 0, the
other services and this load generator on the rest, the horizon's starting draft, 4 closed-loop
clients, greedy, GSM8K train questions. The trainer trains one long run (no promotions, so no hot
swaps) on chunks collected while priming. One untimed window puts the windows' prompts in the prefix
cache; then windows go A B C D D C B A ...; each generates identical tokens (greedy, the same
requests). Printed per arm: median tokens/s, the trainer's CPU share (it was training: ~1 when
running), the worker's CPU share and its threads' wait for a CPU (time runnable but not running,
per second: CPU-time taken from the worker on its own CPU, e.g. by the export threads, shows here).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import adapt
from benchmarks import adapt_horizon as horizon
from benchmarks.adapt_stack import (
    Gateway,
    run_batch,
    set_collection,
    start_draft,
    trainer_accepted_tokens,
    worker_status,
)
from tide.resources import cpu_seconds, run_and_wait_s, started_on

ARMS = (("running", False), ("running", True), ("paused", True), ("paused", False))
SETTLE_S = 2.0  # after flipping an arm, before its window is timed


def horizon_args(argv: list[str]) -> argparse.Namespace:
    """The horizon bench's settings (its defaults unless given), for the stack's environment."""
    parser = argparse.ArgumentParser()
    adapt.add_arguments(parser)
    args = parser.parse_args(["--scenario", "horizon", *argv])
    adapt.resolve_defaults(args)
    return args


def stack_env(hargs: argparse.Namespace, mode_dir: Path) -> dict[str, dict[str, str]]:
    """The static mode's stack, with a trainer that trains one long run and never promotes."""
    env = adapt.mode_env("static", hargs, mode_dir)
    env["trainer"].update(
        {
            "TIDE_TRAINER_AUTO_TRAIN": "1",
            "TIDE_TRAINER_AUTO_PROMOTE": "0",
            "TIDE_TRAINER_MIN_TOKENS": "2048",
            "TIDE_TRAINER_STEPS": "100000",
            "TIDE_TRAINER_MAX_EPOCHS": "0",
            "TIDE_TRAINER_BATCH_ROWS": "4",
        }
    )
    return env


def window(ep, worker_pid: int, trainer_pid: int, new_gw, items, concurrency: int) -> dict:
    run0, cpu0, t0 = run_and_wait_s(worker_pid), cpu_seconds(trainer_pid), time.monotonic()
    recs = run_batch(new_gw, items, concurrency)
    wall = time.monotonic() - t0
    run1, cpu1 = run_and_wait_s(worker_pid), cpu_seconds(trainer_pid)
    tokens = sum(r["tokens"] for r in recs)
    return {
        "tok_s": tokens / wall,
        "tokens": tokens,
        "seconds": round(wall, 2),
        "errors": sum(bool(r["error"]) for r in recs),
        "trainer_cpu_share": round((cpu1 - cpu0) / wall, 3),
        "worker_cpu_share": round((run1[0] - run0[0]) / wall, 3),
        "worker_wait_share": round((run1[1] - run0[1]) / wall, 3),
    }


def summarize(windows: list[dict]) -> dict:
    arms = {}
    for trainer, on in ARMS:
        ws = [w for w in windows if w["trainer"] == trainer and w["collection"] == on]
        arms[f"trainer {trainer}, collection {'on' if on else 'off'}"] = {
            k: round(statistics.median(w[k] for w in ws), 3)
            for k in ("tok_s", "trainer_cpu_share", "worker_cpu_share", "worker_wait_share")
        }
    base = arms["trainer paused, collection off"]["tok_s"]
    cost = {name: round(100 * (1 - a["tok_s"] / base), 2) for name, a in arms.items()}
    return {"arms": arms, "cost_pct_vs_paused_off": cost}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="halves: A B C D, then D C B A, ... [4]")
    ap.add_argument("--window-requests", type=int, default=16, help="requests per window [16]")
    ap.add_argument("--prime-tokens", type=int, default=4096, help="collected before the trainer starts [4096]")
    ap.add_argument("--json", type=Path)
    args, rest = ap.parse_known_args(argv)
    hargs = horizon_args(rest)
    from tools.launcher import Stack, StackConfig

    draft_dir, _ = adapt.starting_draft(hargs.target, hargs.bootstrap_minutes, hargs.seed)
    served, _, warm = horizon.horizon_prompts(hargs.seed, hargs.max_prompt_chars)
    items = [(p, "gsm8k") for p in served[: args.window_requests]]
    priming = [(p, "gsm8k") for p in served[args.window_requests :]]
    work = Path(tempfile.mkdtemp(prefix="tide-loop-tax-"))
    cfg = StackConfig(
        port=0,
        workers=1,
        target=hargs.target,
        drafter="eagle3",
        data_dir=work,
        collection=False,
        env=stack_env(hargs, work),
        startup_timeout_s=hargs.startup_timeout,
    )
    stack = Stack(cfg)
    ep = stack.start()
    trainer_pid = next(p.proc.pid for p in stack.processes if p.name == "trainer")
    try:
        with started_on(stack.service_cpus):
            model_id = worker_status(ep, ep.workers[0]).model_id
            start_draft(stack, ep, model_id, draft_dir)
            worker_pid = next(p.proc.pid for p in stack.processes if p.name.startswith("inference"))
            base = f"http://{ep.gateway_host}:{ep.gateway_port}"
            new_gw = lambda: Gateway(base, model_id, hargs.max_tokens)  # noqa: E731
            run_batch(new_gw, [(p, "gsm8k") for p in warm], hargs.concurrency)
            set_collection(ep, model_id, True)  # prime: chunks for the trainer's run
            while (trainer_accepted_tokens(ep) or 0) < args.prime_tokens:
                run_batch(new_gw, priming[: hargs.concurrency * 2], hargs.concurrency)
                priming = priming[hargs.concurrency * 2 :]
            cpu, t = cpu_seconds(trainer_pid), time.monotonic()
            while cpu_seconds(trainer_pid) - cpu < 0.5 * (time.monotonic() - t) or time.monotonic() - t < 10:
                time.sleep(1.0)  # until the trainer is training (its run starts within TIDE_TRAINER_AUTO_CHECK_S)
            print(f"primed: {trainer_accepted_tokens(ep)} tokens collected, trainer training", flush=True)
            run_batch(new_gw, items, hargs.concurrency)  # untimed: the windows' prompts into the prefix cache
            windows = []
            for rnd in range(args.rounds):
                for trainer, on in ARMS if rnd % 2 == 0 else ARMS[::-1]:
                    os.kill(trainer_pid, signal.SIGCONT if trainer == "running" else signal.SIGSTOP)
                    set_collection(ep, model_id, on)
                    time.sleep(SETTLE_S)
                    w = {
                        "round": rnd,
                        "trainer": trainer,
                        "collection": on,
                        **window(ep, worker_pid, trainer_pid, new_gw, items, hargs.concurrency),
                        "worker_collection": worker_status(ep, ep.workers[0]).collection_enabled,
                    }
                    windows.append(w)
                    print(json.dumps(w), flush=True)
    finally:
        os.kill(trainer_pid, signal.SIGCONT)
        stack.stop()
    res = {
        "windows": windows,
        **summarize(windows),
        "concurrency": hargs.concurrency,
        "max_tokens": hargs.max_tokens,
        "window_requests": args.window_requests,
        "cpus": os.cpu_count(),
    }
    for name, a in res["arms"].items():
        print(
            f"{name:<34} {a['tok_s']:7.1f} tok/s  cost {res['cost_pct_vs_paused_off'][name]:6.2f} %  "
            f"trainer CPU {a['trainer_cpu_share']:.2f}  worker CPU {a['worker_cpu_share']:.2f} "
            f"wait {a['worker_wait_share']:.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

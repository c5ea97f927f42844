"""Does a busy CPU 1 slow a worker pinned to CPU 0 through the scheduler? (#6; the table "The worker's CPU is
its alone" in docs/results/adapt)

    TIDE_CPUS=0 TIDE_TRAINER_CPUS=1 .venv/bin/tide up --port 8000 --no-collection &   # wait for "stack ready"
    .venv/bin/python benchmarks/experiments/sched_exp.py 50 idle,spin,spin+pin,idle+pin,spin,spin+pin,mem,mem+pin

Per condition, 2 closed-loop clients send GSM8K questions (greedy, 128 tokens) to the gateway for
the given seconds; printed: completion tokens/s, and the worker's CPU time and run-queue wait per
second (schedstat, all its threads). Conditions: `idle` CPU 1 idle; `spin` a nice-10 Python busy
loop on CPU 1; `mem` a nice-10 64 MB copy loop on CPU 1; `+pin` also moves every other service of
the stack (gateway, controller, registry, Redis, S3) and this client to CPU 1, as `tide up` now does
by itself when the worker has TIDE_CPUS.
"""

import glob
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tide.resources import run_and_wait_s

GATEWAY = "http://127.0.0.1:8000/v1"
SPIN = "while True: pass"
MEM = "import numpy as np\na = np.ones(64 * 2**20 // 8)\nb = np.empty_like(a)\nwhile True: np.copyto(b, a)"


def place(pids: list[int], cpus: str) -> None:
    for pid in pids:
        subprocess.run(["taskset", "-a", "-p", "-c", cpus, str(pid)], stdout=subprocess.DEVNULL, check=False)
    os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def drive(worker: int, prompts: list[str], seconds: float) -> tuple[float, float, float]:
    stop, lock, tokens, served = time.time() + seconds, threading.Lock(), [0], [0]

    def client() -> None:
        with httpx.Client(base_url=GATEWAY, timeout=300) as c:
            while time.time() < stop:
                with lock:
                    question = prompts[served[0] % len(prompts)]
                    served[0] += 1
                r = c.post("/chat/completions", json={"model": "SmolLM2-135M-Instruct", "max_tokens": 128,
                                                      "temperature": 0,
                                                      "messages": [{"role": "user", "content": question}]})
                with lock:
                    tokens[0] += r.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client) for _ in range(2)]
    t0, (run0, wait0) = time.time(), run_and_wait_s(worker)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed, (run1, wait1) = time.time() - t0, run_and_wait_s(worker)
    return tokens[0] / elapsed, (run1 - run0) / elapsed, (wait1 - wait0) / elapsed


def main() -> None:
    seconds, conditions = float(sys.argv[1]), sys.argv[2].split(",")
    state = json.loads(Path(sorted(glob.glob("var/run-*/stack.json"))[-1]).read_text())
    worker = state["pids"]["inference-0"]
    others = [pid for name, pid in state["pids"].items() if name not in ("inference-0", "trainer")]
    lines = Path("/work/shared/data/gsm8k_test.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["question"] for line in lines[:400]]
    load = None
    for cond in conditions:
        if load:
            load.kill()
            load.wait()
            load = None
        kind, _, pinned = cond.partition("+")
        place(others, "1" if pinned else "0,1")
        if kind in ("spin", "mem"):
            load = subprocess.Popen(["taskset", "-c", "1", "nice", "-n", "10", sys.executable, "-c",
                                     SPIN if kind == "spin" else MEM])
        time.sleep(3)
        tok_s, run, wait = drive(worker, prompts, seconds)
        print(f"{cond:12s} tok/s {tok_s:6.1f}  worker cpu {run:.2f}  runqueue-wait {wait:.3f}", flush=True)
    if load:
        load.kill()
    place(others, "0,1")


if __name__ == "__main__":
    main()

"""Does a training trainer on CPU 1 make speculation dearer for a worker on CPU 0? (#6)

    .venv/bin/python benchmarks/experiments/verify_interference.py CHUNKS_DIR DRAFT_DIR

T(b = 2, n) for n = 1..5 new tokens per sequence (the verify forward of γ = n − 1; the fastest of
15 rounds, tide.engine.profiling.profile_target) on CPU 0 with one torch thread, while CPU 1
runs nothing or `tide draft finetune` (4 rows per step, one thread). Windows: idle, train, idle,
train; the finetune gets `SETTLE_S` to load its data first, and its CPU share over the window is
printed to show it was training.
"""

import os
import subprocess
import sys
import time

import psutil
import torch

sys.path.insert(0, os.getcwd())
from tide.engine.llama import LlamaModel  # noqa: E402
from tide.engine.profiling import profile_target  # noqa: E402
from tide.precision import resolve_dtype  # noqa: E402
from tide.target import resolve_target  # noqa: E402

SETTLE_S = 50.0
NS = (1, 2, 3, 4, 5)


def main() -> None:
    chunks, draft = sys.argv[1], sys.argv[2]
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    model = LlamaModel.load(resolve_target("ref"), dtype=resolve_dtype("auto"))
    profile_target(model, [2], NS, 15)  # warm-up
    for kind in ("idle", "train", "idle", "train"):
        p = None
        if kind == "train":
            p = subprocess.Popen(["taskset", "-c", "1", ".venv/bin/tide", "draft", "finetune", "--from", draft,
                                  "--chunks", chunks, "--out", "/tmp/verify-interference-ft", "--steps", "100000",
                                  "--batch-rows", "4", "--threads", "1", "--no-progress"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(SETTLE_S)
        try:
            procs = [psutil.Process(p.pid)] if p else []
            cpu0, t0 = sum(x.cpu_times().user for x in procs), time.time()
            t = profile_target(model, [2], NS, 15)[2]
            share = (sum(x.cpu_times().user for x in procs) - cpu0) / (time.time() - t0)
        finally:
            if p:
                p.kill()
                p.wait()
        print(f"{kind:5s} " + " ".join(f"T(2,{n})={t[n]:.1f}" for n in NS) + f"  T(2,4)/T(2,1)={t[4] / t[1]:.3f}"
              + (f"  trainer CPU share {share:.2f}" if p else ""), flush=True)


if __name__ == "__main__":
    main()

"""Does work pinned to the other CPU slow a worker pinned to CPU 0? (#6: the online mode's worker
shares the machine with a training trainer, the static mode's with an idle one.)

    .venv/bin/python benchmarks/experiments/interference.py CHUNKS_DIR DRAFT_DIR

Greedy decoding of the reference model (bf16 engine, 2 sequences, as the bench's 2 clients) on
CPU 0 with one torch thread, measured for `SECONDS` per window while CPU 1 runs: nothing; the
trainer's work (`tide draft finetune` at 4 rows per step, one thread, taskset to CPU 1); a
cache-resident matmul loop (compute only, no memory traffic). Windows in the order idle, train,
compute, idle, train, compute; tokens/s per window and the medians per load are printed.
"""

import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from tide.engine.llama import LlamaModel  # noqa: E402
from tide.engine.sequence import SamplingParams  # noqa: E402
from tide.precision import resolve_dtype  # noqa: E402
from tide.target import load_tokenizer, resolve_target  # noqa: E402
from tools.draft.generation import make_engine  # noqa: E402

SECONDS = 25.0  # per measured window
SETTLE_S = 20.0  # after starting a load: the finetune loads the target's head and its data first
BURNER = ("import torch; torch.set_num_threads(1); a = torch.randn(128, 128)\n"
          "while True: a = torch.tanh(a @ a)")  # 64 KiB operands: stays in L1/L2


def decode_tok_s(engine, prompts: list[list[int]], seconds: float) -> float:
    params, done, t0, n = SamplingParams(max_tokens=128), 0, time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{n}-{i}", ids, params, False)
        n += 1
        while engine.has_work():
            done += sum(len(out.new_token_ids) for out in engine.step())
    return done / (time.perf_counter() - t0)


def load(kind: str, chunks: str, draft: str) -> subprocess.Popen | None:
    if kind == "idle":
        return None
    cmd = [sys.executable, "-c", BURNER] if kind == "compute" else [
        ".venv/bin/tide", "draft", "finetune", "--from", draft, "--chunks", chunks, "--out", "/tmp/interference-ft",
        "--steps", "100000", "--batch-rows", "4", "--threads", "1", "--no-progress"]
    p = subprocess.Popen(["taskset", "-c", "1", *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(SETTLE_S)
    return p


def main() -> None:
    chunks, draft = sys.argv[1], sys.argv[2]
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    target = resolve_target("ref")
    tok = load_tokenizer(target)
    prompts = [tok.encode(t) for t in ("Write a short story about a lighthouse keeper.",
                                       "Explain how a refrigerator works, step by step.")]
    engine = make_engine(LlamaModel.load(target, dtype=resolve_dtype("auto")), 2, 512, 128)
    decode_tok_s(engine, prompts, 5.0)  # warm-up
    results: dict[str, list[float]] = {}
    for kind in ("idle", "train", "compute", "idle", "train", "compute"):
        p = load(kind, chunks, draft)
        try:
            rate = decode_tok_s(engine, prompts, SECONDS)
        finally:
            if p is not None:
                p.kill()
                p.wait()
        results.setdefault(kind, []).append(rate)
        print(f"{kind:8s} {rate:6.1f} tok/s", flush=True)
    base = sorted(results["idle"])[len(results["idle"]) // 2]
    for kind, rates in results.items():
        med = sorted(rates)[len(rates) // 2]
        print(f"median {kind:8s} {med:6.1f} tok/s  x{med / base:.3f} of idle")


if __name__ == "__main__":
    main()

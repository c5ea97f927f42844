"""What a status call's tensor walk cost with a speculation memory, with and without its marker.

    python -m benchmarks.experiments.memory_walk [--tokens 20000 80000]

Fills a SpeculationMemory with random 384-token requests (a 256-token prompt tail and 128 output
tokens) up to each size and times `tide.memory.tensor_bytes` on an object holding it (as the
hybrid drafter holds the engine's memory, and the worker's memory report walks the drafter every
GetStatus): once skipping it (`holds_tensors = False`, the classes' setting) and once walking it.
"""

from __future__ import annotations

import argparse
import random
import time

from tide.engine.drafters.memory import SpeculationMemory, SuffixIndex
from tide.memory import tensor_bytes


class Holder:
    def __init__(self, memory: SpeculationMemory) -> None:
        self.memory = memory


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[20_000, 80_000])
    args = ap.parse_args(argv)
    rng = random.Random(0)
    for n in args.tokens:
        memory = SpeculationMemory(1 << 30)
        while memory.tokens < n:
            doc = [rng.randrange(49152) for _ in range(384)]
            memory.add("", doc[:256], doc[256:])
        times = {}
        for walked in (False, True):
            SuffixIndex.holds_tensors = SpeculationMemory.holds_tensors = walked
            t0 = time.perf_counter()
            tensor_bytes(Holder(memory))
            times[walked] = (time.perf_counter() - t0) * 1e3
        SuffixIndex.holds_tensors = SpeculationMemory.holds_tensors = False
        print(f"{memory.tokens} tokens ({memory.nbytes / 2**20:.1f} MiB): skipped {times[False]:.1f} ms, "
              f"walked {times[True]:.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

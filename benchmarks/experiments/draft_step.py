"""What an EAGLE-3 proposal costs with the draft step in one kernel call (tide.kernels' draft_layer,
the default), with bf16 and with int8 projections, against the same draft's torch-op step, side by
side in one process: chains of
γ = 1, 3, 5 and a 4:2:7 tree at batch 1, 300 cached tokens, each timed right after a target
forward (the draft's weights cold, as in the engine) and again at once (warm). Medians in ms.

    python -m benchmarks.experiments.draft_step --draft tide/starter_drafts/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.features import FeatureStore
from tide.engine.llama import LlamaModel
from tide.engine.model_runner import ModelRunner
from tide.engine.profiling import fake_seqs
from tide.policies import TreeShape
from tide.target import resolve_target

CONTEXT = 300  # cached tokens: a held-out prompt and part of its answer
KINDS = (1, 3, 5, TreeShape(4, 2, 7))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True, help="EAGLE-3 checkpoint directory")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    model = LlamaModel.load(resolve_target("ref"), dtype=torch.bfloat16)
    load = partial(Eagle3Drafter.from_checkpoint, args.draft, model, "draft", 1, 2048)
    arms = {"one call, bf16": load(weights="float"), "torch ops, bf16": load(fused_step=False, weights="float"),
            "one call, int8": load(weights="int8")}
    store = FeatureStore(1, CONTEXT + 64, 3 * model.cfg.hidden_size, model.dtype, model.device)
    store.rows.normal_(generator=torch.Generator().manual_seed(0))
    seqs = fake_seqs(1, CONTEXT)
    runner = ModelRunner(model, 1, CONTEXT + 16, 8)
    for drafter in arms.values():
        drafter.add_sequence(seqs[0])

    def propose(drafter: Eagle3Drafter, kind) -> float:
        drafter._consumed[seqs[0].request_id] = seqs[0].num_cached - 1  # one new feature row, as each step
        t0 = time.perf_counter()
        if isinstance(kind, TreeShape):
            drafter.propose_tree(seqs, [kind], store, [None])
        else:
            drafter.propose(seqs, [kind], store, [None])
        return (time.perf_counter() - t0) * 1e3

    times: dict[tuple[str, str, bool], list[float]] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, drafter in arms.items():
                for kind in KINDS:
                    runner.run(seqs, [[7] * 4], [CONTEXT], [0], False)  # a verify forward: caches cold
                    times.setdefault((name, str(kind), False), []).append(propose(drafter, kind))
                    times.setdefault((name, str(kind), True), []).append(propose(drafter, kind))
    print(f"{'proposal':>24} {'warm':>5} " + " ".join(f"{n:>16}" for n in arms) + "    torch / one call (bf16, int8)")
    for kind in KINDS:
        for warm in (False, True):
            ms = [statistics.median(times[(n, str(kind), warm)]) for n in arms]
            label = f"tree {kind.key()}" if isinstance(kind, TreeShape) else f"chain γ={kind}"
            print(f"{label:>24} {'yes' if warm else 'no':>5} " + " ".join(f"{m:16.2f}" for m in ms)
                  + f"    {ms[1] / ms[0]:.2f}x {ms[1] / ms[2]:.2f}x")


if __name__ == "__main__":
    main()

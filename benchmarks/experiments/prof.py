"""Seconds per training step on a bootstrap's chunks (the bootstrap's batch: 2 rows x 512, bf16 autocast).

    .venv/bin/python benchmarks/experiments/prof.py var/boot19/chunks/train [STEPS]
    TTT=1 ...  unrolled steps per batch (default 3); PROF=1 ... also a torch.profiler table of 10 steps
"""

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.getcwd())
from services.trainer.training.data import collate, load_dataset, plan_batches  # noqa: E402
from services.trainer.training.head import TargetHead  # noqa: E402
from services.trainer.training.objective import Eagle3Objective  # noqa: E402
from services.trainer.training.run import build_draft  # noqa: E402
from tide.target import resolve_target  # noqa: E402

head = TargetHead.load(resolve_target("ref"))
files = sorted(Path(sys.argv[1]).iterdir())[:12]
data = load_dataset((f.read_bytes() for f in files), head, 512)
draft = build_draft(head, data, None, 8192, 0)
draft.set_embedding(head.embed)
draft.train()
targets = torch.arange(8192) + draft.d2t
objective = Eagle3Objective(draft, head.lm_head[targets], int(os.environ.get("TTT", "3")))
optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-3, betas=(0.9, 0.95))
plan = plan_batches([len(p) for p in data.pieces], 2, 512, 0, 0)
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20


def step(rows) -> None:
    batch = collate(data.pieces, rows)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = objective(batch)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)
    optimizer.step()


for rows in plan[:3]:  # warm-up: first-step allocations
    step(rows)
t = time.perf_counter()
for rows in plan[3:3 + steps]:
    step(rows)
print(f"{(time.perf_counter() - t) / steps:.3f} s/step", flush=True)
if os.environ.get("PROF"):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for rows in plan[3:13]:
            step(rows)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=35))

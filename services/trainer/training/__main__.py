"""`python -m services.trainer.training --target ref --data DIR|s3://bucket/prefix --out DIR [...]`

Trains (from scratch, or from --init CHECKPOINT) and exports a draft; prints the evaluation summary
as JSON. Runs under `torchrun --nproc-per-node N` for DDP.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

import torch.distributed as dist

from services.trainer.training.loop import TrainConfig
from services.trainer.training.run import DRAFT_VOCAB, train_draft
from tide.allocator import keep_freed_memory


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m services.trainer.training", description=__doc__.splitlines()[0])
    p.add_argument("--target", default="ref", help="'ref', a HF directory or a .gguf file")
    p.add_argument("--data", required=True, help="directory of chunk files or s3://bucket/prefix")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--init", default=None, help="fine-tune from this checkpoint (default: from scratch)")
    p.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB)
    p.add_argument("--eval-fraction", type=float, default=0.1)
    p.add_argument("--expected-target", default=None, help="refuse chunks of another target model id")
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("betas",):
            continue
        kind = {"int | None": int, "str | None": str}.get(str(f.type)) or type(f.default)
        if kind is bool:
            p.add_argument(f"--{f.name.replace('_', '-')}", type=lambda s: s.lower() in ("1", "true", "yes"),
                           default=f.default)
        else:
            p.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default)
    a = p.parse_args(argv)
    keep_freed_memory()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = TrainConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(TrainConfig) if f.name != "betas"})
    try:
        summary = train_draft(a.target, a.data, a.out, init=a.init, cfg=cfg, draft_vocab_size=a.draft_vocab,
                              eval_fraction=a.eval_fraction, expected_target=a.expected_target)
        print(json.dumps({k: summary[k] for k in ("train", "baseline", "candidate")}, indent=2))
    finally:
        # Under torchrun: tear gloo/NCCL down before interpreter exit (left to static destructors,
        # a rank sometimes aborted with "terminate called without an active exception").
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()

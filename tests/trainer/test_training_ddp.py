"""DDP under torchrun (2 CPU processes, gloo): ranks stay in sync, rank 0 exports; and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tide.eagle3 import validate_checkpoint_dir

ROOT = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent("""
    import hashlib, os, sys
    import torch
    from services.trainer.training import TargetHead, TrainConfig, load_dataset, train
    from services.trainer.training.run import build_draft
    from tide.target import TargetFiles

    target, data_dir, out = sys.argv[1:4]
    torch.set_num_threads(1)
    head = TargetHead.load(TargetFiles("tiny-llama", __import__("pathlib").Path(target)))
    data = load_dataset(data_dir, head, max_len=64)
    draft = build_draft(head, data, draft_vocab_size=32)
    cfg = TrainConfig(steps=4, batch_rows=2, max_len=64, warmup_steps=1, progress=False)
    result = train(draft, head, data, cfg)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in draft.parameters())).hexdigest()
    rank = os.environ["RANK"]
    open(os.path.join(out, f"rank{rank}.txt"), "w").write(f"{digest} {result.tokens}")
""")


def _run(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _chunk_dir(blobs: list[bytes], path: Path) -> Path:
    """`path`, a new directory holding the chunk blobs as files."""
    path.mkdir()
    for i, blob in enumerate(blobs):
        (path / f"{i:03d}").write_bytes(blob)
    return path


@pytest.mark.slow
def test_ddp_ranks_stay_in_sync(copy_target, copy_chunks, tmp_path):
    data = _chunk_dir(copy_chunks, tmp_path / "chunks")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 str(script), str(copy_target.path), str(data), str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (d0, tokens0), (d1, tokens1) = ((tmp_path / f"rank{r}.txt").read_text().split() for r in (0, 1))
    assert d0 == d1  # gradients were all-reduced: identical parameters on both ranks
    assert tokens0 == tokens1 and int(tokens0) > 0  # counted over both ranks


@pytest.mark.slow
def test_cli_trains_and_exports(copy_target, copy_chunks, tmp_path):
    data = _chunk_dir(copy_chunks, tmp_path / "chunks")
    out = tmp_path / "draft"
    proc = _run([sys.executable, "-m", "services.trainer.training", "--target", str(copy_target.path),
                 "--data", str(data), "--out", str(out), "--steps", "3", "--batch-rows", "2", "--max-len", "64",
                 "--draft-vocab", "32", "--progress", "false", "--warmup-steps", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["train"]["steps"] == 3 and summary["candidate"]["chains"] > 0
    assert validate_checkpoint_dir(out).draft_vocab_size == 32

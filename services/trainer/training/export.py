"""Export a trained draft: the SGLang/vLLM checkpoint directory plus `training_record.json`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tide.eagle3 import Eagle3Draft, save_checkpoint

RECORD_FILE = "training_record.json"


def export_draft(path, draft: Eagle3Draft, args: dict, chunk_ids: list[str], evaluation: dict | None = None,
                 target_model: str = "", parent: str | None = None) -> Path:
    """Write `draft` (in its config's dtype) to `path` with a record of how it was made: training
    arguments, the chunk ids it learned from, evaluation results, target model and parent draft
    (the checkpoint it was fine-tuned from, None when trained from scratch)."""
    path = Path(path)
    record = {
        "created_at": time.time(),
        "target_model": target_model,
        "parent": parent,
        "args": args,
        "chunk_ids": list(chunk_ids),
        "evaluation": evaluation or {},
    }
    save_checkpoint(draft, path, extra={"target_model": target_model, "parent": parent, "record": RECORD_FILE})
    (path / RECORD_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


def read_record(path) -> dict:
    return json.loads((Path(path) / RECORD_FILE).read_text())

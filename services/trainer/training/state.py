"""Resumable training state: fp32 draft tensors + AdamW moments in safetensors, the rest in JSON.

Layout of a state directory:
    train_state.json                 progress (step, epoch, batch within epoch), optimizer param
                                     groups and scalar state, training config, draft config.json;
                                     written last and atomically, so it names a complete weights file
    train_state-<step>.safetensors   "draft.<name>" (parameters and vocab maps, fp32) and
                                     "optim.<param index>.<key>" (AdamW step, exp_avg, exp_avg_sq)
No pickle. Older weights files are removed once a newer state is committed.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tide.eagle3 import Eagle3Config, Eagle3Draft

STATE_JSON = "train_state.json"
STATE_VERSION = 1


def save_state(path, draft: Eagle3Draft, optimizer: torch.optim.Optimizer, progress: dict, config: dict) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {f"draft.{k}": v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
    opt = optimizer.state_dict()
    scalars: dict[str, dict] = {}
    for idx, st in opt["state"].items():
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"optim.{idx}.{key}"] = val.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = val
    weights = f"train_state-{int(progress['step'])}.safetensors"
    fd, tmp = tempfile.mkstemp(prefix=".train_state.", suffix=".safetensors", dir=path)
    os.close(fd)
    save_file(tensors, tmp)
    os.replace(tmp, path / weights)  # atomic: a crash never leaves a half-written file under this name
    doc = {
        "format_version": STATE_VERSION,
        "weights": weights,
        "progress": progress,
        "param_groups": opt["param_groups"],
        "optim_scalars": scalars,
        "config": config,
        "draft_config": draft.cfg.to_json_dict(),
    }
    fd, tmp = tempfile.mkstemp(prefix=".train_state.", dir=path)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
    os.replace(tmp, path / STATE_JSON)
    for old in path.glob("train_state-*.safetensors"):
        if old.name != weights:
            old.unlink(missing_ok=True)


def load_state(path) -> dict | None:
    """The committed state of `path` ({"doc": json, "tensors": ...}) or None when there is none."""
    file = Path(path) / STATE_JSON
    if not file.exists():
        return None
    doc = json.loads(file.read_text())
    if doc.get("format_version") != STATE_VERSION:
        raise ValueError(f"{file}: training state version {doc.get('format_version')}, expected {STATE_VERSION}")
    return {"doc": doc, "tensors": load_file(str(Path(path) / doc["weights"]))}


def restore(state: dict, draft: Eagle3Draft, optimizer: torch.optim.Optimizer) -> dict:
    """Load draft tensors and optimizer state in place; return the saved progress."""
    doc, tensors = state["doc"], state["tensors"]
    saved_cfg = Eagle3Config.from_json_dict(doc["draft_config"])
    if saved_cfg != draft.cfg:
        raise ValueError(f"training state is for draft {saved_cfg}, not {draft.cfg}")
    device = next(draft.parameters()).device
    draft.load_state_dict({k[len("draft."):]: v.to(device) for k, v in tensors.items() if k.startswith("draft.")})
    per_param: dict[int, dict] = {}
    for name, val in tensors.items():
        if name.startswith("optim."):
            _, idx, key = name.split(".", 2)
            per_param.setdefault(int(idx), {})[key] = val.to(device) if key != "step" else val
    for idx, scalars in doc["optim_scalars"].items():
        per_param.setdefault(int(idx), {}).update(scalars)
    optimizer.load_state_dict({"state": per_param, "param_groups": doc["param_groups"]})
    return doc["progress"]

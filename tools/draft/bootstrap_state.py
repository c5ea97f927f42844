"""The bookkeeping of a bootstrap's output directory: its manifest (`BootstrapManifest`,
`DIR/bootstrap.json`, written atomically), the budget clock that charges wall time to the phases
(`BudgetClock`), and the removal of chunk files no manifest names.

The manifest records the settings a resumed run must share (`bootstrap_config.FIXED`), the prompts
already generated (their chunks are written before the manifest names them), the chunk files of
each split, the seconds spent per phase, the runs, and the training's schedule, curve and history."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from tools.draft.bootstrap_config import BEFORE_SETTING, FIXED, BootstrapConfig

MANIFEST = "bootstrap.json"
MANIFEST_VERSION = 1


class BootstrapManifest:
    """`DIR/bootstrap.json`: `doc` is the JSON document, `save()` writes it atomically."""

    def __init__(self, path: Path, doc: dict) -> None:
        self.path, self.doc = path, doc

    @classmethod
    def open(cls, out: Path, cfg: BootstrapConfig) -> BootstrapManifest:
        """The manifest of `out` (a new one where there is none); ValueError where `out` was started
        with other FIXED settings or by another manifest version."""
        path = out / MANIFEST
        fixed = {k: getattr(cfg, k) for k in FIXED}
        if path.exists():
            doc = json.loads(path.read_text())
            if doc.get("version") != MANIFEST_VERSION:
                raise ValueError(f"{path}: manifest version {doc.get('version')}, expected {MANIFEST_VERSION}")
            # a setting newer than the manifest counts as what the code did before it existed
            was = {k: doc["fixed"].get(k, BEFORE_SETTING.get(k, getattr(BootstrapConfig, k))) for k in fixed}
            changed = {k: (was[k], v) for k, v in fixed.items() if was[k] != v}
            if changed:
                raise ValueError(f"{out} was bootstrapped with other settings {changed}; use another --out")
            return cls(path, doc)
        doc = {"version": MANIFEST_VERSION, "fixed": fixed, "prompts": {}, "chunks": {"train": [], "eval": []},
               "spent_s": {"generate": 0.0, "train": 0.0, "eval": 0.0, "other": 0.0},
               "runs": 0, "train": {"schedule_steps": None, "curve": [], "history": []}, "done": False}
        return cls(path, doc)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".bootstrap.", dir=self.path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(self.doc, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)

    def tokens(self, split: str) -> int:
        """Output tokens generated for the prompts of `split` ("train" or "eval")."""
        return sum(v["tokens"] for v in self.doc["prompts"].values() if v["split"] == split)


class BudgetClock:
    """Budget bookkeeping: seconds spent in earlier runs (from the manifest) + this run's, counted
    from `started` (time.monotonic(); the command line passes its process's start, so that the budget
    is the command's wall time; what precedes the clock is charged to the phase of the first charge)."""

    def __init__(self, manifest: BootstrapManifest, budget_s: float, started: float | None = None) -> None:
        self.m, self.budget_s = manifest, budget_s
        self.start = time.monotonic() if started is None else started
        self.before = sum(manifest.doc["spent_s"].values())
        self._mark = self.start

    def elapsed(self) -> float:
        return self.before + time.monotonic() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def charge(self, phase: str) -> float:
        """Add the time since the last charge to `phase`; returns it."""
        now = time.monotonic()
        dt = now - self._mark
        self.m.doc["spent_s"][phase] += dt
        self._mark = now
        return dt


def remove_unlisted_chunks(out: Path, manifest: BootstrapManifest) -> None:
    """Chunks written by a run that stopped before its manifest named them would be duplicates."""
    for split in ("train", "eval"):
        listed = set(manifest.doc["chunks"][split])
        d = out / "chunks" / split
        if d.exists():
            for f in d.iterdir():
                if f.name not in listed:
                    f.unlink()

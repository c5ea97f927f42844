"""SGLang's adaptive ``speculative_num_steps``: an EMA of accept length over step tiers per batch bucket.

Re-implemented from SGLang's public design (docs "Adaptive Speculative Decoding" and
``python/sglang/srt/speculative/adaptive_spec_params.py``; no code copied). With EAGLE top-k = 1
``num_steps`` is our γ. Behaviour:

* Batch sizes route to the slot with the largest configured key ≤ b (keys "1", "8", "32", "64"
  by default), each slot holding its own sorted ``candidate_steps`` (the tiers).
* After each verify, while the slot's current tier is > 0, ``ema ← (1 − a)·ema + a·mean(V)``
  with a = ``ema_alpha`` = 0.2 and V the accepted draft tokens per request.
* Decisions are made after ``warmup_batches`` = 10 batches, then every ``update_interval`` = 5.
  From tier 0 the slot always probes the next tier up (EMA re-seeded at tier − 1 if it has never
  been positive). Otherwise it steps *down* past each lower tier p while
  ``ema ≤ (p − 0.5, or 0.5 when p = 0) + down_hysteresis``; if it did not move down it steps *up*
  while ``ema > current − 0.5 + up_hysteresis``. I.e. target ≈ round(ema) + 1, the
  "probe one step beyond observed acceptance" rule. ``ceiling_coeff`` > 0 additionally caps a
  non-increasing target at ⌈ema·coeff⌉.
* The EMA starts at (initial tier − 1), initial tier = ``initial_steps`` if it is a candidate,
  else the middle candidate.

Defaults per bucket are SGLang's shipped ones: 1 → [1, 3, 5, 7] (down_hysteresis −0.25),
8 → [0, 1, 3], 32 → [0, 1], 64 → [0]. The policy never looks at latency.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from typing import Any

from tide.policies.base import StepContext, StepFeedback

DEFAULT_CONFIG: dict[str, dict[str, Any]] = {
    "1": {"candidate_steps": [1, 3, 5, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25},
    "8": {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0},
    "32": {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0},
    "64": {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0},
}


class _Slot:
    def __init__(self, initial_steps: int, cfg: Mapping[str, Any]) -> None:
        self.tiers = sorted(set(int(s) for s in cfg["candidate_steps"]))
        if not self.tiers or self.tiers[0] < 0:
            raise ValueError(f"bad candidate_steps {cfg['candidate_steps']!r}")
        self.ema_alpha = float(cfg.get("ema_alpha", 0.2))
        self.update_interval = int(cfg.get("update_interval", 5))
        self.warmup = int(cfg.get("warmup_batches", 10))
        self.down_h = float(cfg.get("down_hysteresis", -0.25))
        self.up_h = float(cfg.get("up_hysteresis", 0.0))
        self.ceiling_coeff = float(cfg.get("ceiling_coeff", 0.0))
        self.steps = initial_steps if initial_steps in self.tiers else self.tiers[len(self.tiers) // 2]
        self.ema = float(self.steps - 1)
        self.batches = 0

    def update(self, accepted: list[int]) -> None:
        if not accepted:
            return
        if self.steps > 0:
            self.ema = (1 - self.ema_alpha) * self.ema + self.ema_alpha * (sum(accepted) / len(accepted))
        self.batches += 1
        if self.batches > self.warmup and (self.batches - self.warmup) % self.update_interval == 0:
            self.steps = self._target()

    def _target(self) -> int:
        idx = self.tiers.index(self.steps)
        if self.steps == 0:  # from "off", always try the next tier up
            idx = min(idx + 1, len(self.tiers) - 1)
            if self.tiers[idx] > 0 and self.ema < 0:
                self.ema = float(self.tiers[idx] - 1)
            return self.tiers[idx]
        start = idx
        while idx > 0:
            lower = self.tiers[idx - 1]
            drop_at = (0.5 if lower == 0 else lower - 0.5) + self.down_h
            if self.ema > drop_at:
                break
            idx -= 1
        if idx == start:
            while idx < len(self.tiers) - 1 and self.ema > self.tiers[idx] - 0.5 + self.up_h:
                idx += 1
        target = self.tiers[idx]
        if self.ceiling_coeff > 0 and target <= self.steps:
            ceiling = max(1, math.ceil(self.ema * self.ceiling_coeff))
            while idx > 0 and self.tiers[idx] > ceiling:
                idx -= 1
            target = self.tiers[idx]
        return target


class SGLangEMAPolicy:
    """Per-bucket EMA-of-accept-length tier switching, one γ for the whole batch."""

    def __init__(self, config: Mapping[str, Mapping[str, Any]] | None = None, initial_steps: int = 3) -> None:
        cfg = dict(DEFAULT_CONFIG if config is None else config)
        shared = {k: v for k, v in cfg.items() if not str(k).isdigit()}
        entries = {int(k): {**shared, **v} for k, v in cfg.items() if str(k).isdigit()}
        if not entries:
            raise ValueError("sglang config needs at least one batch-size key, e.g. {'1': {...}}")
        self.name = "sglang"
        self.keys = sorted(entries)
        self.slots = {k: _Slot(initial_steps, entries[k]) for k in self.keys}
        self._pending: int | None = None

    def slot_key(self, b: int) -> int:
        return self.keys[max(bisect.bisect_right(self.keys, b) - 1, 0)]

    def decide(self, ctx: StepContext) -> list[int]:
        key = self.slot_key(ctx.batch_size)
        self._pending = key
        return [min(self.slots[key].steps, ctx.max_gamma)] * len(ctx.requests)

    def observe(self, feedback: StepFeedback) -> None:
        if self._pending is not None:
            self.slots[self._pending].update(list(feedback.accepted))
            self._pending = None

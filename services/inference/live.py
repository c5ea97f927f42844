"""What the engine did lately, for status pages: a step listener that keeps running totals.

`LiveStats.observe` is an engine step listener (loop thread, O(batch) per step, no I/O). It keeps
- the generated tokens of the last `window_s` seconds (one entry per step), for tokens/s;
- per draft version: the (request, step) rows that speculated, draft tokens checked, accepted;
- per running-batch bucket (the γ policies' buckets: 1, 2-3, 4-7, 8-15, ...): steps, speculative steps, the γ chosen.
`snapshot()` (any thread) copies them under a lock; GetStatus sends them as WorkerStatus.live.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from tide.policies.estimators import batch_bucket as policy_bucket
from tide.telemetry import StepRecord

MAX_VERSIONS = 16  # draft versions kept (the least recently served is dropped first)


def batch_bucket(batch: int) -> tuple[int, int]:
    """The (smallest, largest) running-batch size of `batch`'s bucket: the γ policies' own buckets
    (tide.policies.estimators.batch_bucket: 1, 2, 4-7, 8-15, 16-31, ...), so the page shows γ per
    the bucket the policy decided it for."""
    lo = policy_bucket(batch)
    return lo, 2 * lo - 1


@dataclass
class VersionTotals:
    drafter: str = ""
    verify_rows: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    last_unix_s: float = 0.0


@dataclass
class BucketTotals:
    steps: int = 0
    speculative_steps: int = 0
    gamma_sum: int = 0
    speculative_rows: int = 0
    last_gamma: int = 0


@dataclass(frozen=True)
class LiveSnapshot:
    tokens_per_s: float
    window_s: float
    tokens_total: int
    steps_total: int
    drafts: dict[str, VersionTotals] = field(default_factory=dict)  # most recently served first
    gamma: dict[tuple[int, int], BucketTotals] = field(default_factory=dict)  # smallest batch first


class LiveStats:
    def __init__(self, window_s: float = 10.0, clock=time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) per step, oldest first
        self._tokens = self._steps = 0
        self._versions: dict[str, VersionTotals] = {}
        self._buckets: dict[tuple[int, int], BucketTotals] = {}
        self._started = clock()

    def observe(self, record: StepRecord) -> None:
        emitted = record.emitted_tokens
        if not record.request_ids:
            return
        now = self.clock()
        with self._lock:
            if emitted:
                self._tokens += emitted
                self._steps += 1
                self._recent.append((now, emitted))
                self._trim(now)
            rows = [(g, a) for g, a in zip(record.gammas, record.accepted, strict=False) if g > 0]
            bucket = self._buckets.setdefault(batch_bucket(record.batch_size or len(record.request_ids)),
                                              BucketTotals())
            bucket.steps += 1
            bucket.last_gamma = max((g for g, _ in rows), default=0)
            if rows:
                bucket.speculative_steps += 1
                bucket.gamma_sum += sum(g for g, _ in rows)
                bucket.speculative_rows += len(rows)
                v = self._versions.pop(record.draft_version, None) or VersionTotals()
                self._versions[record.draft_version] = v  # re-inserted: the dict's last is the latest served
                v.drafter, v.last_unix_s = record.drafter, record.time_unix_s
                v.verify_rows += len(rows)
                v.draft_tokens += sum(g for g, _ in rows)
                v.accepted_tokens += sum(min(a, g) for g, a in rows)
                while len(self._versions) > MAX_VERSIONS:
                    del self._versions[next(iter(self._versions))]

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] <= now - self.window_s:
            self._recent.popleft()

    def snapshot(self) -> LiveSnapshot:
        now = self.clock()
        with self._lock:
            self._trim(now)
            window = min(self.window_s, max(now - self._started, 1e-3))  # a young worker: since it started
            recent = sum(n for _, n in self._recent)
            drafts = {k: VersionTotals(**vars(v)) for k, v in reversed(self._versions.items())}
            gamma = {k: BucketTotals(**vars(b)) for k, b in sorted(self._buckets.items())}
            return LiveSnapshot(recent / window, self.window_s, self._tokens, self._steps, drafts, gamma)

"""Fleet statistics from the telemetry stream: acceptance EMAs per (target, draft version) and
recent load per worker. Pure domain code (no Redis, no gRPC); `telemetry.py` feeds it.

Acceptance: every request that was verified in a step (γ > 0) contributes one observation. Two
statistics follow it, each as a short-horizon (the current traffic) and a long-horizon (the
baseline) exponential moving average:

- the accept length `accepted + 1` (bonus token included, as DraftStats in controller.proto
  defines it): tokens per verification, what speculation buys; it grows with γ;
- the acceptance rate per checked draft token, accepted / checked. A verification of γ draft
  tokens checks them in order up to the first rejection: it accepts a and checks a + 1 (a < γ) or
  γ (a = γ). Under a constant per-token acceptance probability p, accepted / checked estimates p
  whatever γ each step used (the maximum-likelihood estimate), where the accept length at γ = 1
  is 1 + p and at γ = 3 is 1 + p + p² + p³. So the rate, not the accept length, tells a shift
  of the traffic from a change of γ (the adaptive policy moves γ all the time): short < long - ε
  on the rate signals a shift (TIDE Algorithm 1, whose α is this rate; collection.py acts on it).
  Its EMA is the ratio of the EMAs of accepted and of checked tokens.

A horizon of N observations means the EMA weight 2 / (N + 1). The first observation seeds an
accept-length EMA; the rate's two EMAs start at 0 (see RateEma).

Load: per worker, the steps of the last `window_s` seconds (by their record time): mean running
batch size, steps/s and emitted tokens/s.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from tide.telemetry import StepRecord


@dataclass
class Ema:
    horizon: float
    value: float = 0.0
    count: int = 0

    @property
    def alpha(self) -> float:
        return 2.0 / (self.horizon + 1.0)

    def update(self, x: float) -> None:
        self.value = x if self.count == 0 else self.value + self.alpha * (x - self.value)
        self.count += 1


@dataclass
class RateEma:
    """EMA of a rate: EMA(numerator) / EMA(denominator), so each observation weighs by its
    denominator. Both start at 0 unseeded; their common start-up bias cancels in the ratio, which
    is therefore the exactly weighted mean from the first observation on (no seed to outlive)."""

    horizon: float
    num: float = 0.0
    den: float = 0.0
    count: int = 0

    @property
    def value(self) -> float:
        return self.num / self.den if self.den > 0 else 0.0

    def update(self, num: float, den: float) -> None:
        alpha = 2.0 / (self.horizon + 1.0)
        self.num += alpha * (num - self.num)
        self.den += alpha * (den - self.den)
        self.count += 1


@dataclass
class DraftStats:
    """Acceptance of one draft version on one target (see the module docstring)."""

    draft_version: str
    short: Ema  # accept length (bonus included)
    long: Ema
    verify_steps: int = 0  # request-verifications observed (one per request per speculative step)
    tokens: int = 0  # tokens emitted by those verifications (bonus included)
    checked: int = 0  # draft tokens those verifications checked (accepted / checked = the rate)
    last_update_unix_s: float = 0.0
    # acceptance rate per checked draft token, over the horizons of `short` / `long`
    rate_short: RateEma = field(init=False)
    rate_long: RateEma = field(init=False)

    def __post_init__(self) -> None:
        self.rate_short, self.rate_long = RateEma(self.short.horizon), RateEma(self.long.horizon)

    def observe(self, gamma: int, accepted: int) -> None:
        """One request's verification of `gamma` draft tokens, `accepted` of them accepted."""
        checked = min(accepted + 1, gamma)
        for ema in (self.short, self.long):
            ema.update(accepted + 1.0)
        for rate in (self.rate_short, self.rate_long):
            rate.update(accepted, checked)
        self.verify_steps += 1
        self.tokens += accepted + 1
        self.checked += checked


@dataclass(frozen=True)
class LoadStats:
    worker_id: str
    target_model: str
    mean_batch: float
    steps_per_s: float
    tokens_per_s: float
    last_step_unix_s: float


@dataclass
class _WorkerWindow:
    target_model: str = ""
    steps: deque = field(default_factory=deque)  # (time_unix_s, batch_size, emitted tokens)


class FleetStats:
    """Thread-safe: the telemetry thread calls `observe`, RPC threads read snapshots."""

    def __init__(self, short_horizon: float = 50, long_horizon: float = 1000, window_s: float = 30.0) -> None:
        if not 0 < short_horizon < long_horizon:
            raise ValueError("need 0 < short horizon < long horizon")
        self.short_horizon, self.long_horizon, self.window_s = short_horizon, long_horizon, window_s
        self._lock = threading.Lock()
        self._drafts: dict[tuple[str, str], DraftStats] = {}
        self._workers: dict[str, _WorkerWindow] = {}
        self._latest_version: dict[str, tuple[float, str]] = {}  # target -> (time, draft version serving)
        self._emitted: dict[str, int] = {}  # target -> tokens emitted by every step seen (speculative or not)
        self.records = 0

    def observe(self, rec: StepRecord) -> None:
        with self._lock:
            self.records += 1
            window = self._workers.setdefault(rec.worker_id, _WorkerWindow())
            window.target_model = rec.target_model
            window.steps.append((rec.time_unix_s, rec.batch_size, rec.emitted_tokens))
            self._trim(window, rec.time_unix_s)
            self._emitted[rec.target_model] = self._emitted.get(rec.target_model, 0) + rec.emitted_tokens
            verified = rec.drafted_by_draft()  # the draft's own tokens: copies beside it are not its acceptance
            if not verified:
                return
            key = (rec.target_model, rec.draft_version)
            stats = self._drafts.get(key)
            if stats is None:
                stats = self._drafts[key] = DraftStats(rec.draft_version, Ema(self.short_horizon),
                                                       Ema(self.long_horizon))
            for g, a in verified:
                stats.observe(g, a)
            stats.last_update_unix_s = max(stats.last_update_unix_s, rec.time_unix_s)
            if rec.time_unix_s >= self._latest_version.get(rec.target_model, (float("-inf"), ""))[0]:
                self._latest_version[rec.target_model] = (rec.time_unix_s, rec.draft_version)

    def _trim(self, window: _WorkerWindow, now: float) -> None:
        while window.steps and window.steps[0][0] < now - self.window_s:
            window.steps.popleft()

    def targets(self) -> list[str]:
        with self._lock:
            return sorted({t for t, _ in self._drafts} | {w.target_model for w in self._workers.values()} - {""})

    def drafts(self, target_model: str) -> list[DraftStats]:
        """Copies of the per-version stats of a target, most recently updated first."""
        with self._lock:
            out = [copy.deepcopy(s) for (t, _), s in self._drafts.items() if t == target_model]
        return sorted(out, key=lambda s: -s.last_update_unix_s)

    def serving_version(self, target_model: str) -> str:
        """The draft version the latest speculative step of this target ran with."""
        with self._lock:
            return self._latest_version.get(target_model, (0.0, ""))[1]

    def emitted(self, target_model: str) -> int:
        """Tokens the target's workers emitted in every step seen so far (collection progress)."""
        with self._lock:
            return self._emitted.get(target_model, 0)

    def load(self, now: float | None = None) -> list[LoadStats]:
        """Recent load of every worker seen in the last window (relative to `now`, default: wall time)."""
        now = time.time() if now is None else now
        out = []
        with self._lock:  # a read: windows are trimmed as steps arrive (observe), by their record times
            for worker_id, w in sorted(self._workers.items()):
                steps = [s for s in w.steps if s[0] >= now - self.window_s]
                if not steps:
                    continue
                n = len(steps)
                span = max(now - steps[0][0], 1e-3)
                out.append(LoadStats(worker_id, w.target_model, sum(s[1] for s in steps) / n, n / span,
                                     sum(s[2] for s in steps) / span, steps[-1][0]))
        return out

    def mean_batch(self, target_model: str, now: float | None = None) -> float | None:
        """The running batch of `target_model`'s workers in the last window, averaged over the workers
        that stepped in it (the load rule's input, collection.py); None when none did."""
        batches = [w.mean_batch for w in self.load(now) if w.target_model == target_model]
        return sum(batches) / len(batches) if batches else None

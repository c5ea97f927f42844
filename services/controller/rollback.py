"""Automatic rollback of a promoted draft that accepts worse live than the one it replaced. Pure
domain code: the registry is reached through `RegistryPort` (registry.py implements it over gRPC).

A *watch* starts when a draft version takes over a target: a training outcome reports a promotion
(candidate replaces base), or the telemetry's serving version changes to a version with fewer
observations than the one before (a manual promote). Once the new version has `window`
verifications since then, its live acceptance rate per checked draft token (accepted / checked
over those observations) is compared with the previous version's rate over *its* last `window`
verifications before the takeover: lower by more than `margin`, and by more than `z` standard errors
of the difference (two-proportion test on the checked tokens) → the registry is asked to roll back
to the previous version (which workers follow through WatchTarget). Not worse → the watch ends, the
version stays.

Why the test as well as the margin: two windows of 200 verifications at 2 clients are ≈ 8 s of
traffic each, a handful of requests. In `bench adapt` (docs/results/adapt, run b2)
a draft that evaluated better (1.550 vs 1.518 on held-out chunks) was rolled back at 0.322 vs 0.372
on ≈ 210 checked tokens each: 0.05 is 1.1 standard errors there. A draft that is really worse, like the
deliberately bad one of the tests (0 vs 0.67), is many standard errors below at once.

The previous version's recent rate, not its long EMA: traffic shifts between domains, and the long
EMA (1000 observations) remembers the domain before the shift. In `bench adapt` a draft promoted
40 s into the HumanEval phase was rolled back against its predecessor's GSM8K rate (0.216 vs 0.352;
docs/results/adapt, run f1), and run q2's two rollbacks came the same
way. Adjacent windows of equal size compare the two versions on the same traffic. (The previous
version has served fewer than `window` verifications since the controller started: all of them.)

The rate, not the accept length: the accept length grows with γ, which the adaptive policy moves
all the time (stats.py), so a version that served at a larger γ would set a bar that its successor
misses at a smaller one (docs/results/adapt, "The first full run on Zen 4": in
`bench adapt` a draft that evaluated +0.125 better was rolled back that way, against its
predecessor's 2.644 tokens/step over one minute).

The rollback is skipped when the registry's pointer is pinned or no longer on the watched version
(someone acted meanwhile); a registry that does not answer is retried on the next evaluation.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from services.controller.stats import DraftStats

log = logging.getLogger(__name__)


class RegistryUnavailable(Exception):
    """The registry did not answer (retry later)."""


class RollbackRefused(Exception):
    """The registry refused the rollback (it will not work by retrying)."""


class RegistryPort(Protocol):
    def pointer(self, target_model: str) -> tuple[str, str]:
        """(current, pinned) versions of the target."""
        ...

    def rollback(self, target_model: str, to_version: str, reason: str, expected_current: str) -> str:
        """Make `to_version` current again if `expected_current` still is (RollbackRefused
        otherwise); returns the new current version."""
        ...


@dataclass(frozen=True)
class RollbackRecord:
    target_model: str
    from_version: str
    to_version: str
    reason: str
    live_accept_length: float  # tokens per verification (informative: it moves with γ)
    # of the previous version over its last `window` verifications before the takeover
    previous_accept_length: float
    verify_steps: int
    time_unix_s: float
    live_acceptance_rate: float = 0.0  # accepted / checked draft tokens: what the verdict compares
    previous_acceptance_rate: float = 0.0


@dataclass(frozen=True)
class Watch:
    version: str
    previous: str
    base: tuple[int, int, int]  # the version's (verifications, tokens, checked) when the watch started
    since_unix_s: float
    trigger: str
    verify_steps: int = 0  # observed since the watch started (updated on evaluation)


def standard_error(rate: float, checked: int, ref: float, ref_checked: int) -> float:
    """Standard error of `ref - rate` for acceptance rates over `checked` and `ref_checked` draft
    tokens, under the pooled rate (two-proportion test). Tokens of one verification or request are
    not independent, so the real error is larger: hence a z of 3 by default."""
    if checked <= 0 or ref_checked <= 0:
        return 0.0
    pooled = (rate * checked + ref * ref_checked) / (checked + ref_checked)
    return math.sqrt(max(pooled * (1 - pooled), 0.0) * (1 / checked + 1 / ref_checked))


class RollbackGuard:
    """Thread-safe. `port` None = disabled (nothing is watched)."""

    def __init__(self, port: RegistryPort | None, window: int = 200, margin: float = 0.05, z: float = 3.0) -> None:
        self.port, self.window, self.margin, self.z = port, window, margin, z
        self.rollbacks: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self._watch: dict[str, Watch] = {}
        self._last: dict[str, RollbackRecord] = {}
        self._serving: dict[str, str] = {}
        # per target and version, (verifications, tokens, checked) snapshots up to the last evaluation,
        # reaching back `window` verifications (_recent)
        self._history: dict[str, dict[str, deque[tuple[int, int, int]]]] = {}
        self._rolled_back: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.port is not None

    def watching(self, target: str) -> Watch | None:
        with self._lock:
            return self._watch.get(target)

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(rollbacks, failures) per target."""
        with self._lock:
            return dict(self.rollbacks), dict(self.failures)

    def last(self, target: str) -> RollbackRecord | None:
        with self._lock:
            return self._last.get(target)

    def promoted(self, target: str, version: str, previous: str, now: float, trigger: str) -> None:
        """A promotion was reported: watch `version` against `previous` (observations seen so far of
        `version` count as before the promotion)."""
        if not self.enabled or not version or not previous or version == previous:
            return
        with self._lock:
            w = self._watch.get(target)
            if w is not None and w.version == version:  # already watched (seen serving first)
                self._watch[target] = Watch(version, previous, w.base, w.since_unix_s, trigger, w.verify_steps)
                return
            self._start(target, Watch(version, previous, self._latest(target, version), now, trigger))

    def refused(self, target: str, version: str, why: str) -> None:
        """The registry's pointer left `version` because workers refused it (refusals.py): a watch of it
        ends (it would wait for observations that never come), and it is not watched again."""
        with self._lock:
            self._rolled_back.setdefault(target, set()).add(version)
            w = self._watch.get(target)
            if w is not None and w.version == version:
                self._end(target, why)

    def evaluate(self, target: str, serving: str, drafts: Mapping[str, DraftStats],
                 now: float) -> RollbackRecord | None:
        """Follow the target's statistics; returns the rollback made now, if any."""
        if not self.enabled:
            return None
        counts = {v: (d.verify_steps, d.tokens, d.checked) for v, d in drafts.items()}
        with self._lock:
            self._detect_takeover(target, serving, counts, now)
            self._remember(target, counts)
            w = self._watch.get(target)
            if w is None:
                return None
            steps, tokens, checked = (cur - base for cur, base in zip(counts.get(w.version, w.base), w.base,
                                                                         strict=True))
            w = self._watch[target] = Watch(w.version, w.previous, w.base, w.since_unix_s, w.trigger, steps)
            if steps < self.window:
                return None
            recent = self._recent(target, w.previous)
            if recent is None:
                return self._end(target, f"no statistics of the previous version {w.previous} to compare with")
            ref, ref_length, ref_steps, ref_checked = recent
            rate = (tokens - steps) / checked if checked else 0.0  # tokens count one bonus per verification
            drop, se = ref - rate, standard_error(rate, checked, ref, ref_checked)
            if drop <= self.margin or drop <= self.z * se:
                return self._end(target, f"kept: acceptance rate {rate:.3f} over {steps} verifications vs {ref:.3f} "
                                         f"for {w.previous} over its last {ref_steps} (standard error {se:.3f})")
        reason = (f"auto-rollback: {w.version} accepted {rate:.3f} of its checked draft tokens over {steps} "
                  f"verifications since {w.trigger}, below {w.previous}'s {ref:.3f} over its last {ref_steps} "
                  f"by more than {self.margin} and {drop / se if se else float('inf'):.1f} standard errors "
                  f"({tokens / steps:.3f} vs {ref_length:.3f} tokens/step)")
        return self._roll_back(target, w, RollbackRecord(target, w.version, w.previous, reason, tokens / steps,
                                                         ref_length, steps, now, rate, ref))

    # ---- internals (the caller holds the lock, except for _roll_back)

    def _remember(self, target: str, counts: dict[str, tuple[int, int, int]]) -> None:
        """Append each version's new counts; drop snapshots older than the one `window` verifications back."""
        hist = self._history.setdefault(target, {})
        for version, c in counts.items():
            h = hist.setdefault(version, deque())
            if h and h[-1] == c:
                continue
            h.append(c)
            while len(h) > 1 and h[1][0] <= c[0] - self.window:
                h.popleft()

    def _latest(self, target: str, version: str) -> tuple[int, int, int]:
        """`version`'s counts at the last evaluation (zeros: not observed yet)."""
        h = self._history.get(target, {}).get(version)
        return h[-1] if h else (0, 0, 0)

    def _recent(self, target: str, version: str) -> tuple[float, float, int, int] | None:
        """(acceptance rate, accept length, verifications, checked tokens) of `version` over its last
        ≈ `window` verifications (all of them where it has fewer since this controller started); None: none."""
        h = self._history.get(target, {}).get(version)
        if not h or h[-1][0] == 0:
            return None
        last = h[-1]
        first = h[0] if h[0][0] <= last[0] - self.window else (0, 0, 0)
        steps, tokens, checked = (a - b for a, b in zip(last, first, strict=True))
        if steps <= 0 or checked <= 0:
            return None
        return (tokens - steps) / checked, tokens / steps, steps, checked

    def _detect_takeover(self, target: str, serving: str, counts: dict[str, tuple[int, int, int]],
                         now: float) -> None:
        before = self._serving.get(target, "")
        if serving:
            self._serving[target] = serving
        if not serving or not before or serving == before or serving in self._rolled_back.get(target, ()):
            return
        w = self._watch.get(target)
        if w is not None and w.version == serving:
            return
        if counts.get(serving, (0, 0, 0))[0] >= counts.get(before, (0, 0, 0))[0]:
            return  # e.g. back to an established version, or workers on both during a rollout
        self._start(target, Watch(serving, before, self._latest(target, serving), now,
                                  f"the serving version changed from {before}"))

    def _start(self, target: str, w: Watch) -> None:
        self._watch[target] = w
        log.info("watching draft %s of %s against %s for %d verifications (%s)", w.version, target, w.previous,
                 self.window, w.trigger, extra={"target_model": target, "draft_version": w.version})

    def _end(self, target: str, why: str) -> None:
        w = self._watch.pop(target)
        log.info("watch of draft %s of %s ended: %s", w.version, target, why,
                 extra={"target_model": target, "draft_version": w.version})

    def _roll_back(self, target: str, w: Watch, record: RollbackRecord) -> RollbackRecord | None:
        try:
            current, pinned = self.port.pointer(target)
            if pinned or current != w.version:
                with self._lock:
                    self._end(target, f"would roll back, but the registry points elsewhere now (current "
                                      f"{current or '-'}, pinned {pinned or '-'}): {record.reason}")
                return None
            # expected_current: a promotion between the check above and this call wins, atomically
            self.port.rollback(target, w.previous, record.reason, expected_current=w.version)
        except RegistryUnavailable as e:
            with self._lock:
                self.failures[target] += 1
            log.warning("rollback of %s to %s failed (%s); retrying", target, w.previous, e)
            return None
        except RollbackRefused as e:
            with self._lock:
                self.failures[target] += 1
                self._end(target, f"the registry refused the rollback: {e}")
            log.error("registry refused the rollback of %s to %s: %s", target, w.previous, e)
            return None
        with self._lock:
            self._watch.pop(target, None)
            self._last[target] = record
            self.rollbacks[target] += 1
            self._rolled_back.setdefault(target, set()).add(w.version)
        log.warning("rolled back %s from %s to %s: %s", target, w.version, w.previous, record.reason,
                    extra={"target_model": target, "from_version": w.version, "to_version": w.previous})
        return record

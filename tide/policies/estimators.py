"""Small shared pieces: the acceptance model, online α estimators, batch buckets, request state.

Acceptance model (seed 000 Eq. 2, seed 004 Eq. 1 and App. B.1): each drafted token is accepted
with probability α, independently, until the first rejection; a step that drafts γ tokens then
emits E[ℓ] = (1 − α^{γ+1}) / (1 − α) tokens on average (accepted drafts + the bonus token).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from tide.policies.base import StepContext

# Seed 004 §4.1: cap α̂ at Acc_max = 0.98 so a run of full acceptances cannot push the estimate
# to 1 (an infinitely optimistic γ) or divide by zero in E[ℓ].
ALPHA_CAP = 0.98

S = TypeVar("S")


def expected_accept_len(alpha: float, gamma: float) -> float:
    """E[ℓ] in tokens per step for per-token acceptance α and γ drafted tokens (bonus included)."""
    if gamma <= 0:
        return 1.0
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def mle_alpha(
    gammas: Iterable[int], accepted: Iterable[int], cap: float = ALPHA_CAP, default: float | None = None
) -> float | None:
    """Seed 004 Eq. 2: α̂ = ΣV / (ΣV + Σ 1(V < γ)) over speculation steps (γ > 0 only).

    V is the accepted draft count of a step; a step with V < γ ended in one rejection. Returns
    `default` when no speculation step is in the window; the result is capped at `cap`.
    """
    succ = fail = 0
    for g, v in zip(gammas, accepted, strict=False):
        if g <= 0:
            continue
        succ += v
        fail += 1 if v < g else 0
    if succ + fail == 0:
        return default
    return min(succ / (succ + fail), cap)


class AcceptanceEMA:
    """α̂ as a ratio of exponentially decayed success / failure counts (Eq. 2 with forgetting).

    Each update (one step's speculating requests) first multiplies the counts by `decay`, so
    the estimate covers roughly the last 1 / (1 − decay) speculation steps. Steps with γ = 0
    carry no information and leave it untouched. `prior` (α, weight) seeds the counts.
    """

    def __init__(self, decay: float = 0.9, prior: tuple[float, float] = (0.5, 1.0), cap: float = ALPHA_CAP):
        if not 0.0 < decay < 1.0:
            raise ValueError("decay must be in (0, 1)")
        self.decay = decay
        self.cap = cap
        self.succ = prior[0] * prior[1]
        self.fail = (1.0 - prior[0]) * prior[1]
        self.updates = 0

    def update(self, gammas: Sequence[int], accepted: Sequence[int]) -> None:
        s = f = 0
        for g, v in zip(gammas, accepted, strict=False):
            if g > 0:
                s += v
                f += 1 if v < g else 0
        if s + f == 0:
            return
        self.succ = self.decay * self.succ + s
        self.fail = self.decay * self.fail + f
        self.updates += 1

    @property
    def value(self) -> float:
        total = self.succ + self.fail
        return min(self.succ / total, self.cap) if total > 0 else 0.0


def batch_bucket(b: int) -> int:
    """Largest power of two ≤ b (1, 2, 4, 8, …): per-bucket statistics stay dense."""
    return 1 << (max(b, 1).bit_length() - 1)


class RequestStates(Generic[S]):
    """Per-request policy state keyed by request id, pruned to the running batch.

    `begin(ctx, factory)` is called from `decide`: it keeps the states of the requests in the
    batch (creating new ones), drops finished requests, and remembers the order so `observe`
    can zip `StepFeedback` fields back to requests with `take(n)`. `take` hands the order out
    once and only when its length matches the feedback's, so an `observe` without a matching
    `decide` (e.g. an engine step that decoded without asking the policy) updates nobody.
    """

    def __init__(self) -> None:
        self._states: dict[str, S] = {}
        self._order: list[str] = []

    def begin(self, ctx: StepContext, factory) -> list[S]:
        old = self._states
        self._states = {r.request_id: old[r.request_id] if r.request_id in old else factory(r) for r in ctx.requests}
        self._order = [r.request_id for r in ctx.requests]
        return [self._states[i] for i in self._order]

    def take(self, n: int) -> list[S]:
        order, self._order = self._order, []
        if len(order) != n:
            return []
        return [self._states[i] for i in order]

    def __len__(self) -> int:
        return len(self._states)


class History:
    """Last `h` (γ, accepted) pairs of one request; γ = 0 steps are skipped (no information)."""

    __slots__ = ("gammas", "accepted")

    def __init__(self, h: int) -> None:
        self.gammas: deque[int] = deque(maxlen=h)
        self.accepted: deque[int] = deque(maxlen=h)

    def add(self, gamma: int, accepted: int) -> None:
        if gamma > 0:
            self.gammas.append(gamma)
            self.accepted.append(accepted)

    def alpha(self, default: float | None = None) -> float | None:
        return mle_alpha(self.gammas, self.accepted, default=default)

    def counts(self) -> tuple[int, int]:
        """(successes, failures) in the Eq. 2 sense."""
        s = sum(self.accepted)
        f = sum(1 for g, v in zip(self.gammas, self.accepted, strict=True) if v < g)
        return s, f


class OffProbe:
    """Anti-deadlock probe: after `interval` consecutive steps with speculation off, probe once.

    Nightjar's "decision deadlock": a policy whose acceptance estimate only moves when it
    speculates can switch off and never learn that it should switch back on. A probe is one step
    at a small γ for a few requests; at interval 32 and γ = 1 it costs < 1 % of step time on the
    synthetic profile (T(b, 2)/T(b, 1) − 1 ≤ 20 %, paid once per 32 steps). interval ≤ 0 disables it.
    """

    def __init__(self, interval: int = 32) -> None:
        self.interval = interval
        self.off_steps = 0

    def due(self) -> bool:
        return self.interval > 0 and self.off_steps >= self.interval

    def record(self, gammas: Sequence[int]) -> None:
        self.off_steps = 0 if any(g > 0 for g in gammas) else self.off_steps + 1

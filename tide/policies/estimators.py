"""Small shared pieces: the acceptance model, online α estimators, batch buckets, request state.

Acceptance model (seed 000 Eq. 2, seed 004 Eq. 1 and App. B.1): each drafted token is accepted
with probability α, independently, until the first rejection; a step that drafts γ tokens then
emits E[ℓ] = (1 − α^{γ+1}) / (1 − α) tokens on average (accepted drafts + the bonus token).
"""

from __future__ import annotations

import math
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
    """α̂ = (S + w·α0) / (S + F + w) over exponentially decayed Eq.-2 counts S, F.

    S, F are the successes / failures (seed 004 Eq. 2 sense) of the request-steps that
    speculated; every `update` — one engine step, with or without speculation — first multiplies
    them by `decay`, so the estimate covers the last ≈ 1/(1 − decay) steps. Decaying on steps
    without data makes the estimate *age*: after a long off period S and F fade and α̂ returns to
    the prior α0 (weight w pseudo-observations, never decayed), so a few fresh observations (a
    probe) decide it instead of an arbitrarily old bad phase.
    """

    def __init__(self, decay: float = 0.9, prior: float = 0.5, prior_weight: float = 2.0, cap: float = ALPHA_CAP):
        if not 0.0 < decay < 1.0:
            raise ValueError("decay must be in (0, 1)")
        self.decay = decay
        self.prior = prior
        self.prior_weight = prior_weight
        self.cap = cap
        self.succ = self.fail = 0.0

    def update(self, gammas: Sequence[int], accepted: Sequence[int]) -> None:
        s = f = 0
        for g, v in zip(gammas, accepted, strict=False):
            if g > 0:
                s += v
                f += 1 if v < g else 0
        self.succ = self.decay * self.succ + s
        self.fail = self.decay * self.fail + f

    def reset(self) -> None:
        """Forget every observation: the estimate is the prior again."""
        self.succ = self.fail = 0.0

    @property
    def value(self) -> float:
        w = self.prior_weight
        total = self.succ + self.fail + w
        return min((self.succ + w * self.prior) / total, self.cap) if total > 0 else self.prior


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
    """Last `h` (γ, accepted) pairs of one request; γ = 0 steps are skipped (no information).

    Keeps the Eq. 2 success / failure sums of the window up to date on every add (O(1)).
    """

    __slots__ = ("gammas", "accepted", "succ", "fail")

    def __init__(self, h: int) -> None:
        self.gammas: deque[int] = deque(maxlen=h)
        self.accepted: deque[int] = deque(maxlen=h)
        self.succ = self.fail = 0

    def add(self, gamma: int, accepted: int) -> None:
        if gamma <= 0:
            return
        if len(self.gammas) == self.gammas.maxlen:
            old_g, old_v = self.gammas[0], self.accepted[0]
            self.succ -= old_v
            self.fail -= 1 if old_v < old_g else 0
        self.gammas.append(gamma)
        self.accepted.append(accepted)
        self.succ += accepted
        self.fail += 1 if accepted < gamma else 0

    def alpha(self, default: float | None = None, cap: float = ALPHA_CAP) -> float | None:
        total = self.succ + self.fail
        return default if total == 0 else min(self.succ / total, cap)

    def counts(self) -> tuple[int, int]:
        """(successes, failures) in the Eq. 2 sense."""
        return self.succ, self.fail


class OffProbe:
    """Anti-deadlock probe: after `interval` consecutive steps with speculation off, probe once.

    Nightjar's "decision deadlock": a policy whose acceptance estimate only moves when it
    speculates can switch off and never learn that it should switch back on. A probe is one step
    in which `max(requests, ⌈fraction·b⌉)` requests (rotating through the batch) draft γ = 1.
    Verification is priced per token, so the probe costs about fraction·(T(b, 2)/T(b, 1) − 1) of
    one step — on the synthetic profile ≤ 0.25 · 41 % ≈ 10 % of a step, once per 32 steps
    (< 0.4 % of throughput), while giving ⌈b/4⌉ fresh acceptance samples. interval ≤ 0 disables it.
    """

    def __init__(self, interval: int = 32, requests: int = 2, fraction: float = 0.25) -> None:
        self.interval = interval
        self.requests = requests
        self.fraction = fraction
        self.off_steps = 0
        self.probes = 0

    def due(self) -> bool:
        return self.interval > 0 and self.off_steps >= self.interval

    def pick(self, n: int) -> set[int]:
        """Indices of the requests to probe in a batch of n (rotating between probes)."""
        k = min(n, max(self.requests, math.ceil(self.fraction * n)))
        start = self.probes * k
        self.probes += 1
        return {(start + i) % n for i in range(k)}

    def record(self, gammas: Sequence[int]) -> None:
        self.off_steps = 0 if any(g > 0 for g in gammas) else self.off_steps + 1

"""TIDE's latency model (seed 000 §4.1, Eq. 2–5): speculate only where predicted speedup > 1.

    E[ℓ]      = (1 − α^{γ+1}) / (1 − α)                                    (Eq. 2)
    SD(b)     = (γ·D(b) + T(b(γ+1))) / E[ℓ]          ms per token            (Eq. 3)
    Speedup   = T(b) / SD(b)                                                (Eq. 4)
              = (1 − α^{γ+1}) / ((1 − α)(c(b)·γ + β(b)))                    (Eq. 5)
    with c(b) = D(b)/T(b) and β(b) = T(b(γ+1))/T(b).

`LatencyProfile.target_ms(b, n)` is T for b sequences × n tokens each, i.e. the paper's
T(b·n); on a Table-5-shaped profile (``T_total_ms``) it is literally T(b·n).
"""

from __future__ import annotations

from tide.policies.base import Estimate, StepContext, StepFeedback
from tide.policies.estimators import ALPHA_CAP, AcceptanceEMA, OffProbe, expected_accept_len
from tide.policies.profile import LatencyProfile


def practical_speedup(profile: LatencyProfile, alpha: float, gamma: int, b: int) -> float:
    """Seed 000 Eq. 5 (γ = 0 → 1.0 by definition: plain decoding)."""
    if gamma <= 0:
        return 1.0
    t1 = profile.target_ms(b, 1)
    c = profile.draft_ms(b) / t1
    beta = profile.target_ms(b, gamma + 1) / t1
    return expected_accept_len(alpha, gamma) / (c * gamma + beta)


def min_alpha(profile: LatencyProfile, gamma: int, b: int, tol: float = 1e-7) -> float | None:
    """Smallest α with Eq. 5 speedup > 1 at (γ, b), by bisection (speedup rises with α).

    None when even α → 1 (E[ℓ] = γ + 1) cannot pay for the step: speculation never helps there.
    """
    if practical_speedup(profile, 1.0, gamma, b) <= 1.0:
        return None
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if practical_speedup(profile, mid, gamma, b) > 1.0:
            hi = mid
        else:
            lo = mid
    return hi


def threshold_table(profile: LatencyProfile, gamma: int, batches: list[int]) -> dict[int, float | None]:
    """Minimum acceptance per batch size (the table TIDE derives at start-up and exposes)."""
    return {b: min_alpha(profile, gamma, b) for b in batches}


class TideLatencyPolicy:
    """Seed 000 Eq. 5 per step: γ (default 3, TIDE's fixed choice) if predicted speedup > margin.

    α̂ is an online estimate (`AcceptanceEMA`: exponentially weighted Eq.-2 counts, `alpha_decay`
    per step, i.e. ≈ 10 steps of memory at 0.9, shrunk toward `alpha_prior`); the per-batch-size
    minimum acceptance `min_alpha(γ, b)` is cached, so a decision is one dict lookup and one
    comparison. `optimize_gamma=True` instead picks argmax_γ of Eq. 5 (an extension; TIDE fixes γ).

    Not in the paper: how α is measured while speculation is off. Without new data α̂ would stay
    frozen (Nightjar's decision deadlock), so after `probe_interval` off steps one step speculates
    at γ = 1 for a quarter of the batch (`probe_fraction`) to refresh α̂.
    """

    def __init__(
        self,
        profile: LatencyProfile,
        gamma: int = 3,
        optimize_gamma: bool = False,
        margin: float = 1.0,
        alpha_decay: float = 0.9,
        alpha_prior: float = 0.5,
        probe_interval: int = 32,
        probe_fraction: float = 0.25,
    ) -> None:
        if gamma < 1:
            raise ValueError("gamma must be >= 1")
        self.name = "tide"
        self.profile = profile
        self.gamma = gamma
        self.optimize_gamma = optimize_gamma
        self.margin = margin
        self.alpha = AcceptanceEMA(decay=alpha_decay, prior=alpha_prior)
        self.probe = OffProbe(probe_interval, fraction=probe_fraction)
        self._min_alpha: dict[tuple[int, int], float | None] = {}

    def threshold(self, b: int, gamma: int | None = None) -> float | None:
        """Cached minimum α for speedup > 1 at batch b (None: never pays)."""
        g = self.gamma if gamma is None else gamma
        key = (b, g)
        if key not in self._min_alpha:
            self._min_alpha[key] = min_alpha(self.profile, g, b)
        return self._min_alpha[key]

    def _choose(self, alpha: float, b: int, max_gamma: int) -> int:
        if self.optimize_gamma:
            best = max(range(1, max_gamma + 1), key=lambda g: practical_speedup(self.profile, alpha, g, b))
            return best if practical_speedup(self.profile, alpha, best, b) > self.margin else 0
        g = min(self.gamma, max_gamma)
        if self.margin != 1.0:
            return g if practical_speedup(self.profile, alpha, g, b) > self.margin else 0
        thr = self.threshold(b, g)
        return g if thr is not None and alpha > thr else 0

    def decide(self, ctx: StepContext) -> list[int]:
        n = len(ctx.requests)
        if n == 0 or ctx.max_gamma <= 0:
            return [0] * n
        g = self._choose(min(self.alpha.value, ALPHA_CAP), ctx.batch_size, ctx.max_gamma)
        if g > 0:
            return [g] * n
        if self.probe.due():
            chosen = self.probe.pick(n)
            return [1 if i in chosen else 0 for i in range(n)]
        return [0] * n

    def observe(self, feedback: StepFeedback) -> None:
        self.alpha.update(feedback.gammas, feedback.accepted)
        self.probe.record(feedback.gammas)

    def estimates(self) -> list[Estimate]:
        """α̂, which the thresholds are compared with (exported as `tide_inference_policy_estimate`)."""
        return [Estimate("alpha_global", self.alpha.value)]

    def draft_changed(self) -> None:
        """A hot swap: α̂ restarts from its prior (it described the old draft)."""
        self.alpha.reset()

"""DSD / SmartSpec goodput model (Liu et al., "Optimizing Speculative Decoding for Serving LLMs
Using Goodput", 2024; the "DSD" baseline of seed 001), re-implemented from the paper's description.

Per step, choose the proposal length k ∈ {0..K} that maximises predicted goodput

    goodput(k) = Σ_i E[ℓ](α̂, k) / (k·D̂(b) + T̂_verify(b, k))        tokens per ms

* α̂: the historical token acceptance rate, a moving average over the last `window` request-steps
  that speculated (estimated as in seed 004 Eq. 2, consistent with the E[ℓ] formula);
* T̂_verify: a linear batch-latency model fitted online by least squares with forgetting,
  T = c0 + c1·b + c2·N over observed steps, N = Σ(k_i + 1) batched tokens and b standing in for
  the context tokens (KV traffic grows with the number of sequences); D̂(b) likewise d0 + d1·b per
  draft step. A profile, if given, seeds both fits with pseudo-observations.

Faithful to the criticism in seed 001: α̂ moves only on steps that speculate, so once k = 0
wins, no new acceptance data arrives — the "decision deadlock". We keep that behaviour (no
probing) so the comparison shows it; one uniform k per batch (the paper's per-request variant
reduces to this when requests share α̂).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from tide.policies.base import StepContext, StepFeedback
from tide.policies.estimators import expected_accept_len, mle_alpha
from tide.policies.profile import LatencyProfile


class DecayedLeastSquares:
    """y ≈ θ·x by least squares over exponentially down-weighted samples (normal equations)."""

    def __init__(self, dim: int, decay: float = 0.99, ridge: float = 1e-6) -> None:
        self.decay = decay
        self.ridge = ridge
        self.xtx = np.zeros((dim, dim))
        self.xty = np.zeros(dim)
        self.count = 0.0
        self.theta: np.ndarray | None = None

    def add(self, x: list[float], y: float, weight: float = 1.0) -> None:
        v = np.asarray(x, dtype=float)
        self.xtx = self.decay * self.xtx + weight * np.outer(v, v)
        self.xty = self.decay * self.xty + weight * y * v
        self.count = self.decay * self.count + weight
        self.theta = None

    def coef(self) -> list[float] | None:
        """θ as plain floats (None until there are at least dim samples' worth of weight)."""
        if self.count < len(self.xty):
            return None
        if self.theta is None:
            a = self.xtx + self.ridge * np.eye(len(self.xty))
            self.theta = np.linalg.lstsq(a, self.xty, rcond=None)[0]
        return [float(c) for c in self.theta]

    def predict(self, x: list[float]) -> float | None:
        theta = self.coef()
        return None if theta is None else sum(c * v for c, v in zip(theta, x, strict=True))


class DSDPolicy:
    """Goodput-maximising uniform k from past acceptance and a linear batch-latency model."""

    def __init__(
        self,
        profile: LatencyProfile | None = None,
        max_gamma: int = 8,
        window: int = 64,
        init_gamma: int = 3,
        fit_decay: float = 0.99,
    ) -> None:
        self.name = "dsd"
        self.max_gamma = max_gamma
        self.init_gamma = init_gamma
        self.gammas: deque[int] = deque(maxlen=window)
        self.accepted: deque[int] = deque(maxlen=window)
        self.verify_fit = DecayedLeastSquares(3, fit_decay)
        self.draft_fit = DecayedLeastSquares(2, fit_decay)
        if profile is not None:
            self._seed(profile)

    def _seed(self, profile: LatencyProfile) -> None:
        for b in profile.batches:
            self.draft_fit.add([1.0, b], profile.draft_ms(b), weight=0.5)
            for n in (1, 2, 4):
                self.verify_fit.add([1.0, b, b * n], profile.target_ms(b, n), weight=0.5)

    def goodput(self, alpha: float, k: int, b: int) -> float | None:
        """Predicted tokens per ms at uniform k (None while the latency fits lack data)."""
        tv, td = self.verify_fit.coef(), self.draft_fit.coef()
        if tv is None or td is None:
            return None
        t = tv[0] + tv[1] * b + tv[2] * b * (k + 1)
        d = td[0] + td[1] * b if k > 0 else 0.0
        if t + k * d <= 0:
            return None
        return b * expected_accept_len(alpha, k) / (k * d + t)

    def decide(self, ctx: StepContext) -> list[int]:
        n = len(ctx.requests)
        kmax = min(self.max_gamma, ctx.max_gamma)
        alpha = mle_alpha(self.gammas, self.accepted, default=None)
        if n == 0:
            return []
        if alpha is None or self.goodput(alpha, 0, ctx.batch_size) is None:
            return [min(self.init_gamma, kmax)] * n
        best_k, best = 0, -1.0
        for k in range(kmax + 1):
            g = self.goodput(alpha, k, ctx.batch_size)
            if g is not None and g > best:
                best_k, best = k, g
        return [best_k] * n

    def observe(self, feedback: StepFeedback) -> None:
        b = feedback.batch_size
        if not feedback.gammas:
            return
        tokens = sum(g + 1 for g in feedback.gammas)
        if feedback.verify_ms > 0:
            self.verify_fit.add([1.0, b, tokens], feedback.verify_ms)
        steps = max(feedback.gammas)
        if steps > 0 and feedback.draft_ms > 0:
            self.draft_fit.add([1.0, b], feedback.draft_ms / steps)
        for g, v in zip(feedback.gammas, feedback.accepted, strict=False):
            if g > 0:
                self.gammas.append(g)
                self.accepted.append(v)

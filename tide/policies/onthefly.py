"""On-the-fly analytical γ (seed 004 §4.1, Definition 1 / Eq. 1, estimator Eq. 2).

Per request, per step:

    γ* = argmax_γ  (1 − β^{γ+1}) / ((1 − β)(γ·a_q + b_p(γ)))                     (Eq. 1)
    β̂  = ΣV / (ΣV + Σ 1(V < γ))  over the request's last h speculation steps,
         capped at Acc_max = 0.98                                                 (Eq. 2)

a_q (ms per draft step) and b_p(γ) (ms per verification with γ drafted tokens) are *measured*:
exponential averages of the engine's draft/verify times at the current batch size (seed 004:
"derived by observing the most recent steps"); a profile, when given, only fills in γ values
not measured yet. The paper targets one request; in a batch each request solves Eq. 1 against
the batch's step times. A request without history starts from the pooled estimate over the last
h speculation steps of all requests, or at `init_gamma` before any data exists; a request with
fewer than h own steps has its window topped up with the most recent pooled steps (in a batch,
"the last h speculations" it can learn from), so one early rejection (α̂ = 0/(0+1) = 0) does
not pin it at γ = 0 for the rest of its life.

Not in the paper: `probe_interval` (anti-deadlock probing). A request at γ* = 0 produces no new
acceptance data, and Eq. 2 would keep its last (bad) value forever; after `probe_interval`
consecutive γ = 0 steps the request drafts one token (γ = 1) to refresh it.
"""

from __future__ import annotations

from tide.policies.base import StepContext, StepFeedback
from tide.policies.estimators import ALPHA_CAP, History, RequestStates, expected_accept_len
from tide.policies.profile import LatencyProfile


class StepTimes:
    """Exponential averages of measured verify ms per (b, n tokens/seq) and draft ms per step per b."""

    def __init__(self, profile: LatencyProfile | None = None, decay: float = 0.8) -> None:
        self.profile = profile
        self.decay = decay
        self.verify: dict[tuple[int, int], float] = {}
        self.draft: dict[int, float] = {}

    def _ema(self, table: dict, key, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else self.decay * old + (1 - self.decay) * value

    def observe(self, fb: StepFeedback) -> None:
        if not fb.gammas:
            return
        b = fb.batch_size
        n = round(1 + sum(fb.gammas) / len(fb.gammas))
        if fb.verify_ms > 0:
            self._ema(self.verify, (b, n), fb.verify_ms)
        steps = max(fb.gammas)
        if steps > 0 and fb.draft_ms > 0:
            self._ema(self.draft, b, fb.draft_ms / steps)

    def verify_ms(self, b: int, n: int) -> float:
        got = self.verify.get((b, n))
        if got is not None:
            return got
        if self.profile is not None:
            return self.profile.target_ms(b, n)
        near = [(abs(k[1] - n), v) for k, v in self.verify.items() if k[0] == b]
        return min(near)[1] if near else 1.0

    def draft_ms(self, b: int) -> float:
        got = self.draft.get(b)
        if got is not None:
            return got
        return self.profile.draft_ms(b) if self.profile is not None else 0.0


def best_gamma(alpha: float, max_gamma: int, a_ms: float, verify_ms) -> int:
    """Eq. 1: argmax over γ ∈ {0..max_gamma} of E[ℓ](α, γ) / (γ·a + b_p(γ))."""
    best, best_val = 0, 1.0 / verify_ms(0)
    for g in range(1, max_gamma + 1):
        val = expected_accept_len(alpha, g) / (g * a_ms + verify_ms(g))
        if val > best_val:
            best, best_val = g, val
    return best


class _ReqState:
    __slots__ = ("hist", "off")

    def __init__(self, h: int) -> None:
        self.hist = History(h)
        self.off = 0  # consecutive γ = 0 steps


class OnTheFlyPolicy:
    """Seed 004 Method 1: per-request MLE acceptance (Eq. 2) and analytical γ (Eq. 1)."""

    def __init__(
        self,
        profile: LatencyProfile | None = None,
        h: int = 10,
        alpha_cap: float = ALPHA_CAP,
        init_gamma: int = 3,
        time_decay: float = 0.8,
        probe_interval: int = 32,
    ) -> None:
        self.name = "onthefly"
        self.h = h
        self.alpha_cap = alpha_cap
        self.init_gamma = init_gamma
        self.times = StepTimes(profile, time_decay)
        self.pooled = History(h)  # last h speculation steps of any request
        self.requests: RequestStates[_ReqState] = RequestStates()
        self.probe_interval = probe_interval

    def alpha_for(self, hist: History, pooled_suffix: list[tuple[int, int]] | None = None) -> float | None:
        """Eq. 2 over the request's last h speculation steps, topped up from the pooled window.

        `pooled_suffix[k]` = (successes, failures) of the newest k pooled steps (see decide)."""
        missing = self.h - len(hist.gammas)
        s, f = hist.succ, hist.fail
        if missing > 0:
            suffix = pooled_suffix if pooled_suffix is not None else self._pooled_suffix()
            ps, pf = suffix[min(missing, len(suffix) - 1)]
            s, f = s + ps, f + pf
        return None if s + f == 0 else min(s / (s + f), self.alpha_cap)

    def _pooled_suffix(self) -> list[tuple[int, int]]:
        out, s, f = [(0, 0)], 0, 0
        for g, v in zip(reversed(self.pooled.gammas), reversed(self.pooled.accepted), strict=True):
            s, f = s + v, f + (1 if v < g else 0)
            out.append((s, f))
        return out

    def decide(self, ctx: StepContext) -> list[int]:
        states = self.requests.begin(ctx, lambda r: _ReqState(self.h))
        if not states:
            return []
        b, gmax = ctx.batch_size, ctx.max_gamma
        a_ms = self.times.draft_ms(b)
        verify_cache: dict[int, float] = {}
        best_cache: dict[float, int] = {}

        def verify(g: int) -> float:
            if g not in verify_cache:
                verify_cache[g] = self.times.verify_ms(b, g + 1)
            return verify_cache[g]

        suffix = self._pooled_suffix()
        out = []
        for st in states:
            alpha = self.alpha_for(st.hist, suffix)
            if alpha is None:
                g = min(self.init_gamma, gmax)
            else:
                key = round(alpha, 3)
                if key not in best_cache:
                    best_cache[key] = best_gamma(key, gmax, a_ms, verify)
                g = best_cache[key]
            if g == 0 and gmax > 0 and 0 < self.probe_interval <= st.off:
                g = 1
            out.append(g)
        return out

    def observe(self, feedback: StepFeedback) -> None:
        self.times.observe(feedback)
        for st, g, v in zip(self.requests.take(len(feedback.gammas)), feedback.gammas, feedback.accepted, strict=False):
            st.hist.add(g, v)
            self.pooled.add(g, v)
            st.off = 0 if g > 0 else st.off + 1

"""Seed 004 §4.2 drop-in γ state machines, one saturating counter per request.

FSM (Method 2): γ ← γ − 1 if a drafted token was rejected, γ ← γ + 1 if all were accepted,
saturating in [min_gamma, γmax] (γmax = the configured upper limit, "considered an upper limit").
A γ = 0 step drafts nothing and so rejects nothing: it counts as "all accepted" and γ climbs
back to 1 — the counter's own probe (with a useless draft it alternates 0 ↔ 1; no deadlock).

Cache-FSM (Method 3): a per-request token cache (prompt + generated tokens) decides the move:
+1 if an accepted draft token was already in the cache, +1 more when all drafted tokens were
accepted, −1 if none of the accepted tokens was in the cache. The engine reports the per-request
hit count in `StepFeedback.cache_hits`; when it is absent the policy falls back to the plain FSM
rule. A γ = 0 step is handled as in the FSM (+1).
"""

from __future__ import annotations

from tide.policies.base import StepContext, StepFeedback
from tide.policies.estimators import RequestStates


class _Counter:
    __slots__ = ("gamma",)

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma


class FSMPolicy:
    """Seed 004 Method 2: per-request saturating counter on γ."""

    def __init__(self, init_gamma: int = 3, max_gamma: int = 8, min_gamma: int = 0) -> None:
        if not 0 <= min_gamma <= init_gamma <= max_gamma:
            raise ValueError("need 0 <= min_gamma <= init_gamma <= max_gamma")
        self.name = "fsm"
        self.init_gamma = init_gamma
        self.max_gamma = max_gamma
        self.min_gamma = min_gamma
        self.requests: RequestStates[_Counter] = RequestStates()

    def decide(self, ctx: StepContext) -> list[int]:
        counters = self.requests.begin(ctx, lambda r: _Counter(self.init_gamma))
        cap = min(self.max_gamma, ctx.max_gamma)
        return [min(c.gamma, cap) for c in counters]

    def step(self, gamma: int, accepted: int, hits: int | None) -> int:
        """The counter move for one request's step; `hits` None → plain FSM rule."""
        if gamma <= 0 or hits is None:
            return 1 if accepted >= gamma else -1
        delta = 1 if hits > 0 else -1
        if accepted >= gamma:
            delta += 1
        return delta

    def observe(self, feedback: StepFeedback) -> None:
        hits = feedback.cache_hits if self.uses_cache and feedback.cache_hits else None
        for i, (c, g, v) in enumerate(
            zip(self.requests.take(len(feedback.gammas)), feedback.gammas, feedback.accepted, strict=False)
        ):
            d = self.step(g, v, None if hits is None else hits[i])
            c.gamma = max(self.min_gamma, min(self.max_gamma, g + d))

    uses_cache = False


class CacheFSMPolicy(FSMPolicy):
    """Seed 004 Method 3: the FSM driven by token-cache hits of the accepted tokens."""

    uses_cache = True

    def __init__(self, init_gamma: int = 3, max_gamma: int = 8, min_gamma: int = 0) -> None:
        super().__init__(init_gamma, max_gamma, min_gamma)
        self.name = "cache-fsm"

"""Nightjar (seed 001, Algorithm 1, Eq. 3): per-batch-size ADA-BINGREEDY over γ ∈ {0..Γmax}.

Each batch size B keeps its own hierarchy (Fig. 4): blocks j_B of H_B = 2^{j_B − 1} rounds,
split into ⌊√H_B⌋ bins of ⌊√H_B⌋ rounds (one round = one decoding step at that batch size).
At the start of a bin, the bin is an *exploration* bin with probability 1/√b_B, where b_B is
the bin's index inside its block (not the batch size; it restarts at 1 with every block, so the
first bin of every block explores). Exploration rounds play γ ~ Uniform{0..Γmax}; exploitation
rounds play Eq. 3:

    γ_t* = argmin_γ  1/g̃_{B,γ} + 1(γ_{t−1} = 0 ∧ γ > 0) · c_prefill(L_max, B) / γ

g̃_{B,γ} is the cumulative average goodput of arm γ at batch size B (g̃ ← g̃ + (r − g̃)/n,
g̃⁽⁰⁾ = 0, so unplayed arms have 1/g̃ = ∞ and are never exploited). Units here: rewards r are
goodput in tokens per ms (emitted tokens / step ms), so 1/g̃ is ms per token; c_prefill is the
catch-up latency in ms from the profile's c(L_max, B) table (Nightjar Table 1) and L_max the
largest lag in the batch. The paper adds the two terms as written; we keep its form.
γ = 0 is an arm, so speculation can be switched off — and exploration keeps sampling γ > 0,
which is Nightjar's answer to decision deadlock.
"""

from __future__ import annotations

import math
import random

from tide.policies.base import StepContext, StepFeedback
from tide.policies.profile import LatencyProfile


class _BatchState:
    __slots__ = ("j", "H", "bin", "tau", "explore", "g", "n")

    def __init__(self, arms: int) -> None:
        self.j, self.H, self.bin, self.tau = 1, 1, 1, 1  # Algorithm 1, line 3
        self.explore = True
        self.g = [0.0] * arms  # cumulative-average goodput per γ (tokens/ms)
        self.n = [0] * arms

    def advance(self) -> None:
        """Lines 16–23: next round; close the bin after √H rounds and the block after √H bins."""
        self.tau += 1
        root = math.sqrt(self.H)
        if self.tau > root:
            self.bin += 1
            self.tau = 1
            if self.bin > root:
                self.j += 1
                self.H = 2 ** (self.j - 1)
                self.bin = 1


class NightjarPolicy:
    """Seed 001 Algorithm 1 with the Eq. 3 switching-cost term; one uniform γ per batch."""

    def __init__(
        self,
        profile: LatencyProfile | None = None,
        max_gamma: int = 6,
        seed: int = 0,
        c_prefill_ms: float = 0.0,
    ) -> None:
        """`c_prefill_ms` is a constant switching cost used only when no profile is given."""
        self.name = "nightjar"
        self.profile = profile
        self.max_gamma = max_gamma
        self.c_prefill_ms = c_prefill_ms
        self.rng = random.Random(seed)
        self.states: dict[int, _BatchState] = {}
        self.prev_gamma = 0  # γ_{t−1}, the last γ played (engine-wide)
        self._pending: tuple[int, int] | None = None

    def _c_prefill(self, ctx: StepContext) -> float:
        l_max = max((r.lag for r in ctx.requests), default=0)
        if self.profile is None:
            return self.c_prefill_ms
        return self.profile.catchup_ms(l_max, ctx.batch_size)

    def exploit(self, st: _BatchState, arms: int, c_prefill: float) -> int:
        """Eq. 3 over the played arms (an unplayed arm has g̃ = 0 → cost ∞)."""
        best, best_cost = 0, math.inf
        for g in range(arms):
            if st.g[g] <= 0.0:
                continue
            cost = 1.0 / st.g[g]
            if g > 0 and self.prev_gamma == 0:
                cost += c_prefill / g
            if cost < best_cost:
                best, best_cost = g, cost
        return best

    def decide(self, ctx: StepContext) -> list[int]:
        n = len(ctx.requests)
        if n == 0:
            return []
        arms = min(self.max_gamma, ctx.max_gamma) + 1
        st = self.states.get(ctx.batch_size)
        if st is None:
            st = self.states[ctx.batch_size] = _BatchState(self.max_gamma + 1)
        if st.tau == 1:  # line 6–8: bin initialisation
            st.explore = self.rng.random() < 1.0 / math.sqrt(st.bin)
        if st.explore:
            g = self.rng.randrange(arms)  # line 11
        else:
            g = self.exploit(st, arms, self._c_prefill(ctx))  # line 14, Eq. 3
        self._pending = (ctx.batch_size, g)
        return [g] * n

    def observe(self, feedback: StepFeedback) -> None:
        if self._pending is None:
            return
        b, g = self._pending
        self._pending = None
        st = self.states[b]
        if feedback.step_ms > 0:
            r = feedback.emitted_tokens / feedback.step_ms  # goodput, tokens per ms
            st.n[g] += 1
            st.g[g] += (r - st.g[g]) / st.n[g]
        st.advance()
        self.prev_gamma = g

"""Whether a candidate replaces the draft the workers run. Pure functions, no I/O.

The comparison uses the *served* accept length at γ (services.trainer.training.evaluate: tokens per
verification along the engine's walk on the held-out chunks, bonus token included), the number a
serving engine achieves, not the all-rows mean (`acceptance`) which overstates it. Candidate and
base are evaluated on the same held-out chunks. Without a base draft the workers decode one token
per step, so the reference is 1.0.

A higher accept length than the base is not enough: drafting costs time. The candidate must also
*predict a speed-up* over what serves now when its accept length is put through the step costs
(`StepCosts`, from the workers' latency profile): tokens per unit time at γ, relative to plain
decoding, is served(γ) / (T(1, γ+1)/T(1, 1) + γ·D(1)/T(1, 1)). Without a base draft the workers
run the n-gram drafter, which the adaptive γ policy uses only where it pays, so the reference is
plain decoding (speed-up 1.0); with one, the base's own predicted speed-up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tide.policies.costs import StepCosts, step_costs

__all__ = ["NO_DRAFT", "PromotionVerdict", "StepCosts", "decide", "served_at", "step_costs"]

log = logging.getLogger(__name__)

NO_DRAFT = 1.0  # tokens per step without a draft


@dataclass(frozen=True)
class PromotionVerdict:
    """Whether a trained candidate replaces the served draft (not a control-plane decision)."""

    promote: bool
    reason: str  # names the run and the numbers; the promotion reason, or why not


def served_at(evaluation: dict | None, gamma: int) -> float | None:
    """The served accept length at `gamma` of a training-library evaluation (None: not evaluated)."""
    if not evaluation:
        return None
    value = (evaluation.get("served") or {}).get(str(gamma))
    return None if value is None else float(value)


def decide(run_id: str, candidate: float | None, base: float | None, base_version: str, *, gamma: int,
           margin: float, auto_promote: bool, costs: StepCosts | None = None) -> PromotionVerdict:
    """Promote when candidate - base >= margin (base: `base_version`'s served accept length, or
    NO_DRAFT when there is no base version), the candidate's predicted speed-up (`costs`) beats
    the base's (plain decoding's, 1.0, without a base version), and auto-promotion is on."""
    costs = costs or StepCosts()
    if candidate is None:
        return PromotionVerdict(False, f"run {run_id}: not promoted: the candidate was not evaluated "
                                       "(no held-out chunks)")
    if base_version and base is None:
        return PromotionVerdict(False, f"run {run_id}: not promoted: the base {base_version} was not evaluated "
                                       "(no held-out chunks)")
    ref = base if base_version else NO_DRAFT
    gain = candidate - ref
    numbers = (f"served accept length at γ={gamma} {candidate:.3f} vs {ref:.3f} "
               f"({base_version or 'no draft'}): {gain:+.3f}, margin {margin:.3f}")
    if gain < margin:
        return PromotionVerdict(False, f"run {run_id}: not promoted: {numbers}")
    speedup = costs.speedup(candidate, gamma)
    ref_speedup = costs.speedup(base, gamma) if base_version else 1.0
    numbers += (f"; predicted speed-up at γ={gamma} {speedup:.3f}x vs {ref_speedup:.3f}x "
                f"({base_version or 'plain decoding'}; step costs: {costs.source})")
    if speedup <= ref_speedup:
        return PromotionVerdict(False, f"run {run_id}: not promoted: drafting would not pay: {numbers}")
    if not auto_promote:
        return PromotionVerdict(False, f"run {run_id}: better by the margin but not promoted: auto-promotion is off "
                                       f"(TIDE_TRAINER_AUTO_PROMOTE=0); {numbers}")
    return PromotionVerdict(True, f"run {run_id}: {numbers}")

"""Whether a candidate replaces the draft the workers run. Pure functions, no I/O.

The comparison uses the *served* accept length at γ (services.trainer.training.evaluate: tokens per
verification along the engine's walk on the held-out chunks, bonus token included), the number a
serving engine achieves, not the all-rows mean (`acceptance`) which overstates it. Candidate and
base are evaluated on the same held-out chunks. Without a base draft the workers decode one token
per step, so the reference is 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass

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
           margin: float, auto_promote: bool) -> PromotionVerdict:
    """Promote when candidate - base >= margin (base: `base_version`'s served accept length, or
    NO_DRAFT when there is no base version) and auto-promotion is on."""
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
    if not auto_promote:
        return PromotionVerdict(False, f"run {run_id}: better by the margin but not promoted: auto-promotion is off "
                                       f"(TIDE_TRAINER_AUTO_PROMOTE=0); {numbers}")
    return PromotionVerdict(True, f"run {run_id}: {numbers}")

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
from pathlib import Path

from tide.policies.profile import LatencyProfile

log = logging.getLogger(__name__)

NO_DRAFT = 1.0  # tokens per step without a draft


@dataclass(frozen=True)
class StepCosts:
    """Batch-1 step costs relative to one plain target step: `verify[γ]` = T(1, γ+1) / T(1, 1),
    `draft` = D(1) / T(1, 1) (one EAGLE-3 draft token). Defaults: the reference CPU (Zen 4, bf16;
    issue #30's numbers: T(1, 1) = 14.5 ms, T(1, 4) = 14.9 ms, D(1) = 1.8 ms)."""

    verify: tuple[float, ...] = (1.0, 1.01, 1.02, 1.03, 1.04, 1.05)  # index γ = 0..5
    draft: float = 0.124
    source: str = "defaults (reference CPU)"

    def speedup(self, accept_length: float, gamma: int) -> float:
        """Predicted tokens/s relative to plain decoding at batch 1 with `accept_length` tokens per step."""
        return accept_length / (self.verify[min(gamma, len(self.verify) - 1)] + gamma * self.draft)

    @classmethod
    def from_profile(cls, profile: LatencyProfile, source: str) -> StepCosts:
        t1 = profile.target_ms(1, 1)
        return cls(tuple(profile.target_ms(1, g + 1) / t1 for g in range(6)), profile.draft_ms(1) / t1, source)


def step_costs(profile_path: str, model_id: str, cache_dir: Path) -> StepCosts:
    """The costs from `profile_path` if given, else from the newest EAGLE-3 latency profile a worker of
    `model_id` cached on this machine (`<cache_dir>/<model_id>-*.json`), else the defaults."""
    candidates = [Path(profile_path)] if profile_path else sorted(
        cache_dir.glob(f"{model_id}-*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in candidates:
        try:
            profile = LatencyProfile.load(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("latency profile %s unreadable: %s", path, e)
            continue
        if profile_path or (profile.meta.get("drafter") or {}).get("algorithm") == "eagle3":
            return StepCosts.from_profile(profile, str(path))
    return StepCosts()


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

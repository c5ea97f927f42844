"""Step costs relative to a plain target step, from the workers' latency profile, and what they
imply: the speed-up an accept length buys (the trainer's promotion rule), the acceptance below which
speculation does not pay (the controller's cold-start rule), and whether any draft could pay at a
given batch size (the controller's load rule). Pure; reads one file."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from tide.policies.profile import LatencyProfile

log = logging.getLogger(__name__)

# The adaptive γ policy drafts only where the predicted goodput beats plain decoding by this
# fraction (tide.policies.adaptive.AdaptivePolicy's `min_gain`).
MIN_GAIN = 0.05


@dataclass(frozen=True)
class StepCosts:
    """Step costs at one batch size b (1 unless built for another) relative to one plain target
    step: `verify[γ]` = T(b, γ+1) / T(b, 1), `draft` = D(b) / T(b, 1) (one EAGLE-3 draft token for
    each of the b sequences). Defaults: the reference CPU at batch 1 (Zen 4, bf16; issue #30's
    numbers: T(1, 1) = 14.5 ms, T(1, 4) = 14.9 ms, D(1) = 1.8 ms)."""

    verify: tuple[float, ...] = (1.0, 1.01, 1.02, 1.03, 1.04, 1.05)  # index γ = 0..5
    draft: float = 0.124
    source: str = "defaults (reference CPU)"

    def speedup(self, accept_length: float, gamma: int) -> float:
        """Predicted tokens/s relative to plain decoding (at these costs' batch size) with `accept_length`
        tokens per step."""
        return accept_length / (self.verify[min(gamma, len(self.verify) - 1)] + gamma * self.draft)

    @classmethod
    def from_profile(cls, profile: LatencyProfile, source: str, batch: float = 1.0) -> StepCosts:
        t1 = profile.target_ms(batch, 1)
        return cls(tuple(profile.target_ms(batch, g + 1) / t1 for g in range(6)), profile.draft_ms(batch) / t1,
                   source)

    def best_speedup(self, rate: float) -> float:
        """The best predicted speed-up over γ = 1..5 of a draft accepting each drafted token with
        probability `rate` (0..1): a chain of γ emits (1 - rate^(γ+1)) / (1 - rate) tokens a step."""
        rate = min(max(rate, 0.0), 0.999)
        return max(self.speedup((1.0 - rate ** (g + 1)) / (1.0 - rate), g) for g in range(1, len(self.verify)))

    def break_even_rate(self, min_gain: float = MIN_GAIN) -> float:
        """The acceptance rate per drafted token (0..1) below which the γ policy never drafts: at
        γ = 1 a step emits 1 + α tokens for verify[1] + draft plain steps, and pays where
        (1 + α) / (verify[1] + draft) >= 1 + min_gain. Deeper γ needs a higher α (each further
        token is accepted with probability α^j but costs the same), so γ = 1 sets the floor.
        The reference CPU's costs give 0.19."""
        return min(1.0, max(0.0, (1.0 + min_gain) * (self.verify[1] + self.draft) - 1.0))


def profile_cache_dir() -> Path:
    """Where workers cache latency profiles: $TIDE_PROFILE_CACHE_DIR, else $TIDE_CACHE_DIR/profiles
    (tide.target's cache root, ~/.cache/tide). Torch-free, for the controller."""
    env = os.environ.get("TIDE_PROFILE_CACHE_DIR")
    root = Path(os.environ.get("TIDE_CACHE_DIR", Path.home() / ".cache" / "tide"))
    return Path(env) if env else root / "profiles"


def find_profile(profile_path: str, model_id: str, cache_dir: Path | None = None) -> tuple[LatencyProfile, str] | None:
    """(profile, its path): `profile_path` if given, else the newest EAGLE-3 latency profile a worker of
    `model_id` cached on this machine (`<cache_dir>/<model_id>-*.json`, default profile_cache_dir());
    None when there is none readable."""
    cache_dir = cache_dir or profile_cache_dir()
    candidates = [Path(profile_path)] if profile_path else sorted(
        cache_dir.glob(f"{model_id}-*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in candidates:
        try:
            profile = LatencyProfile.load(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("latency profile %s unreadable: %s", path, e)
            continue
        if profile_path or (profile.meta.get("drafter") or {}).get("algorithm") == "eagle3":
            return profile, str(path)
    return None


def step_costs(profile_path: str, model_id: str, cache_dir: Path | None = None) -> StepCosts:
    """The batch-1 costs from find_profile's profile, else the defaults."""
    found = find_profile(profile_path, model_id, cache_dir)
    return StepCosts.from_profile(*found) if found else StepCosts()

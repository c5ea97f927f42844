"""Per-request draft selection from prompt features (seed 004 §5, Eq. 3–5).

Seed 004 models a prompt's acceptance under draft-model choice c as linear in a prompt vector u:
α_c^u = uᵀ Z_c + ε (Eq. 5), fits Z_c by ordinary least squares from observed acceptance, and
picks the draft whose predicted acceptance buys the highest throughput (Eq. 3–4: a costlier
draft must win enough acceptance to pay for its latency). Here:

* u = `prompt_features(...)` (FEATURE_NAMES): bias, log length, n-gram repetition, digit and
  code-symbol fractions — cheap stand-ins for the paper's length / perplexity / TF-IDF vector
  that an n-gram drafter's and a domain draft's acceptance actually depend on.
* Z_d per drafter: ridge regression toward the drafter's prior α (precision `prior_strength`),
  updated online from each finished request's Eq.-2 acceptance estimate, i.e. recursive least
  squares; before any data every prompt gets the prior.
* choice: argmax_d max_γ E[ℓ](α̂_d(u), γ) / (γ·cost_d + 1) — seed 004 Eq. 1 with the target's
  verify time as the unit and cost_d = draft step / target step (Eq. 3's a_q / b_p) — with α̂
  raised by an optimism bonus `explore`·σ·√(uᵀA⁻¹u) (LinUCB: the ridge posterior's standard
  deviation for this prompt, σ = `noise_sd` the spread of per-request α around the linear model),
  so a drafter that looks worse but is unexplored on this kind of prompt still gets tried (2σ:
  a ≈ 95 % upper confidence bound; at 1σ a single bad try on other prompts could rule a drafter
  out for good); the bonus vanishes as observations accumulate. The default prior strength 0.25 = (σ / 0.3)²
  puts a ±0.3 prior standard deviation on each coefficient.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from tide.policies.estimators import ALPHA_CAP, expected_accept_len, mle_alpha

FEATURE_NAMES = ("bias", "log_len", "repetition", "digits", "code")
_CODE_CHARS = set("{}[]();=<>_#/\\|&*:`")
_WORD = re.compile(r"\w+|[^\w\s]")


def _repetition(tokens: Sequence, n: int = 3) -> float:
    """Fraction of n-grams that repeat an earlier n-gram of the same prompt (0 … 1)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    seen: set = set()
    rep = 0
    for g in grams:
        rep += g in seen
        seen.add(g)
    return rep / len(grams)


def prompt_features(text: str | None = None, tokens: Sequence[int] | None = None) -> tuple[float, ...]:
    """u for one prompt, from its text and/or token ids (FEATURE_NAMES order, each ≈ 0 … 1).

    log_len = ln(1 + tokens) / ln(4096) (a 4k-token prompt → 1); repetition over token ids when
    given, else over words; digit and code fractions need the text (0 without it).
    """
    words = _WORD.findall(text) if text else []
    seq: Sequence = tokens if tokens is not None else words
    length = len(seq)
    chars = len(text) if text else 0
    digits = sum(ch.isdigit() for ch in text) / chars if chars else 0.0
    code = sum(ch in _CODE_CHARS for ch in text) / chars if chars else 0.0
    return (1.0, math.log1p(length) / math.log(4096), _repetition(seq), digits, code)


@dataclass(frozen=True)
class DrafterSpec:
    """A drafter the worker can serve with: name (e.g. "eagle3:v7", "ngram"), cost, prior α."""

    name: str
    cost_ratio: float = 0.04  # draft step ms / target step ms (BRIEF §5: EAGLE-3 8k vocab ≈ 0.04)
    prior_alpha: float = 0.5


class _Ridge:
    """Ridge / recursive least squares: A = λI + Σuuᵀ, b = λz₀ + Σuy, Z = A⁻¹b (noise units)."""

    def __init__(self, dim: int, prior_alpha: float, strength: float) -> None:
        self.a = strength * np.eye(dim)
        z0 = np.zeros(dim)
        z0[0] = prior_alpha  # bias coefficient = prior α: every prompt predicts the prior
        self.b = strength * z0
        self.n = 0

    def predict(self, u: np.ndarray) -> tuple[float, float]:
        a_inv_u = np.linalg.solve(self.a, u)
        z = np.linalg.solve(self.a, self.b)
        return float(u @ z), float(math.sqrt(max(u @ a_inv_u, 0.0)))

    def add(self, u: np.ndarray, y: float) -> None:
        self.a += np.outer(u, u)
        self.b += y * u
        self.n += 1


class DrafterSelector:
    """Chooses a drafter per request and learns each drafter's acceptance model online."""

    def __init__(
        self,
        drafters: Iterable[DrafterSpec | str],
        prior_strength: float = 0.25,
        noise_sd: float = 0.15,
        explore: float = 2.0,
    ) -> None:
        self.prior_strength = prior_strength
        self.noise_sd = noise_sd
        self.explore = explore
        self.specs: dict[str, DrafterSpec] = {}
        self.models: dict[str, _Ridge] = {}
        for d in drafters:
            self.add(d if isinstance(d, DrafterSpec) else DrafterSpec(d))
        if not self.specs:
            raise ValueError("DrafterSelector needs at least one drafter")

    def add(self, spec: DrafterSpec) -> None:
        """Register (or reset) a drafter, e.g. when the registry publishes a new draft version."""
        self.specs[spec.name] = spec
        self.models[spec.name] = _Ridge(len(FEATURE_NAMES), spec.prior_alpha, self.prior_strength)

    def remove(self, name: str) -> None:
        self.specs.pop(name, None)
        self.models.pop(name, None)

    def predict_alpha(self, name: str, features: Sequence[float]) -> float:
        mean, _ = self.models[name].predict(np.asarray(features, dtype=float))
        return min(max(mean, 0.0), ALPHA_CAP)

    def score(self, name: str, features: Sequence[float], max_gamma: int = 8) -> float:
        """Expected tokens per target-step time at the drafter's best γ (Eq. 1 with b_p = 1)."""
        mean, sd = self.models[name].predict(np.asarray(features, dtype=float))
        alpha = min(max(mean + self.explore * self.noise_sd * sd, 0.0), ALPHA_CAP)
        cost = self.specs[name].cost_ratio
        return max(expected_accept_len(alpha, g) / (g * cost + 1.0) for g in range(max_gamma + 1))

    def select(self, features: Sequence[float], max_gamma: int = 8) -> str:
        return max(sorted(self.specs), key=lambda n: self.score(n, features, max_gamma))

    def observe(
        self, name: str, features: Sequence[float], gammas: Sequence[int], accepted: Sequence[int]
    ) -> float | None:
        """Feed a finished request's (γ, accepted) steps; returns the α it observed (Eq. 2)."""
        if name not in self.models:
            return None
        alpha = mle_alpha(gammas, accepted, default=None)
        if alpha is not None:
            self.models[name].add(np.asarray(features, dtype=float), alpha)
        return alpha

"""When the hybrid drafter copies: per match length, a copy only where it is worth more than the draft.

The hybrid (hybrid.py) proposes a copy wherever the context's last 1-3 tokens occurred before. On
GSM8K answers that is 70-90 % of the steps, so the draft's chain runs on the rest only, and a
draft the online loop made much better (held-out accept length 1.40 -> 2.26 at γ = 3) changed
tokens/s by -2 to +1 % (docs/results/horizon, the zero-tax ceiling). A one-token match is the
weakest copy (accepted about as well as the chat-trained draft, far worse than a trained one).

So the gate learns, from the steps each source played, the acceptance rate per proposed token of
copies of each match length and of the draft's chains (accepted / (accepted + a miss when the
step stopped short of its depth): a geometric model's rate, comparable across depths), and lets a
copy of match length n propose only while

    1 + a_n + a_n² + a_n³  >=  (1 - draft_cost) · (1 + a_d + a_d² + a_d³)

the tokens a 3-deep copy is expected to emit against a 3-deep draft chain, the draft discounted
for its own forwards (`draft_cost`: 3 draft steps over one verify of 4 rows, γ D / T(1, γ + 1):
0.15 on the Zen 3 profile T(1, 4) = 15.0 ms, D = 0.76 ms; 0.21 on Zen 4's 15.6 / 1.1 ms).
Counts fade (`decay` per step observed for that source), and a copy length the gate has turned
off still plays every `explore_every`-th time it comes up, so its rate stays current.

Lossless: which source proposes is decided from steps already verified, before this step's
proposal, never from this step's random draws; either source alone is verified exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DRAFT = 0  # key of the draft's chains; copies are keyed by their match length 1..max_n


def _emitted(rate: float) -> float:
    """Tokens a 3-deep proposal emits with per-token acceptance `rate` (bonus included)."""
    return 1.0 + rate + rate * rate + rate ** 3


@dataclass
class CopyGate:
    max_n: int = 3
    draft_cost: float = 0.15
    decay: float = 0.99  # per observed step of a source: a memory of ~100 steps
    explore_every: int = 8
    # Priors (pseudo-counts): copies start trusted and the draft not, so a fresh gate copies as the
    # hybrid always did until the draft's own steps show it is better.
    copy_prior: tuple[float, float] = (3.0, 2.0)
    draft_prior: tuple[float, float] = (1.0, 3.0)
    _counts: dict[int, list[float]] = field(default_factory=dict)
    _skipped: dict[int, int] = field(default_factory=dict)

    def rate(self, key: int) -> float:
        s, f = self._of(key)
        return s / (s + f)

    def observe(self, key: int, depth: int, accepted: int) -> None:
        """A step that proposed `depth` tokens from source `key` (DRAFT or a match length) and had
        `accepted` of them accepted."""
        if depth <= 0:
            return
        c = self._of(key)
        c[0] = c[0] * self.decay + accepted
        c[1] = c[1] * self.decay + (1.0 if accepted < depth else 0.0)

    def allows_copy(self, match: int) -> bool:
        """Whether a copy from a `match`-token match proposes this step (else the draft does)."""
        if match <= 0:
            return False
        if _emitted(self.rate(match)) >= (1.0 - self.draft_cost) * _emitted(self.rate(DRAFT)):
            self._skipped[match] = 0
            return True
        self._skipped[match] = self._skipped.get(match, 0) + 1
        return self._skipped[match] % self.explore_every == 0  # play it now and then, to keep its rate current

    def _of(self, key: int) -> list[float]:
        got = self._counts.get(key)
        if got is None:
            got = self._counts[key] = list(self.draft_prior if key == DRAFT else self.copy_prior)
        return got

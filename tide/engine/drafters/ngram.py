"""Prompt-lookup (n-gram) drafter: no weights, copies what followed the latest n-gram match.

The fallback when no EAGLE-3 draft exists and the baseline it is compared with. Looks for the
most recent earlier occurrence of the sequence's last n tokens (n from `max_n` down to `min_n`)
and proposes the tokens that followed it.
"""

from __future__ import annotations

from tide.engine.drafters.base import DraftAlgorithm, Proposal
from tide.engine.sequence import Sequence


class NgramDrafter:
    algorithm = DraftAlgorithm.NGRAM
    version = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1, window: int = 1024) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.window = window  # search only the last `window` tokens: bounded cost per step

    def add_sequence(self, seq: Sequence) -> None:
        return None

    def remove_sequence(self, seq: Sequence) -> None:
        return None

    def lag(self, seq: Sequence) -> int:
        return 0

    def propose(self, seqs: list[Sequence], gammas: list[int], features=None, generators=None) -> Proposal:
        return Proposal(tokens=[self._lookup(s.token_ids, g) for s, g in zip(seqs, gammas, strict=True)],
                        probs=[None] * len(seqs))

    def _lookup(self, tokens: list[int], gamma: int) -> list[int]:
        hist = tokens[-self.window:]
        n_hist = len(hist)
        for n in range(min(self.max_n, n_hist - 1), self.min_n - 1, -1):
            pattern = hist[n_hist - n:]
            # Scan backwards for the latest earlier occurrence of the pattern.
            for start in range(n_hist - n - 1, -1, -1):
                if hist[start:start + n] == pattern:
                    follow = hist[start + n:start + n + gamma]
                    if follow:
                        return follow
        return []

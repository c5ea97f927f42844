"""Prompt-lookup (n-gram) drafter: no weights, copies what followed the latest n-gram match.

The fallback when no EAGLE-3 draft exists, the baseline it is compared with, and EAGLE-3's
partner in `tide.engine.drafters.hybrid`. Looks for the most recent earlier occurrence of the
sequence's last n tokens (n from `max_n` down to `min_n`) and proposes the tokens that followed it.

Each sequence keeps an index (`NgramIndex`) of where every n-gram of its tokens last ended, fed
the tokens committed since the previous step: a lookup costs a few dictionary probes however long
the context, where scanning the history cost up to ~1 ms a step at 1k tokens.
"""

from __future__ import annotations

from tide.engine.drafters.base import DraftAlgorithm, Proposal
from tide.engine.sequence import Sequence


class NgramIndex:
    """For n = 1..max_n, the end of the latest occurrence of every n-gram of a growing token list
    that has a token after it (end e: tokens[e - n:e] is the n-gram, tokens[e] follows it)."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self._reset()

    def _reset(self) -> None:
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.max_n + 1)]
        self._indexed = 0  # every end below this has been indexed

    def update(self, tokens: list[int]) -> None:
        if len(tokens) < self._indexed:  # not the list it indexed (it only ever grows): start over
            self._reset()
        for e in range(max(self._indexed, 1), len(tokens)):
            for n in range(1, min(self.max_n, e) + 1):
                self._ends[n][tuple(tokens[e - n:e])] = e
        self._indexed = max(self._indexed, len(tokens))

    def find(self, tokens: list[int], min_n: int) -> tuple[int, int]:
        """(n, end): the longest suffix of `tokens` (max_n down to min_n tokens) seen before, and
        where its latest earlier occurrence ended; (0, -1) when none was."""
        self.update(tokens)
        n_tokens = len(tokens)
        for n in range(min(self.max_n, n_tokens - 1), min_n - 1, -1):
            end = self._ends[n].get(tuple(tokens[n_tokens - n:]))
            if end is not None:
                return n, end
        return 0, -1

    def lookup(self, tokens: list[int], gamma: int, min_n: int) -> list[int]:
        """Up to `gamma` tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (max_n down to min_n tokens) seen before; [] when none was."""
        n, end = self.find(tokens, min_n)
        return tokens[end:end + gamma] if n else []


class NgramDrafter:
    algorithm = DraftAlgorithm.NGRAM
    version = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n
        self._index: dict[str, NgramIndex] = {}

    def add_sequence(self, seq: Sequence) -> None:
        self._index[seq.request_id] = NgramIndex(self.max_n)

    def remove_sequence(self, seq: Sequence) -> None:
        self._index.pop(seq.request_id, None)

    def lag(self, seq: Sequence) -> int:
        return 0

    def propose(self, seqs: list[Sequence], gammas: list[int], features=None, generators=None) -> Proposal:
        return Proposal(tokens=[self.lookup(s, g) for s, g in zip(seqs, gammas, strict=True)],
                        probs=[None] * len(seqs))

    def lookup(self, seq: Sequence, gamma: int) -> list[int]:
        return self._of(seq).lookup(seq.token_ids, gamma, self.min_n)

    def copy_match(self, seq: Sequence) -> int:
        """How many tokens of the sequence's suffix the copy it would propose now matched (0: none):
        its strength, which the γ policy learns apart (1-token matches are accepted far less)."""
        return self._of(seq).find(seq.token_ids, self.min_n)[0]

    def _of(self, seq: Sequence) -> NgramIndex:
        index = self._index.get(seq.request_id)
        if index is None:  # proposing for a sequence it was not told about (a drafter used bare)
            index = self._index[seq.request_id] = NgramIndex(self.max_n)
        return index

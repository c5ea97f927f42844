"""The drafter interface the engine talks to, and the typed proposal it gets back."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from tide.engine.features import FeatureStore
from tide.engine.sequence import Sequence
from tide.engine.tree import DraftTree
from tide.policies import TreeShape


class DraftAlgorithm(enum.Enum):
    NONE = "none"
    NGRAM = "ngram"
    EAGLE3 = "eagle3"
    MEMORY = "memory"  # a source of the hybrid drafter (its speculation memory), never a drafter alone

    def is_none(self) -> bool:
        return self is DraftAlgorithm.NONE

    def is_ngram(self) -> bool:
        return self is DraftAlgorithm.NGRAM

    def is_eagle3(self) -> bool:
        return self is DraftAlgorithm.EAGLE3

    def needs_target_features(self) -> bool:
        """EAGLE-3 drafts from the target's hidden states; the engine must capture them."""
        return self is DraftAlgorithm.EAGLE3


@dataclass
class Proposal:
    """Draft tokens per sequence (target-vocabulary ids), in the order the engine asked.

    `probs[i]` is the proposal distribution q over the target vocabulary, one row per draft token
    [len(tokens[i]), V], or None when the proposal is deterministic (one-hot at the token).
    """

    tokens: list[list[int]]
    probs: list[torch.Tensor | None]


class Drafter(Protocol):
    algorithm: DraftAlgorithm
    version: str  # draft version id ("" for weightless drafters)

    def add_sequence(self, seq: Sequence) -> None:
        """A sequence got a KV slot; allocate per-sequence state."""

    def remove_sequence(self, seq: Sequence) -> None:
        """The sequence finished or was cancelled; drop its state."""

    def lag(self, seq: Sequence) -> int:
        """Committed tokens the draft has not yet consumed (its catch-up work at the next draft)."""

    def propose(
        self,
        seqs: list[Sequence],
        gammas: list[int],
        features: FeatureStore | None,
        generators: list[torch.Generator | None],
    ) -> Proposal:
        """Draft up to gammas[i] >= 1 tokens after each sequence's last token (fewer is allowed).

        `features` holds the target's aux states of every cached token (EAGLE-3 only);
        `generators[i]` is the sequence's RNG for sampled proposals (None for greedy requests).
        """


def draft_source(drafter: Drafter, seq: Sequence) -> str:
    """Which source of draft tokens `drafter` will use for `seq` this step, as the γ policy knows
    sources (RequestView.drafter): a drafter with several (the hybrid: "ngram" for a copy, "eagle3"
    for a draft chain) says per sequence through `source(seq)`; any other is its algorithm."""
    source = getattr(drafter, "source", None)
    return source(seq) if source is not None else drafter.algorithm.value


def copy_match(drafter: Drafter, seq: Sequence) -> int:
    """For a copying drafter (n-gram, hybrid), how many tokens the copy it would propose for `seq`
    now matched (RequestView.match); 0 for a draft model's chain or no copy."""
    match = getattr(drafter, "copy_match", None)
    return match(seq) if match is not None else 0


def proposal_limit(drafter: Drafter, seq: Sequence) -> int:
    """How many tokens the weightless proposal `drafter` has for `seq` this step, where it knows before
    drafting (the hybrid's recall from the speculation memory: RequestView.limit); else 0."""
    limit = getattr(drafter, "proposal_limit", None)
    return limit(seq) if limit is not None else 0


@runtime_checkable
class TreeDrafter(Protocol):
    """A drafter that also grows draft trees (EAGLE-2); the engine drafts chains with the others."""

    def propose_tree(
        self,
        seqs: list[Sequence],
        shapes: list[TreeShape],
        features: FeatureStore | None,
        generators: list[torch.Generator | None],
    ) -> list[DraftTree]:
        """One tree per sequence, rooted at its last token, grown as shapes[i] says (at most
        shapes[i].tokens draft nodes, none deeper than shapes[i].depth). Like `propose`, it
        consumes the sequences' new target features."""

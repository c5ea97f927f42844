"""Drafters propose tokens for the target to verify; each owns whatever runner it needs."""

from tide.engine.drafters.base import DraftAlgorithm, Drafter, Proposal, TreeDrafter
from tide.engine.drafters.ngram import NgramDrafter

__all__ = ["DraftAlgorithm", "Drafter", "NgramDrafter", "Proposal", "TreeDrafter"]

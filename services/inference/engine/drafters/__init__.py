"""Drafters propose tokens for the target to verify; each owns whatever runner it needs."""

from services.inference.engine.drafters.base import DraftAlgorithm, Drafter, Proposal
from services.inference.engine.drafters.ngram import NgramDrafter

__all__ = ["DraftAlgorithm", "Drafter", "NgramDrafter", "Proposal"]

"""What speculative decoding did for one request: the totals a worker reports with its final
response (`tide.v1.SpeculationStats`, the same field names) and the gateway sums over a response's
choices into the OpenAI-response extension `speculation`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tide.proto.tide.v1 import inference_pb2


@dataclass(frozen=True)
class SpeculationStats:
    """Totals over one request. verify_steps = decode steps that drafted (γ > 0), plain_steps = the
    others; accept_length = tokens emitted per verify step, bonus included (0 when none).
    `drafter` is the drafter's algorithm ("ngram", "eagle3"; "none" = the worker had no drafter)
    and `draft_version` its version ("" = none); summed over choices, each is the comma-joined
    distinct values."""

    accept_length: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    plain_steps: int = 0
    draft_version: str = ""
    drafter: str = "none"


_FIELDS = tuple(f.name for f in dataclasses.fields(SpeculationStats))


def stats_pb(s: SpeculationStats) -> inference_pb2.SpeculationStats:
    return inference_pb2.SpeculationStats(**dataclasses.asdict(s))


def stats_from_pb(s: inference_pb2.SpeculationStats) -> SpeculationStats:
    """Field by field, as sent (an unset string is "")."""
    return SpeculationStats(**{name: getattr(s, name) for name in _FIELDS})

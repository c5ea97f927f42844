"""The result of one training run, as the trainer reports it and the controller acts on it.

Mirrors tide.v1.TrainingOutcome (protos/tide/v1/trainer.proto); each service's server.py converts.
Accept lengths are the evaluator's *served* tokens per verification at the trainer's eval γ, bonus
token included; the base's is 1.0 (no draft: one token per step) when there was no base version.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainingOutcome:
    run_id: str
    target_model: str
    candidate_version: str = ""  # registered version ("" if the candidate was not registered)
    base_version: str = ""  # the version training started from ("" = from scratch)
    eval_accept_length_candidate: float = 0.0
    eval_accept_length_base: float = 0.0
    promoted: bool = False
    detail: str = ""  # why it was (not) promoted, or why the run failed
    train_tokens: int = 0
    eval_tokens: int = 0
    duration_s: float = 0.0
    finished_unix_s: float = 0.0  # wall clock, seconds since the epoch

"""The policy interface the engine calls every step, and the simplest policy (fixed γ)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class RequestView:
    """What a policy may know about one running request when it decides.

    `recent_accepted` holds the accepted draft-token counts (bonus excluded) of the request's
    last verification steps, newest last, each with the γ it was drafted at in `recent_gammas`.
    `lag` is how many tokens the draft model has not yet seen target features for: the catch-up
    work (Nightjar's switching cost) a γ > 0 decision pays this step.
    """

    request_id: str
    recent_gammas: tuple[int, ...] = ()
    recent_accepted: tuple[int, ...] = ()
    last_gamma: int = 0
    lag: int = 0
    context_len: int = 0
    drafter: str = "none"
    # For a copy (drafter "ngram"), how many tokens of the context's suffix matched earlier: its
    # strength (1-token matches are accepted far less than 3-token ones); 0 otherwise.
    match: int = 0


@dataclass(frozen=True)
class StepContext:
    """The running batch the engine is about to draft and verify."""

    batch_size: int
    requests: tuple[RequestView, ...]
    step: int = 0
    max_gamma: int = 8


@dataclass(frozen=True)
class StepFeedback:
    """What happened in the step a decision was made for; times in milliseconds."""

    batch_size: int
    gammas: tuple[int, ...]
    accepted: tuple[int, ...]
    step_ms: float
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    # Optional, per request: how many of its accepted draft tokens were already in its token
    # cache (prompt + earlier output) before this step; () when the engine does not track it.
    # Used by the cache-FSM policy (seed 004 §4.2, Method 3).
    cache_hits: tuple[int, ...] = ()

    @property
    def emitted_tokens(self) -> int:
        return sum(a + 1 for a in self.accepted)


@runtime_checkable
class GammaPolicy(Protocol):
    """Chooses γ per request for a step and learns from the step's outcome."""

    name: str

    def decide(self, ctx: StepContext) -> list[int]:
        """Return one γ ≥ 0 per request in `ctx.requests`, in order (each ≤ ctx.max_gamma)."""
        ...

    def observe(self, feedback: StepFeedback) -> None:
        """Called after every step with what the decided γs produced."""
        ...


@runtime_checkable
class DraftAware(Protocol):
    """A policy whose acceptance estimates belong to the draft model that produced them: the engine
    tells it when a hot swap replaces that draft (`Engine.swap_drafter`). Latency estimates are
    the engine's and stay; acceptance learnt of the old draft does not describe the new one."""

    def draft_changed(self) -> None:
        """A different draft proposes from the next step on."""
        ...


@dataclass(frozen=True)
class Estimate:
    """One of a policy's online estimates, as the worker exports it (`Introspectable`).

    `scope` says what the value is per: "" for the whole worker, else comma-separated key=value
    pairs such as "batch=2" (a batch bucket), "batch=2,tokens=3" or "depth=1"."""

    name: str
    value: float
    scope: str = ""


@runtime_checkable
class Introspectable(Protocol):
    """A policy whose decisions rest on online estimates (acceptance, latency corrections) that an
    operator should be able to see: the worker exports them as `tide_inference_policy_estimate`.
    Without them, why a policy stopped speculating can only be inferred from its effects."""

    def estimates(self) -> list[Estimate]:
        """The current estimates; cheap (called about once a second from the engine's thread)."""
        ...


class FixedGamma:
    """Static γ for every request and batch size; γ = 0 is plain decoding."""

    def __init__(self, gamma: int) -> None:
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        self.gamma = gamma
        self.name = f"static-{gamma}"

    def decide(self, ctx: StepContext) -> list[int]:
        g = min(self.gamma, ctx.max_gamma)
        return [g] * len(ctx.requests)

    def observe(self, feedback: StepFeedback) -> None:
        return None

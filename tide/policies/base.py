"""The policy interface the engine calls every step, and the simplest policy (fixed γ)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class TreeShape:
    """A draft tree to grow for a request this step (EAGLE-2, tide.engine.tree): `depth` levels,
    the `topk` most probable children of each of the `topk` most probable frontier nodes per
    level, of which the `tokens` most probable (by cumulative draft log-probability) are verified.
    Verification costs a forward of `tokens` + 1 rows; at most `depth` drafts are accepted.
    A chain of γ drafts is TreeShape(γ, 1, γ)."""

    depth: int
    topk: int
    tokens: int

    def __post_init__(self) -> None:
        if self.depth < 1 or self.topk < 1 or self.tokens < 1:
            raise ValueError(f"a tree needs depth, topk and tokens >= 1, got {self}")

    @property
    def drafted(self) -> int:
        """Nodes the draft scores before keeping the best `tokens` (topk + (depth - 1) topk²)."""
        return self.topk + (self.depth - 1) * self.topk * self.topk

    def key(self) -> str:
        """"d{depth}k{topk}n{tokens}": how telemetry and benchmarks name the shape."""
        return f"d{self.depth}k{self.topk}n{self.tokens}"


# What a policy decides per request: a chain of γ drafts (γ = 0: no speculation) or a tree.
Action = int | TreeShape


def action_depth(action: Action) -> int:
    """Most draft tokens the action can accept: γ for a chain, the depth for a tree."""
    return action.depth if isinstance(action, TreeShape) else int(action)


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
    # For a weightless proposal whose length the drafter knows before drafting (a recall from the
    # speculation memory: the continuation it remembers), that length; 0: not known. Such a request
    # may draft up to StepContext.max_recall_gamma instead of max_gamma, and never more than this.
    limit: int = 0


@dataclass(frozen=True)
class StepContext:
    """The running batch the engine is about to draft and verify."""

    batch_size: int
    requests: tuple[RequestView, ...]
    step: int = 0
    max_gamma: int = 8
    # The cap for requests with a known proposal length (RequestView.limit), whose drafts cost no
    # forward: a long recall verifies many rows in one step (0: max_gamma for them too).
    max_recall_gamma: int = 0
    # Whether the drafter grows draft trees (a TreeShape is drafted as asked, else as a chain of its
    # depth): a policy prices trees only where they can run.
    trees: bool = False


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
    # Optional, per request: the tree it drafted (gammas[i] is then its depth, the most drafts it
    # could accept), None for a chain or no speculation; () when no request drafted a tree.
    shapes: tuple[TreeShape | None, ...] = ()

    @property
    def emitted_tokens(self) -> int:
        return sum(a + 1 for a in self.accepted)


@runtime_checkable
class GammaPolicy(Protocol):
    """Chooses γ per request for a step and learns from the step's outcome."""

    name: str

    def decide(self, ctx: StepContext) -> list[Action]:
        """Return one action per request in `ctx.requests`, in order: γ ≥ 0 (each ≤ ctx.max_gamma)
        or a TreeShape (depth ≤ ctx.max_gamma; the engine drafts a chain of γ = depth where the
        drafter or the request cannot take a tree)."""
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


class FixedTree:
    """The same draft tree for every request and batch size (tests, benchmarks)."""

    def __init__(self, depth: int, topk: int, tokens: int) -> None:
        self.shape = TreeShape(depth, topk, tokens)
        self.name = f"tree-{self.shape.key()}"

    def decide(self, ctx: StepContext) -> list[Action]:
        shape = self.shape
        if shape.depth > ctx.max_gamma:
            shape = TreeShape(ctx.max_gamma, shape.topk, shape.tokens) if ctx.max_gamma > 0 else None
        return [shape if shape is not None else 0] * len(ctx.requests)

    def observe(self, feedback: StepFeedback) -> None:
        return None

"""How this worker applies control-plane decisions: policy and drafter construction, the scheduled
policy, outcomes and the worker's status.

The decision types (`Decision`, `SpeculationSchedule`, `PolicySpec`) and their protobuf forms are
the library's (`tide.decisions`). Decisions are applied by the worker between engine steps (see
`worker.Worker.apply_decision`).
"""

from __future__ import annotations

import enum
import json
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tide.decisions import DecisionError, PolicySpec, SpeculationSchedule
from tide.engine.drafters import Drafter, NgramDrafter
from tide.policies import DraftAware, Estimate, GammaPolicy, Introspectable, StepContext, StepFeedback
from tide.policies.profile import LatencyProfile
from tide.policies.registry import POLICY_NAMES, make_policy


class Outcome(enum.Enum):
    APPLIED = "applied"
    ALREADY_APPLIED = "already_applied"
    REJECTED = "rejected"


@dataclass(frozen=True)
class WorkerStatus:
    """A snapshot of the worker. load = (running + waiting) / max_batch; kv_cache_usage in [0, 1]."""

    worker_id: str
    model_id: str
    engine: str
    device: str
    running_requests: int
    waiting_requests: int
    max_batch_size: int
    load: float
    kv_cache_usage: float
    draft_version: str
    drafter: str
    policy: PolicySpec
    speculation: SpeculationSchedule
    collection_enabled: bool
    last_decision_id: str
    uptime_s: float


@dataclass(frozen=True)
class WorkerMemory:
    """Bytes: the process's resident set (0 where unknown), the target's weights, its KV cache (and
    the part of it written so far, which is what the process holds of it: tide.allocator.zeros_on_demand),
    the draft in service beyond what it shares with the target, and the speculation memory's bytes,
    budget and tokens (0: no memory)."""

    rss_bytes: int
    weights_bytes: int
    kv_cache_bytes: int
    draft_bytes: int
    speculation_memory_bytes: int = 0
    speculation_memory_budget_bytes: int = 0
    speculation_memory_tokens: int = 0
    kv_cache_resident_bytes: int = 0


@dataclass(frozen=True)
class DecisionResult:
    outcome: Outcome
    detail: str
    status: WorkerStatus


def _param(value: Any) -> Any:
    """Proto params are doubles; integral values become ints (γ, window sizes, seeds)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DecisionError(f"parameter value {value} is not finite")
        if value.is_integer():
            return int(value)
    return value


def build_policy(spec: PolicySpec, profile: LatencyProfile | None = None) -> GammaPolicy:
    """A fresh policy from `spec`. `table_json` is a JSON object: its key "profile" (optional) is a
    LatencyProfile (`LatencyProfile.to_dict()` shape) used instead of the worker's `profile`; every
    other key is a structured keyword argument of the policy (e.g. vLLM's per-batch-size table).
    The scalar param `reprofile` = 1 first re-measures the worker's profile (a
    `tide.engine.profiling.LiveProfile`) in place; it is not passed to the policy."""
    if spec.name not in POLICY_NAMES:
        raise DecisionError(f"unknown gamma policy {spec.name!r}; known: {', '.join(POLICY_NAMES)}")
    params = {str(k): _param(v) for k, v in spec.params.items()}
    if params.pop("reprofile", 0):  # re-measure the worker's profile in place (blocks this step)
        if not hasattr(profile, "refresh"):
            raise DecisionError("reprofile: this worker has no measured latency profile "
                                "(start it with TIDE_PROFILE_AT_START=1)")
        profile.refresh()
    if spec.table_json:
        try:
            table = json.loads(spec.table_json)
        except json.JSONDecodeError as e:
            raise DecisionError(f"table_json is not JSON: {e}") from None
        if not isinstance(table, dict):
            raise DecisionError("table_json must be a JSON object")
        if "profile" in table:
            try:
                profile = LatencyProfile.from_dict(table.pop("profile"))
            except (AttributeError, KeyError, TypeError, ValueError) as e:
                raise DecisionError(f"table_json.profile is not a latency profile: {e}") from None
        params.update(table)
    try:
        return make_policy(spec.name, params, profile)
    except ValueError as e:
        if "LatencyProfile" in str(e):
            raise DecisionError(f"policy {spec.name!r} needs a latency profile and this worker has none; "
                                'send one in table_json as {"profile": {...}}') from None
        raise DecisionError(f"policy {spec.name!r}: {e}") from None
    except TypeError as e:
        raise DecisionError(f"policy {spec.name!r}: bad parameters: {e}") from None


class ScheduledPolicy:
    """The γ policy the engine runs: `inner` where the schedule enables speculation for the current
    running-batch size, γ = 0 elsewhere. `inner` observes only the steps it decided. (A request's
    own `speculative` flag overrides both in the engine: `tide.engine.engine.LLMEngine`.)"""

    def __init__(self, inner: GammaPolicy, schedule: SpeculationSchedule) -> None:
        self.inner, self.schedule = inner, schedule
        self.name = inner.name
        self._decided = False

    def decide(self, ctx: StepContext) -> list[int]:
        self._decided = self.schedule.enabled(ctx.batch_size)
        return list(self.inner.decide(ctx)) if self._decided else [0] * len(ctx.requests)

    def observe(self, feedback: StepFeedback) -> None:
        if self._decided:
            self.inner.observe(feedback)
        self._decided = False

    def draft_changed(self) -> None:
        if isinstance(self.inner, DraftAware):
            self.inner.draft_changed()

    def estimates(self) -> list[Estimate]:
        return self.inner.estimates() if isinstance(self.inner, Introspectable) else []


DrafterFactory = Callable[[str], Drafter | None]


def make_drafter(name: str, eagle3: Callable[[], Drafter | None] | None = None) -> Drafter | None:
    """The drafters this worker can build by name; raises DecisionError for others.

    "eagle3" is the registry's current draft for the target: `eagle3()` returns it (the worker's
    `services.inference.drafts.DraftWatcher.drafter`: the latest loaded draft, n-gram until one
    is); without `eagle3` the worker does not watch the registry and "eagle3" is refused.
    """
    if name == "none":
        return None
    if name == "ngram":
        return NgramDrafter()
    if name == "eagle3":
        if eagle3 is None:
            raise DecisionError("drafter 'eagle3' is not available on this worker (it does not watch the "
                                "draft registry); use 'ngram' or 'none'")
        return eagle3()
    raise DecisionError(f"unknown drafter {name!r}; known: eagle3, ngram, none")


class SeenIds:
    """Bounded memory of applied decision ids (oldest forgotten first)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, decision_id: str) -> bool:
        return decision_id in self._ids

    def add(self, decision_id: str) -> None:
        self._ids[decision_id] = None
        self._ids.move_to_end(decision_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

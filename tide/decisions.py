"""Control-plane decisions: what the controller pushes and a worker applies, and their tide.v1 forms.

One decision sets, for one target model, any of: speculation on/off per running-batch size (a
`SpeculationSchedule` of `SpeculationBucket`s), the γ policy (`PolicySpec`), hidden-state collection
and the drafter. A part left None leaves that part of a worker's configuration unchanged, as
`tide.v1.Decision` has it (unset optional / message fields). The controller decides *what* to send
(services/controller/decisions.py); the worker decides *how* to apply it (services/inference).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tide.proto.tide.v1 import inference_pb2


class DecisionError(ValueError):
    """A decision (or a part of it) is invalid or cannot be applied; the message says why."""


@dataclass(frozen=True)
class SpeculationBucket:
    """Speculation on/off for running-batch sizes in [min_batch, max_batch]; max_batch 0 = unbounded."""

    min_batch: int
    max_batch: int
    enabled: bool

    def covers(self, batch: int) -> bool:
        return batch >= self.min_batch and (self.max_batch == 0 or batch <= self.max_batch)


@dataclass(frozen=True)
class SpeculationSchedule:
    """Batch-size buckets; batch sizes no bucket covers run without speculation. Buckets may not
    overlap (raises DecisionError); their order is kept as given."""

    buckets: tuple[SpeculationBucket, ...] = (SpeculationBucket(1, 0, True),)

    def __post_init__(self) -> None:
        for b in self.buckets:
            if b.min_batch < 0 or b.max_batch < 0:
                raise DecisionError(f"bucket [{b.min_batch}, {b.max_batch}]: batch sizes must be >= 0")
            if b.max_batch and b.max_batch < b.min_batch:
                raise DecisionError(f"bucket [{b.min_batch}, {b.max_batch}]: max_batch < min_batch")
        ordered = sorted(self.buckets, key=lambda b: b.min_batch)
        for lo, hi in zip(ordered, ordered[1:], strict=False):
            if lo.max_batch == 0 or hi.min_batch <= lo.max_batch:
                raise DecisionError(f"buckets [{lo.min_batch}, {lo.max_batch or 'inf'}] and "
                                    f"[{hi.min_batch}, {hi.max_batch or 'inf'}] overlap")

    def enabled(self, batch: int) -> bool:
        return any(b.enabled and b.covers(batch) for b in self.buckets)


@dataclass(frozen=True)
class PolicySpec:
    """A γ policy by name (tide.policies.registry): scalar `params` and structured `table_json` (a
    JSON object; see services.inference.control.build_policy)."""

    name: str
    params: Mapping[str, float] = field(default_factory=dict)
    table_json: str = ""


@dataclass(frozen=True)
class Decision:
    """One decision for one target (`target_model` "" = whatever the worker serves); None = leave unchanged."""

    decision_id: str
    target_model: str = ""
    speculation: SpeculationSchedule | None = None
    policy: PolicySpec | None = None
    collection_enabled: bool | None = None
    drafter: str | None = None
    reason: str = ""
    issued_unix_s: float = 0.0


# ------------------------------------------------------------------------------------ protobuf


def schedule_pb(s: SpeculationSchedule) -> inference_pb2.SpeculationSchedule:
    return inference_pb2.SpeculationSchedule(buckets=[
        inference_pb2.SpeculationBucket(min_batch=b.min_batch, max_batch=b.max_batch, enabled=b.enabled)
        for b in s.buckets])


def schedule_from_pb(s: inference_pb2.SpeculationSchedule) -> SpeculationSchedule:
    """Raises DecisionError for an invalid schedule."""
    return SpeculationSchedule(tuple(SpeculationBucket(b.min_batch, b.max_batch, b.enabled) for b in s.buckets))


def policy_pb(p: PolicySpec) -> inference_pb2.GammaPolicy:
    return inference_pb2.GammaPolicy(name=p.name, params=dict(p.params), table_json=p.table_json)


def policy_from_pb(p: inference_pb2.GammaPolicy) -> PolicySpec:
    return PolicySpec(p.name, dict(p.params), p.table_json)


def decision_pb(d: Decision) -> inference_pb2.Decision:
    """The protobuf form: parts that are None stay unset."""
    out = inference_pb2.Decision(decision_id=d.decision_id, target_model=d.target_model, reason=d.reason,
                                 issued_unix_s=d.issued_unix_s)
    if d.speculation is not None:
        out.speculation.SetInParent()  # set even with no buckets: speculation off at every batch size
        out.speculation.MergeFrom(schedule_pb(d.speculation))
    if d.policy is not None:
        out.gamma_policy.CopyFrom(policy_pb(d.policy))
    if d.collection_enabled is not None:
        out.collection_enabled = d.collection_enabled
    if d.drafter is not None:
        out.drafter = d.drafter
    return out


def decision_from_pb(d: inference_pb2.Decision) -> Decision:
    """The domain form: unset parts are None. Raises DecisionError for an invalid schedule."""
    return Decision(
        decision_id=d.decision_id, target_model=d.target_model,
        speculation=schedule_from_pb(d.speculation) if d.HasField("speculation") else None,
        policy=policy_from_pb(d.gamma_policy) if d.HasField("gamma_policy") else None,
        collection_enabled=d.collection_enabled if d.HasField("collection_enabled") else None,
        drafter=d.drafter if d.HasField("drafter") else None,
        reason=d.reason, issued_unix_s=d.issued_unix_s)

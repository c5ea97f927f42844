"""Control-plane decisions as the controller makes them, and the log of where they went. No gRPC.

For now the controller pushes one *static* decision, configured as JSON (`TIDE_CONTROLLER_DECISION`):

    {"speculation": true | false | [{"min_batch": 1, "max_batch": 4, "enabled": true}, ...],
     "gamma_policy": {"name": "static", "params": {"gamma": 3}, "table_json": {...}} | null,
     "collection_enabled": true | false | null,
     "drafter": "ngram" | "none" | "eagle3" | null,
     "reason": "why"}

Every key is optional; null / absent leaves that part of a worker's configuration unchanged (as
tide.v1.Decision has it). `speculation: true` = one bucket [1, inf) on; false = off at every batch.
The decision types themselves (and their protobuf forms) are the library's, `tide.decisions`.
`StaticDecision.decision_id` is deterministic (`static-<hash of content and target>`).

What the controller pushes is the static content plus its own `collection_enabled` (collection.py),
issued by `DecisionIssuer`: a new decision, with a fresh id, each time that content changes for a
target. Workers remember every id they applied (and answer ALREADY_APPLIED to one they saw, whatever
it carries), so an id is never reused: `ctl-<process nonce>-<target hash>-<sequence>`, the nonce
drawn at start-up (a restarted controller re-pushes its decisions once, under new ids), and a toggle
back to an earlier content gets a new sequence number.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from tide.decisions import Decision, PolicySpec, SpeculationBucket, SpeculationSchedule
from tide.policies.registry import POLICY_NAMES

DRAFTERS = ("ngram", "none", "eagle3")
# Speculation allowed at every batch size; each worker keeps its own γ policy (TIDE_POLICY, adaptive).
DEFAULT_DECISION_JSON = '{"speculation": true}'


@dataclass(frozen=True)
class StaticDecision:
    """The configured decision, validated; `for_target` makes the Decision pushed for a target."""

    speculation: tuple[SpeculationBucket, ...] | None = (SpeculationBucket(1, 0, True),)  # sorted, valid
    policy: PolicySpec | None = None  # None: each worker keeps its own γ policy
    collection_enabled: bool | None = None
    drafter: str | None = None
    reason: str = "static decision (TIDE_CONTROLLER_DECISION)"

    @classmethod
    def from_json(cls, text: str) -> StaticDecision:
        """Parse and validate; raises ValueError naming the problem."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"decision is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("decision must be a JSON object")
        unknown = set(raw) - {"speculation", "gamma_policy", "collection_enabled", "drafter", "reason"}
        if unknown:
            raise ValueError(f"unknown decision keys {sorted(unknown)}")
        collection, drafter = raw.get("collection_enabled"), raw.get("drafter")
        if collection is not None and not isinstance(collection, bool):
            raise ValueError("collection_enabled must be true, false or null")
        if drafter is not None and drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS} or null, got {drafter!r}")
        return cls(speculation=_buckets(raw.get("speculation")), policy=_policy(raw.get("gamma_policy")),
                   collection_enabled=collection, drafter=drafter,
                   reason=str(raw.get("reason") or cls.reason))

    def to_dict(self) -> dict[str, Any]:
        """Canonical JSON form (what the decision id hashes)."""
        return {
            "speculation": None if self.speculation is None else [
                {"min_batch": b.min_batch, "max_batch": b.max_batch, "enabled": b.enabled} for b in self.speculation],
            "gamma_policy": None if self.policy is None else {
                "name": self.policy.name, "params": dict(self.policy.params), "table_json": self.policy.table_json},
            "collection_enabled": self.collection_enabled, "drafter": self.drafter, "reason": self.reason,
        }

    def decision_id(self, target_model: str) -> str:
        blob = json.dumps({"target": target_model, **self.to_dict()}, sort_keys=True, separators=(",", ":"))
        return "static-" + hashlib.sha256(blob.encode()).hexdigest()[:16]

    def for_target(self, target_model: str, now: float | None = None) -> Decision:
        return self.decision(self.decision_id(target_model), target_model, self.collection_enabled, self.reason, now)

    def decision(self, decision_id: str, target_model: str, collection_enabled: bool | None, reason: str,
                 now: float | None = None) -> Decision:
        """This content as the Decision `decision_id`, with the given collection flag and reason."""
        schedule = None if self.speculation is None else SpeculationSchedule(self.speculation)
        return Decision(decision_id, target_model, schedule, self.policy, collection_enabled, self.drafter, reason,
                        time.time() if now is None else now)


class DecisionIssuer:
    """The current decision per target: the static content + the controller's collection flag.
    Thread-safe; `issue` returns the decision in force, a new one only when the content changed."""

    def __init__(self, static: StaticDecision, nonce: str | None = None) -> None:
        self.static = static
        self.nonce = nonce or f"{int(time.time()):x}{secrets.token_hex(3)}"
        self._current: dict[str, Decision] = {}
        self._seq: dict[str, int] = {}
        self._lock = threading.Lock()

    def current(self, target_model: str) -> Decision | None:
        with self._lock:
            return self._current.get(target_model)

    def issue(self, target_model: str, collection_enabled: bool | None, why: str,
              now: float | None = None) -> tuple[Decision, bool]:
        """(the decision for the target, whether it is new)."""
        with self._lock:
            cur = self._current.get(target_model)
            if cur is not None and cur.collection_enabled == collection_enabled:
                return cur, False
            seq = self._seq[target_model] = self._seq.get(target_model, 0) + 1
            digest = hashlib.sha256(target_model.encode()).hexdigest()[:8]
            s = self.static
            state = "left to the workers" if collection_enabled is None else ("on" if collection_enabled else "off")
            d = s.decision(f"ctl-{self.nonce}-{digest}-{seq}", target_model, collection_enabled,
                           f"{s.reason}; collection {state}: {why}", now)
            self._current[target_model] = d
            return d, True


def _buckets(value: Any) -> tuple[SpeculationBucket, ...] | None:
    """The buckets, sorted; ranges and overlaps are checked by `SpeculationSchedule`."""
    if value is None:
        return None
    if isinstance(value, bool):
        return (SpeculationBucket(1, 0, value),)
    if not isinstance(value, list):
        raise ValueError("speculation must be true, false, null or a list of buckets")
    out = []
    for b in value:
        if not isinstance(b, dict) or not isinstance(b.get("enabled"), bool):
            raise ValueError(f"bucket {b!r}: need an object with min_batch, max_batch and enabled (bool)")
        lo, hi = b.get("min_batch", 1), b.get("max_batch", 0)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (lo, hi)):
            raise ValueError(f"bucket {b!r}: min_batch and max_batch must be integers >= 0")
        out.append(SpeculationBucket(lo, hi, b["enabled"]))
    return SpeculationSchedule(tuple(sorted(out, key=lambda b: b.min_batch))).buckets  # DecisionError: a ValueError


def _policy(value: Any) -> PolicySpec | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError("gamma_policy must be null or an object with a name")
    if value["name"] not in POLICY_NAMES:
        raise ValueError(f"unknown gamma policy {value['name']!r}; known: {', '.join(POLICY_NAMES)}")
    params = value.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError("gamma_policy.params must be an object of numbers")
    for k, v in params.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"gamma_policy.params[{k!r}] must be a finite number")
    table = value.get("table_json") or ""
    if not isinstance(table, str):  # an object is accepted and stored as its JSON text
        table = json.dumps(table, sort_keys=True)
    return PolicySpec(value["name"], MappingProxyType({str(k): float(v) for k, v in params.items()}), table)


@dataclass
class DecisionRecord:
    decision: Decision
    applied_to: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class DecisionLog:
    """Recent decisions (newest last) with the workers that acknowledged / refused each one."""

    def __init__(self, capacity: int = 100) -> None:
        self.capacity = capacity
        self._records: OrderedDict[str, DecisionRecord] = OrderedDict()

    def _record(self, d: Decision) -> DecisionRecord:
        rec = self._records.get(d.decision_id)
        if rec is None:
            rec = self._records[d.decision_id] = DecisionRecord(d)
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)
        self._records.move_to_end(d.decision_id)
        return rec

    def applied(self, d: Decision, worker_id: str) -> None:
        rec = self._record(d)
        if worker_id not in rec.applied_to:
            rec.applied_to.append(worker_id)
        if worker_id in rec.failed:
            rec.failed.remove(worker_id)

    def failed(self, d: Decision, worker_id: str) -> None:
        rec = self._record(d)
        if worker_id not in rec.failed and worker_id not in rec.applied_to:
            rec.failed.append(worker_id)

    def recent(self, n: int, target_model: str = "") -> list[DecisionRecord]:
        """Up to `n` records, most recent first, optionally for one target."""
        recs = [r for r in reversed(self._records.values()) if not target_model or
                r.decision.target_model == target_model]
        return recs[:n]

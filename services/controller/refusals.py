"""Refused drafts: the registry's pointer must name what the fleet serves. Pure domain code: the
registry is reached through `RegistryPort` (rollback.py), the workers' reports come from the fleet.

A worker that cannot run the draft the registry assigns (checksum mismatch, a missing file, a draft
that does not fit the target, an unloadable checkpoint) refuses it and keeps serving the draft it
had (services/inference/drafts.py); its status reports the refusal, the version it serves and the
version the registry wants (fleet.WorkerRecord). Left alone, the registry would go on listing the
refused version as effective (`tidectl drafts list`) while the fleet serves another.

Every evaluation (each reconcile round), for each worker that reports a refusal of the version it
is told to run (its wanted version): the registry's pointer is read. The refused version is
effective (pinned, or current and nothing pinned) →

- rolled back to the version the fleet serves: the refusing worker's registry draft, or where it
  has none (it serves the fallback) the one most workers of the target serve; the registry's
  Rollback is conditional (`expected_current`), so a promotion made meanwhile wins. The Rollback
  reason starts with `REFUSAL_REASON_PREFIX` and names the worker, the version and the refusal
  (the pointer's history shows it; tidectl marks the version "refused").
- left when it is pinned: pinning is an operator's decision; the conflict is recorded.
- left when no worker of the target serves another registry version, or when the registry refuses
  the rollback (the version the fleet serves is not a previous one): recorded.

A refusal of a version that is not effective changes nothing (the worker has not heard the newer
pointer yet, or an operator moved on). Each refused version is acted on once per target (no
flapping: a version promoted again after its rollback is left to the operator); a registry that
does not answer is asked again next round. Each act is a `RefusalRecord` (GetState, logs, the
`tide_controller_draft_refusals{target,reason,outcome}` metric).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

from services.controller.fleet import DraftRefusal, WorkerRecord
from services.controller.rollback import RegistryPort, RegistryUnavailable, RollbackRefused

log = logging.getLogger(__name__)

# The Rollback reason of a refusal starts with this (tools/admin/render.py marks such versions "refused").
REFUSAL_REASON_PREFIX = "draft refused by a worker"
ROLLED_BACK, PINNED, NOTHING, REGISTRY_REFUSED = "rolled_back", "pinned", "nothing_to_roll_back_to", "registry_refused"
_DETAIL_MAX = 300  # of the worker's refusal detail, in the Rollback reason (the registry bounds reasons)


@dataclass(frozen=True)
class RefusalRecord:
    """What the controller did about a worker's refusal of the target's effective version."""

    target_model: str
    worker_id: str
    version: str  # the refused version
    reason: str  # the worker's: checksum | missing | incompatible | load_failed
    detail: str
    refused_unix_s: float
    outcome: str  # ROLLED_BACK | PINNED | NOTHING | REGISTRY_REFUSED
    to_version: str  # "" unless rolled back
    note: str  # the Rollback reason, or why the pointer was left
    time_unix_s: float


class RefusalResolver:
    """Thread-safe. `port` None = disabled (refusals are read, nothing is done about them)."""

    def __init__(self, port: RegistryPort | None, keep: int = 20) -> None:
        self.port, self.keep = port, keep
        self._records: dict[str, deque[RefusalRecord]] = {}
        self._counts: Counter[tuple[str, str, str]] = Counter()
        self._failures: Counter[str] = Counter()
        self._done: set[tuple[str, str]] = set()  # (target, version) acted on: never again
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.port is not None

    def records(self, target: str) -> list[RefusalRecord]:
        """Most recent first."""
        with self._lock:
            return list(reversed(self._records.get(target, ())))

    def counts(self) -> dict[tuple[str, str, str], int]:
        """Records per (target, refusal reason, outcome)."""
        with self._lock:
            return dict(self._counts)

    def failures(self) -> dict[str, int]:
        """Registry calls that failed (retried next round), per target."""
        with self._lock:
            return dict(self._failures)

    def evaluate(self, workers: Iterable[WorkerRecord], now: float) -> list[RefusalRecord]:
        """Act on the refusals the workers reported (see the module doc); returns the records made now."""
        if not self.enabled:
            return []
        workers = [w for w in workers if w.reachable and w.target_model]
        pending: dict[tuple[str, str], tuple[WorkerRecord, DraftRefusal]] = {}
        with self._lock:
            for w in workers:
                wanted = w.wanted_draft_version
                refusal = next((r for r in w.draft_refusals if r.version == wanted), None) if wanted else None
                if refusal is None or wanted == w.registry_draft_version:
                    continue
                key = (w.target_model, wanted)
                if key not in self._done:
                    pending.setdefault(key, (w, refusal))
        made = []
        for (target, _), (w, refusal) in pending.items():
            record = self._resolve(target, w, refusal, workers, now)
            if record is not None:
                made.append(record)
        return made

    def _fleet_version(self, target: str, w: WorkerRecord, refused: str, workers: list[WorkerRecord]) -> str:
        """The registry version the fleet serves: the refusing worker's, else the most served one."""
        if w.registry_draft_version and w.registry_draft_version != refused:
            return w.registry_draft_version
        served = Counter(o.registry_draft_version for o in workers
                         if o.target_model == target and o.registry_draft_version not in ("", refused))
        return min(served, key=lambda v: (-served[v], v)) if served else ""

    def _resolve(self, target: str, w: WorkerRecord, r: DraftRefusal, workers: list[WorkerRecord],
                 now: float) -> RefusalRecord | None:
        who = w.worker_id or w.address
        try:
            current, pinned = self.port.pointer(target)
        except (RegistryUnavailable, RollbackRefused) as e:
            return self._failed(target, r.version, f"reading the pointer: {e}")
        if (pinned or current) != r.version:  # not (or no longer) effective: nothing to put right
            return None
        serving = self._fleet_version(target, w, r.version, workers)
        detail = r.detail if len(r.detail) <= _DETAIL_MAX else r.detail[:_DETAIL_MAX] + "..."
        refusal = f"{who} refused {r.version} ({r.reason}: {detail})"
        if pinned == r.version:
            return self._record(target, who, r, PINNED, "", f"{refusal}; {r.version} is pinned, the pointer is left "
                                f"as it is (the worker serves {serving or 'no registry draft'}): unpin or pin "
                                "another version", now)
        if not serving:
            return self._record(target, who, r, NOTHING, "", f"{refusal}; no worker of {target} serves another "
                                "registry version to roll back to", now)
        reason = f"{REFUSAL_REASON_PREFIX}: {refusal}; back to {serving}, which the fleet serves"
        try:
            self.port.rollback(target, serving, reason, expected_current=r.version)
        except RegistryUnavailable as e:
            return self._failed(target, r.version, str(e))
        except RollbackRefused as e:
            return self._record(target, who, r, REGISTRY_REFUSED, "", f"{refusal}; the registry refused the "
                                f"rollback to {serving}: {e}", now)
        return self._record(target, who, r, ROLLED_BACK, serving, reason, now)

    def _failed(self, target: str, version: str, why: str) -> None:
        with self._lock:
            self._failures[target] += 1
        log.warning("registry call for %s's refused draft %s failed (%s); retrying next round", target, version, why)
        return None

    def _record(self, target: str, who: str, r: DraftRefusal, outcome: str, to_version: str, note: str,
                now: float) -> RefusalRecord:
        record = RefusalRecord(target, who, r.version, r.reason, r.detail, r.time_unix_s, outcome, to_version, note,
                               now)
        with self._lock:
            self._done.add((target, r.version))
            self._records.setdefault(target, deque(maxlen=self.keep)).append(record)
            self._counts[(target, r.reason, outcome)] += 1
        extra = {"target_model": target, "draft_version": r.version, "worker_id": who, "outcome": outcome}
        if outcome == ROLLED_BACK:
            log.warning("rolled back %s from %s to %s: %s", target, r.version, to_version, note, extra=extra)
        else:
            log.error("%s's effective draft %s was refused and the pointer is left (%s): %s", target, r.version,
                      outcome, note, extra=extra)
        return record

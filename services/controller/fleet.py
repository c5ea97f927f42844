"""The workers the controller knows and the reconciliation that brings each one to its decision.

No gRPC here: `WorkerClient` is the port (workers.py implements it over InferenceService).

Workers come from configuration (`TIDE_CONTROLLER_WORKERS`) and from RegisterWorker calls. Every
round (`reconcile`), for each worker: read its status; if it serves a target the controller has a
decision for and reports another `last_decision_id`, push the decision. A worker acknowledges a
decision (APPLIED, or ALREADY_APPLIED: it had it) or refuses it (REJECTED, recorded, not retried
for that worker process). Both are remembered per worker *incarnation*: when a worker restarts
(its uptime goes down or its worker id changes) or comes back after being unreachable, the
memory is cleared, so it gets the decision again. An unreachable worker is retried every round.
The status also says which registry draft the worker serves and which versions it refused: kept on
the worker's record for the controller's refusal check (refusals.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from services.controller.decisions import DecisionLog
from tide.decisions import Decision

log = logging.getLogger(__name__)


class WorkerUnreachable(Exception):
    """The worker did not answer (down, restarting, deadline exceeded)."""


@dataclass(frozen=True)
class DraftRefusal:
    """A registry draft version a worker will not run (it kept serving the one it had)."""

    version: str
    reason: str  # "checksum" | "missing" | "incompatible" | "load_failed"
    detail: str
    time_unix_s: float


@dataclass(frozen=True)
class WorkerSnapshot:
    worker_id: str
    model_id: str
    last_decision_id: str
    uptime_s: float
    # the registry's drafts on the worker: the version it serves as "eagle3" ("" = none), the target's
    # effective version as it last heard it ("" = none or not heard), the versions it refused
    registry_draft_version: str = ""
    wanted_draft_version: str = ""
    draft_refusals: tuple[DraftRefusal, ...] = ()


@dataclass(frozen=True)
class PushResult:
    outcome: str  # "applied" | "already_applied" | "rejected"
    detail: str


class WorkerClient(Protocol):
    def status(self, address: str) -> WorkerSnapshot: ...
    def apply(self, address: str, decision: Decision) -> PushResult: ...


@dataclass
class WorkerRecord:
    address: str
    worker_id: str = ""
    target_model: str = ""
    registered_unix_s: float = 0.0
    last_seen_unix_s: float = 0.0
    last_decision_id: str = ""
    configured: bool = False  # listed in the settings (kept even when unreachable)
    reachable: bool = False
    uptime_s: float = -1.0
    settled: str = ""  # decision id this incarnation acknowledged or refused (not pushed again)
    registry_draft_version: str = ""  # as in WorkerSnapshot, from the last status read
    wanted_draft_version: str = ""
    draft_refusals: tuple[DraftRefusal, ...] = ()


@dataclass
class PushCounts:
    applied: int = 0
    already_applied: int = 0
    rejected: int = 0
    failed: int = 0  # the call itself failed (retried next round)


class Fleet:
    """Thread-safe registry of workers + reconciliation. `decision_for(target)` returns the decision a
    worker of that target should have (None: nothing to push)."""

    def __init__(self, client: WorkerClient, decision_for: Callable[[str], Decision | None],
                 decisions: DecisionLog | None = None) -> None:
        self.client = client
        self.decision_for = decision_for
        self.decisions = decisions or DecisionLog()
        self.pushes = PushCounts()
        self._workers: dict[str, WorkerRecord] = {}
        self._lock = threading.RLock()

    def add(self, address: str, *, worker_id: str = "", target_model: str = "", configured: bool = False) -> None:
        """Add (or refresh) a worker. A registration means a (re)started worker: its memory is reset."""
        with self._lock:
            w = self._workers.get(address)
            if w is None:
                w = self._workers[address] = WorkerRecord(address, registered_unix_s=time.time())
            w.worker_id = worker_id or w.worker_id
            w.target_model = target_model or w.target_model
            w.configured = w.configured or configured
            if not configured:
                w.registered_unix_s = time.time()
                w.settled = ""

    def workers(self) -> list[WorkerRecord]:
        with self._lock:
            return [WorkerRecord(**vars(w)) for w in self._workers.values()]

    def reconcile(self) -> None:
        """One round over every known worker (calls are made outside the lock, one worker at a time)."""
        with self._lock:
            addresses = list(self._workers)
        for address in addresses:
            self._reconcile_one(address)

    def _reconcile_one(self, address: str) -> None:
        try:
            st = self.client.status(address)
        except WorkerUnreachable as e:
            with self._lock:
                w = self._workers[address]
                if w.reachable:
                    log.warning("worker %s (%s) unreachable: %s", w.worker_id or "?", address, e)
                w.reachable = False
                decision = self.decision_for(w.target_model) if w.target_model else None
                if decision is not None and w.last_decision_id != decision.decision_id:
                    self.decisions.failed(decision, w.worker_id or address)  # owed, not deliverable now
            return
        with self._lock:
            w = self._workers[address]
            restarted = (not w.reachable) or st.uptime_s < w.uptime_s or (w.worker_id and st.worker_id != w.worker_id)
            if restarted:
                w.settled = ""
            w.reachable, w.uptime_s, w.last_seen_unix_s = True, st.uptime_s, time.time()
            w.worker_id, w.target_model, w.last_decision_id = st.worker_id, st.model_id, st.last_decision_id
            w.registry_draft_version, w.wanted_draft_version = st.registry_draft_version, st.wanted_draft_version
            w.draft_refusals = st.draft_refusals
            decision = self.decision_for(st.model_id)
            if decision is None:
                return
            if st.last_decision_id == decision.decision_id:
                w.settled = decision.decision_id
                self.decisions.applied(decision, st.worker_id)
                return
            if w.settled == decision.decision_id:
                return
        self._push(address, st.worker_id, decision)

    def _push(self, address: str, worker_id: str, decision: Decision) -> None:
        try:
            result = self.client.apply(address, decision)
        except WorkerUnreachable as e:
            with self._lock:
                self.pushes.failed += 1
                self.decisions.failed(decision, worker_id)
            log.warning("push of %s to %s (%s) failed: %s; retrying next round", decision.decision_id, worker_id,
                        address, e)
            return
        with self._lock:
            w = self._workers[address]
            w.settled = decision.decision_id
            if result.outcome == "rejected":
                self.pushes.rejected += 1
                self.decisions.failed(decision, worker_id)
                log.error("worker %s (%s) rejected decision %s: %s", worker_id, address, decision.decision_id,
                          result.detail)
                return
            if result.outcome == "applied":
                self.pushes.applied += 1
                w.last_decision_id = decision.decision_id
            else:
                self.pushes.already_applied += 1
            self.decisions.applied(decision, worker_id)
        log.info("decision %s %s on worker %s (%s)", decision.decision_id, result.outcome, worker_id, address)

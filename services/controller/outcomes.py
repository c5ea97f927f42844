"""Training outcomes the trainer reports (ReportTrainingOutcome), kept per target. No gRPC.

Reports are idempotent by run id: a trainer that retries a report after a timeout is told the run
was already recorded. The controller acts on each new outcome (app.Controller.report_outcome):
collection off when training stopped helping (collection.py), a rollback watch after a promotion
(rollback.py); this log keeps the last one per target for GetState.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from tide.outcomes import TrainingOutcome


class OutcomeLog:
    """Thread-safe; remembers the last `capacity` run ids for idempotency."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._last: dict[str, TrainingOutcome] = {}
        self._lock = threading.Lock()

    def record(self, outcome: TrainingOutcome) -> bool:
        """False when this run id was recorded before (nothing changes); raises ValueError for an
        outcome without run id or target."""
        if not outcome.run_id or not outcome.target_model:
            raise ValueError("a training outcome needs run_id and target_model")
        with self._lock:
            if outcome.run_id in self._seen:
                return False
            self._seen[outcome.run_id] = None
            while len(self._seen) > self.capacity:
                self._seen.popitem(last=False)
            prev = self._last.get(outcome.target_model)
            if prev is None or outcome.finished_unix_s >= prev.finished_unix_s:
                self._last[outcome.target_model] = outcome
            return True

    def last(self, target_model: str) -> TrainingOutcome | None:
        with self._lock:
            return self._last.get(target_model)

    def targets(self) -> list[str]:
        with self._lock:
            return sorted(self._last)

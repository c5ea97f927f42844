"""Wiring: settings -> statistics, fleet, telemetry reader, reconcile loop -> gRPC server.

`build(settings)` returns a running `ControllerService`; `__main__` adds signals, logs and metrics.
The controller keeps serving (GetState, RegisterWorker) while Redis is down: the telemetry reader
retries with backoff (tide.streams.Consumer.run).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from services.controller.decisions import Decision, StaticDecision
from services.controller.fleet import Fleet, WorkerClient
from services.controller.outcomes import OutcomeLog
from services.controller.server import serve
from services.controller.settings import ControllerSettings
from services.controller.stats import FleetStats
from services.controller.telemetry import TelemetryReader
from services.controller.workers import GrpcWorkerClient
from tide import streams
from tide.grpcutil import GrpcServer

log = logging.getLogger(__name__)


@dataclass
class Controller:
    """The controller's state, without transport: statistics, workers, decisions, outcomes."""

    static: StaticDecision
    stats: FleetStats
    fleet: Fleet = field(init=False)
    outcomes: OutcomeLog = field(default_factory=OutcomeLog)
    client: WorkerClient | None = None

    def __post_init__(self) -> None:
        self._decisions: dict[str, Decision] = {}
        self._lock = threading.Lock()
        self.fleet = Fleet(self.client, self.decision_for)

    def decision_for(self, target_model: str) -> Decision | None:
        """The decision workers of `target_model` should have (issued once per target)."""
        if not target_model:
            return None
        with self._lock:
            if target_model not in self._decisions:
                self._decisions[target_model] = self.static.for_target(target_model)
            return self._decisions[target_model]

    def targets(self) -> list[str]:
        known = set(self.stats.targets()) | set(self.outcomes.targets())
        known |= {w.target_model for w in self.fleet.workers() if w.target_model}
        return sorted(known)


class Reconciler:
    """Runs `fleet.reconcile()` every `interval_s`, or at once after `wake()` (a registration)."""

    def __init__(self, fleet: Fleet, interval_s: float) -> None:
        self.fleet, self.interval_s = fleet, interval_s
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="reconciler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.fleet.reconcile()
            except Exception:  # a bug in one round must not end the loop
                log.exception("reconcile round failed")
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> Reconciler:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)


@dataclass
class ControllerService:
    settings: ControllerSettings
    controller: Controller
    reader: TelemetryReader
    reconciler: Reconciler
    server: GrpcServer

    @property
    def target(self) -> str:
        return self.server.target

    def stop(self, grace_s: float = 2.0) -> None:
        """NOT_SERVING, finish in-flight RPCs within `grace_s`, then stop the loops."""
        self.server.stop(grace_s)
        self.reconciler.stop()
        self.reader.stop()
        if isinstance(self.controller.client, GrpcWorkerClient):
            self.controller.client.close()


def build(settings: ControllerSettings, *, worker_client: WorkerClient | None = None) -> ControllerService:
    """Build and start everything (the gRPC server last: SERVING means the loops run)."""
    client = worker_client or GrpcWorkerClient(settings.admin_token, settings.rpc_timeout_s)
    controller = Controller(settings.decision, FleetStats(settings.ema_short, settings.ema_long,
                                                          settings.load_window_s), client=client)
    for address in settings.workers:
        controller.fleet.add(address, configured=True)
    rclient = settings.storage.redis_client(socket_connect_timeout=2.0, socket_timeout=5.0)
    reader = TelemetryReader(rclient, streams.StreamNames(settings.storage.stream_prefix), settings.consumer,
                             controller.stats, claim_idle_ms=settings.claim_idle_ms).start()
    reconciler = Reconciler(controller.fleet, settings.reconcile_s).start()
    server = serve(controller, reconciler.wake, settings.listen, settings.admin_token)
    log.info("controller serving on %s (workers configured: %s; decision: %s)", server.target,
             ", ".join(settings.workers) or "none", settings.decision.to_dict())
    return ControllerService(settings, controller, reader, reconciler, server)

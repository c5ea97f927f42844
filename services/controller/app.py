"""Wiring: settings -> statistics, fleet, telemetry reader, reconcile loop -> gRPC server.

`build(settings)` returns a running `ControllerService`; `__main__` adds signals, logs and metrics.
Every reconcile round first evaluates each target (rollback watch, collection control) and issues
a new decision where the collection flag changed; a training outcome does the same for its target
and wakes the loop, so the change is pushed at once.
The controller keeps serving (GetState, RegisterWorker) while Redis is down: the telemetry reader
retries with backoff (tide.streams.Consumer.run).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.controller.collection import CollectionConfig, CollectionControl, Signal
from services.controller.decisions import DecisionIssuer, StaticDecision
from services.controller.fleet import Fleet, WorkerClient
from services.controller.outcomes import OutcomeLog, TrainingOutcome
from services.controller.refusals import ROLLED_BACK, RefusalResolver
from services.controller.registry import GrpcRegistry
from services.controller.rollback import RollbackGuard
from services.controller.server import serve
from services.controller.settings import ControllerSettings
from services.controller.stats import FleetStats
from services.controller.telemetry import TelemetryReader
from services.controller.workers import GrpcWorkerClient
from tide import streams
from tide.decisions import Decision
from tide.grpcutil import GrpcServer
from tide.policies.costs import MIN_GAIN, StepCosts, find_profile, step_costs

log = logging.getLogger(__name__)


@dataclass
class Controller:
    """The controller's state, without transport: statistics, workers, decisions, outcomes, the
    collection control (collection.py), the rollback guard (rollback.py) and what is done about the
    workers' refusals of the registry's draft (refusals.py)."""

    static: StaticDecision
    stats: FleetStats
    fleet: Fleet = field(init=False)
    outcomes: OutcomeLog = field(default_factory=OutcomeLog)
    client: WorkerClient | None = None
    collection: CollectionControl = field(default_factory=CollectionControl)
    rollback: RollbackGuard = field(default_factory=lambda: RollbackGuard(None))
    refusals: RefusalResolver = field(default_factory=lambda: RefusalResolver(None))
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        self.issuer = DecisionIssuer(self.static)
        self._lock = threading.Lock()
        self.fleet = Fleet(self.client, self.decision_for)

    def decision_for(self, target_model: str) -> Decision | None:
        """The decision workers of `target_model` should have now."""
        if not target_model:
            return None
        return self.issuer.current(target_model) or self._refresh(target_model, self.clock())[0]

    def targets(self) -> list[str]:
        known = set(self.stats.targets()) | set(self.outcomes.targets())
        known |= {w.target_model for w in self.fleet.workers() if w.target_model}
        return sorted(known)

    def evaluate(self) -> bool:
        """One evaluation of every target (each reconcile round): the workers' draft refusals (as read in
        the last round), rollback watches, then collection. True when a target got a new decision."""
        for r in self.refusals.evaluate(self.fleet.workers(), self.clock()):  # may call the registry
            if r.outcome == ROLLED_BACK:
                self.rollback.refused(r.target_model, r.version, f"workers refused it: {r.note}")
        changed = False
        for target in self.targets():
            now = self.clock()
            drafts = {d.draft_version: d for d in self.stats.drafts(target)}
            self.rollback.evaluate(target, self.stats.serving_version(target), drafts, now)  # may call the registry
            changed |= self._refresh(target, now)[1]
        return changed

    def report_outcome(self, outcome: TrainingOutcome) -> bool:
        """Record a training outcome (False: its run id was reported before, nothing changes); a
        promotion starts a rollback watch, and the outcome counts for collection control."""
        if not self.outcomes.record(outcome):
            return False
        now, target = self.clock(), outcome.target_model
        if outcome.promoted:
            self.rollback.promoted(target, outcome.candidate_version, outcome.base_version, now,
                                   f"training run {outcome.run_id} promoted it")
        self.collection.on_outcome(outcome, self.stats.serving_version(target), now)
        self._refresh(target, now)
        return True

    def _refresh(self, target: str, now: float) -> tuple[Decision, bool]:
        with self._lock:
            serving = self.stats.serving_version(target)
            draft = next((d for d in self.stats.drafts(target) if d.draft_version == serving), None)
            signal = Signal(serving, draft, self.stats.emitted(target), self.stats.mean_batch(target, now))
            self.collection.evaluate(target, signal, now)
            state = self.collection.state(target)
            return self.issuer.issue(target, state.enabled, state.reason, now)


class Reconciler:
    """Runs `before_round()` (the controller's evaluation) and `fleet.reconcile()` every `interval_s`,
    or at once after `wake()` (a registration, a training outcome)."""

    def __init__(self, fleet: Fleet, interval_s: float, before_round: Callable[[], object] | None = None) -> None:
        self.fleet, self.interval_s, self.before_round = fleet, interval_s, before_round
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="reconciler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.before_round is not None:
                    self.before_round()
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
    registry: GrpcRegistry | None = None

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
        if self.registry is not None:
            self.registry.close()


def break_even_rates(settings: ControllerSettings) -> Callable[[str], float]:
    """target -> the cold-start rate: TIDE_CONTROLLER_BREAK_EVEN_RATE, else the γ policy's break-even
    from the target's latency profile (looked up once per target, logged)."""
    rates: dict[str, float] = {}

    def rate(target: str) -> float:
        if settings.break_even_rate > 0:
            return settings.break_even_rate
        if target not in rates:
            costs = step_costs(settings.latency_profile, target)
            rates[target] = costs.break_even_rate()
            log.info("break-even acceptance rate of %s: %.3f (step costs: %s)", target, rates[target], costs.source)
        return rates[target]

    return rate


def load_rule(settings: ControllerSettings) -> Callable[[str, float, float], bool]:
    """(target, running batch, acceptance rate) -> whether a draft at that rate would pay at that batch:
    its best predicted speed-up over γ (StepCosts at the batch, from the target's latency profile) beats
    the γ policy's margin. Without a profile (none given, none cached on this machine yet) it pays: no
    load rule. A found profile is kept; a missing one is looked for again next time."""
    profiles: dict[str, tuple] = {}

    def pays(target: str, batch: float, rate: float) -> bool:
        if target not in profiles:
            found = find_profile(settings.latency_profile, target)
            if found is None:
                return True
            profiles[target] = found
            log.info("load rule for %s: step costs from %s", target, found[1])
        profile, source = profiles[target]
        return StepCosts.from_profile(profile, source, max(1.0, batch)).best_speedup(rate) >= 1.0 + MIN_GAIN

    return pays


def build(settings: ControllerSettings, *, worker_client: WorkerClient | None = None) -> ControllerService:
    """Build and start everything (the gRPC server last: SERVING means the loops run)."""
    client = worker_client or GrpcWorkerClient(settings.admin_token, settings.rpc_timeout_s)
    registry = None
    if settings.registry_addr:  # refusals are acted on whenever there is a registry; auto-rollback if enabled
        registry = GrpcRegistry(settings.registry_addr, settings.admin_token, settings.rpc_timeout_s)
    else:
        log.warning("TIDE_REGISTRY_ADDR is not set: drafts that workers refuse stay effective in the registry%s",
                    ", and automatic rollback of drafts that accept worse is disabled" if settings.auto_rollback
                    else "")
    collection = CollectionControl(CollectionConfig(
        settings.collection_mode, settings.shift_epsilon, settings.min_observations, settings.no_gain_runs,
        settings.gain_margin, settings.tokens_needed, settings.collection_learn, settings.min_on_s,
        settings.shift_hold_s, settings.reachable_rate, settings.load_hold_s), break_even=break_even_rates(settings),
        pays_at=load_rule(settings))
    stats = FleetStats(settings.ema_short, settings.ema_long, settings.load_window_s)
    controller = Controller(settings.decision, stats, client=client, collection=collection,
                            rollback=RollbackGuard(registry if settings.auto_rollback else None,
                                                   settings.rollback_window, settings.rollback_margin,
                                                   settings.rollback_z),
                            refusals=RefusalResolver(registry))
    for address in settings.workers:
        controller.fleet.add(address, configured=True)
    rclient = settings.storage.redis_client(socket_connect_timeout=2.0, socket_timeout=5.0)
    reader = TelemetryReader(rclient, streams.StreamNames(settings.storage.stream_prefix), settings.consumer,
                             controller.stats, claim_idle_ms=settings.claim_idle_ms).start()
    reconciler = Reconciler(controller.fleet, settings.reconcile_s, controller.evaluate).start()
    server = serve(controller, reconciler.wake, settings.listen, settings.admin_token)
    log.info("controller serving on %s (workers configured: %s; decision: %s; collection: %s; rollback: %s; "
             "refused drafts: %s)", server.target, ", ".join(settings.workers) or "none", settings.decision.to_dict(),
             settings.collection_mode, f"via {settings.registry_addr}" if controller.rollback.enabled else "off",
             f"rolled back via {settings.registry_addr}" if registry else "left in the registry")
    return ControllerService(settings, controller, reader, reconciler, server, registry)

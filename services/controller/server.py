"""gRPC ControllerService: translates tide.v1 protobuf <-> the controller's domain.

GetState is open (per target: statistics, the decision's parts, collection state, rollback watch, the
last rollback and what was done about workers' refusals of the registry's draft); ReportTrainingOutcome
and RegisterWorker are admin methods (declared in the proto, enforced by tide.grpcutil with the bearer
token). RegisterWorker adds the worker to the
fleet, wakes the reconcile loop (which pushes the decision), and returns the current decision for
the worker's target so a (re)started worker can catch up at once. Invalid requests end with
INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import grpc

from services.controller.outcomes import TrainingOutcome
from services.controller.refusals import RefusalRecord
from services.controller.rollback import RollbackGuard
from services.controller.stats import DraftStats
from tide.decisions import decision_pb, policy_pb, schedule_pb
from tide.grpcutil import GrpcServer
from tide.proto.tide.v1 import controller_pb2, controller_pb2_grpc, trainer_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = "tide.v1.ControllerService"
DEFAULT_MAX_DECISIONS = 20
_OUTCOME_FIELDS = [f.name for f in dataclasses.fields(TrainingOutcome)]


def outcome_pb(o: TrainingOutcome) -> trainer_pb2.TrainingOutcome:
    return trainer_pb2.TrainingOutcome(**dataclasses.asdict(o))


def outcome_from_pb(pb: trainer_pb2.TrainingOutcome) -> TrainingOutcome:
    return TrainingOutcome(**{name: getattr(pb, name) for name in _OUTCOME_FIELDS})


def draft_stats_pb(s: DraftStats) -> controller_pb2.DraftStats:
    return controller_pb2.DraftStats(draft_version=s.draft_version, accept_length_ema_short=s.short.value,
                                     accept_length_ema_long=s.long.value, verify_steps=s.verify_steps,
                                     tokens=s.tokens, last_update_unix_s=s.last_update_unix_s,
                                     acceptance_rate_ema_short=s.rate_short.value,
                                     acceptance_rate_ema_long=s.rate_long.value)


def rollback_state_pb(guard: RollbackGuard, target: str) -> controller_pb2.RollbackState:
    out = controller_pb2.RollbackState(enabled=guard.enabled, window=guard.window)
    w = guard.watching(target)
    if w is not None:
        out.watching_version, out.previous_version, out.verify_steps = w.version, w.previous, w.verify_steps
    last = guard.last(target)
    if last is not None:
        out.last.CopyFrom(controller_pb2.RollbackRecord(
            from_version=last.from_version, to_version=last.to_version, reason=last.reason,
            live_accept_length=last.live_accept_length, previous_accept_length=last.previous_accept_length,
            verify_steps=last.verify_steps, time_unix_s=last.time_unix_s,
            live_acceptance_rate=last.live_acceptance_rate, previous_acceptance_rate=last.previous_acceptance_rate))
    return out


def refusal_record_pb(r: RefusalRecord) -> controller_pb2.DraftRefusalRecord:
    return controller_pb2.DraftRefusalRecord(
        worker_id=r.worker_id, version=r.version, reason=r.reason, detail=r.detail, refused_unix_s=r.refused_unix_s,
        outcome=r.outcome, to_version=r.to_version, note=r.note, time_unix_s=r.time_unix_s)


class ControllerServicer(controller_pb2_grpc.ControllerServiceServicer):
    def __init__(self, controller, wake: Callable[[], None]) -> None:  # controller: app.Controller
        self.controller, self.wake = controller, wake

    def _target_state(self, target: str) -> controller_pb2.TargetState:
        c = self.controller
        out = controller_pb2.TargetState(target_model=target, draft_version=c.stats.serving_version(target),
                                         drafts=[draft_stats_pb(s) for s in c.stats.drafts(target)])
        d = c.decision_for(target)
        if d.speculation is not None:
            out.speculation.CopyFrom(schedule_pb(d.speculation))
        if d.policy is not None:
            out.gamma_policy.CopyFrom(policy_pb(d.policy))
        col = c.collection.state(target)
        if col is not None:
            reason = col.reason if col.enabled is not None else f"undecided, left to the workers: {col.reason}"
            out.collection.CopyFrom(controller_pb2.CollectionState(
                enabled=bool(col.enabled), reason=reason, tokens_collected=col.tokens_collected,
                tokens_needed=col.tokens_needed, since_unix_s=col.since_unix_s))
        out.rollback.CopyFrom(rollback_state_pb(c.rollback, target))
        out.draft_refusals.extend(refusal_record_pb(r) for r in c.refusals.records(target))
        last = c.outcomes.last(target)
        if last is not None:
            out.last_training.CopyFrom(outcome_pb(last))
        return out

    def GetState(self, request, context):
        c = self.controller
        targets = [t for t in c.targets() if not request.target_model or t == request.target_model]
        records = c.fleet.decisions.recent(request.max_decisions or DEFAULT_MAX_DECISIONS, request.target_model)
        return controller_pb2.ControllerState(
            targets=[self._target_state(t) for t in targets],
            recent_decisions=[controller_pb2.DecisionRecord(decision=decision_pb(r.decision),
                                                            applied_to=list(r.applied_to), failed=list(r.failed))
                              for r in records],
            workers=[controller_pb2.WorkerInfo(worker_id=w.worker_id, address=w.address,
                                               target_model=w.target_model,
                                               registered_unix_s=w.registered_unix_s,
                                               last_seen_unix_s=w.last_seen_unix_s,
                                               last_decision_id=w.last_decision_id)
                     for w in c.fleet.workers()
                     if not request.target_model or w.target_model == request.target_model])

    def ReportTrainingOutcome(self, request, context):
        try:
            recorded = self.controller.report_outcome(outcome_from_pb(request))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if recorded:
            log.info("training outcome %s for %s: candidate %s (%.3f vs %.3f), promoted=%s: %s", request.run_id,
                     request.target_model, request.candidate_version or "-", request.eval_accept_length_candidate,
                     request.eval_accept_length_base, request.promoted, request.detail)
            self.wake()  # a changed decision (collection off after no gain) is pushed at once
        return controller_pb2.ReportTrainingOutcomeResponse(recorded=recorded)

    def RegisterWorker(self, request, context):
        address = request.address.strip()
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"address must be host:port, got {request.address!r}")
        self.controller.fleet.add(address, worker_id=request.worker_id, target_model=request.target_model)
        log.info("worker %s registered at %s (target %s)", request.worker_id or "?", address,
                 request.target_model or "?")
        self.wake()
        current = self.controller.decision_for(request.target_model)
        if current is None:
            return controller_pb2.RegisterWorkerResponse()
        return controller_pb2.RegisterWorkerResponse(current=decision_pb(current))


def serve(controller, wake: Callable[[], None], address: str, admin_token: str | None,
          max_workers: int = 16) -> GrpcServer:
    server = GrpcServer(address, admin_token=admin_token, max_workers=max_workers)
    server.add_service(controller_pb2_grpc.add_ControllerServiceServicer_to_server,
                       ControllerServicer(controller, wake), SERVICE_NAME)
    server.start()
    return server


"""`WorkerClient` over gRPC: GetStatus and ApplyDecision on the workers' InferenceService.

Channels are opened once per address and kept (gRPC reconnects them by itself); ApplyDecision is
an admin method, so the channel carries the controller's admin token and actor name.
"""

from __future__ import annotations

import threading

import grpc

from services.controller.fleet import DraftRefusal, PushResult, WorkerSnapshot, WorkerUnreachable
from tide import grpcutil
from tide.decisions import Decision, decision_pb
from tide.proto.tide.v1 import inference_pb2, inference_pb2_grpc

ACTOR = "controller"
_OUTCOMES = {
    inference_pb2.ApplyDecisionResponse.OUTCOME_APPLIED: "applied",
    inference_pb2.ApplyDecisionResponse.OUTCOME_ALREADY_APPLIED: "already_applied",
    inference_pb2.ApplyDecisionResponse.OUTCOME_REJECTED: "rejected",
}


def snapshot_from_pb(s: inference_pb2.WorkerStatus) -> WorkerSnapshot:
    return WorkerSnapshot(s.worker_id, s.model_id, s.last_decision_id, s.uptime_s, s.registry_draft_version,
                          s.wanted_draft_version,
                          tuple(DraftRefusal(r.version, r.reason, r.detail, r.time_unix_s) for r in s.draft_refusals))


class GrpcWorkerClient:
    """Thread-safe; `timeout_s` bounds every call (a busy CPU worker answers between engine steps)."""

    def __init__(self, admin_token: str | None, timeout_s: float = 10.0) -> None:
        self.admin_token, self.timeout_s = admin_token, timeout_s
        self._stubs: dict[str, tuple[grpc.Channel, inference_pb2_grpc.InferenceServiceStub]] = {}
        self._lock = threading.Lock()

    def _stub(self, address: str) -> inference_pb2_grpc.InferenceServiceStub:
        with self._lock:
            if address not in self._stubs:
                ch = grpcutil.channel(address, token=self.admin_token, actor=ACTOR)
                self._stubs[address] = (ch, inference_pb2_grpc.InferenceServiceStub(ch))
            return self._stubs[address][1]

    def status(self, address: str) -> WorkerSnapshot:
        try:
            s = self._stub(address).GetStatus(inference_pb2.GetWorkerStatusRequest(), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise WorkerUnreachable(f"{e.code().name}: {e.details()}") from None
        return snapshot_from_pb(s)

    def apply(self, address: str, decision: Decision) -> PushResult:
        try:
            r = self._stub(address).ApplyDecision(decision_pb(decision), timeout=self.timeout_s)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                return PushResult("rejected", f"{e.code().name}: {e.details()} (check TIDE_ADMIN_TOKEN)")
            raise WorkerUnreachable(f"{e.code().name}: {e.details()}") from None
        return PushResult(_OUTCOMES.get(r.outcome, "rejected"), r.detail)

    def close(self) -> None:
        with self._lock:
            for ch, _ in self._stubs.values():
                ch.close()
            self._stubs.clear()

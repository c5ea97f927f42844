"""Helpers of the controller tests (import as `controller.svc`)."""

from __future__ import annotations

from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.services import wait_for as wait_for  # the controller tests import it from here

from services.controller.rollback import RollbackRefused
from tide.grpcutil import channel

ADMIN_TOKEN = "test-admin-token"


def health_status(address: str, service: str = "") -> int | None:
    """The gRPC health status of `service` at `address`, None when it does not answer."""
    ch = channel(address)
    try:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=1).status
    except Exception:
        return None
    finally:
        ch.close()


def serving(address: str, service: str = "") -> bool:
    return health_status(address, service) == health_pb2.HealthCheckResponse.SERVING


class FakeRegistry:
    """Registry port double (services.controller.rollback.RegistryPort): a pointer (current, pinned),
    the rollbacks made (`calls`), pointer reads counted, and an error to raise. `previous`: the
    versions a rollback may go back to, most recent first (None: any), as the real registry checks."""

    def __init__(self, current="v2", pinned="", previous: tuple[str, ...] | None = None) -> None:
        self.current, self.pinned = current, pinned
        self.previous = None if previous is None else list(previous)
        self.calls: list[tuple[str, str, str]] = []
        self.reads = 0
        self.error: Exception | None = None

    def pointer(self, target_model):
        self.reads += 1
        if self.error:
            raise self.error
        return self.current, self.pinned

    def rollback(self, target_model, to_version, reason, expected_current):
        if self.error:
            raise self.error
        if self.current != expected_current:  # what the real registry answers with FAILED_PRECONDITION
            raise RollbackRefused(f"FAILED_PRECONDITION: current draft is {self.current}, not {expected_current}")
        if self.previous is not None:
            if to_version not in self.previous:
                raise RollbackRefused(f"FAILED_PRECONDITION: {to_version!r} was not a previous current draft")
            self.previous.insert(0, self.current)
        self.calls.append((target_model, to_version, reason))
        self.current = to_version
        return to_version

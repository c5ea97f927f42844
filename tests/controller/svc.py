"""Helpers of the controller tests (import as `controller.svc`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from grpc_health.v1 import health_pb2, health_pb2_grpc

from tide.grpcutil import channel

ADMIN_TOKEN = "test-admin-token"


def wait_for(predicate: Callable[[], object], timeout_s: float = 10.0, what: str = "condition", every_s=0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


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

"""Helpers of the controller tests (import as `controller.svc`)."""

from __future__ import annotations

from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.services import wait_for as wait_for  # the controller tests import it from here

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

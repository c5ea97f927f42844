"""`RegistryPort` over gRPC (tide.registry_client): the controller's rollbacks, as actor "controller"
with the admin token. UNAVAILABLE / DEADLINE_EXCEEDED mean "retry later"; any other error is a refusal."""

from __future__ import annotations

import grpc

from services.controller.rollback import RegistryUnavailable, RollbackRefused
from tide.registry_client import RegistryClient

ACTOR = "controller"
_RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)


def _error(e: grpc.RpcError) -> Exception:
    text = f"{e.code().name}: {e.details()}"
    return RegistryUnavailable(text) if e.code() in _RETRY else RollbackRefused(text)


class GrpcRegistry:
    def __init__(self, address: str, token: str | None, timeout_s: float = 10.0) -> None:
        self.client = RegistryClient(address, token=token, actor=ACTOR, timeout_s=timeout_s)

    def pointer(self, target_model: str) -> tuple[str, str]:
        try:
            p = self.client.pointer(target_model)
        except grpc.RpcError as e:
            raise _error(e) from None
        return p.current, p.pinned

    def rollback(self, target_model: str, to_version: str, reason: str, expected_current: str) -> str:
        try:
            return self.client.rollback(target_model, reason=reason, to_version=to_version,
                                        expected_current=expected_current).current
        except grpc.RpcError as e:
            raise _error(e) from None

    def close(self) -> None:
        self.client.close()

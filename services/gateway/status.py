"""`GET /v1/status`: the state of every part of the stack, in one JSON document.

Sources, each optional:
- the workers, as the gateway's own worker pool sees them (healthy after its last status poll);
- the other gRPC services (registry, trainer, controller): their gRPC health check, asked now
  (concurrently, `PROBE_TIMEOUT_S` each) at the addresses in the gateway's settings;
- the supervisor's view, when the stack runs under `tide up`: `TIDE_STACK_STATE` names its
  stack.json, which has every process's state (ready / starting / restarting / failed) and restart
  count, Redis and S3 included. Under docker compose, Docker restarts containers and the restart
  counts are not visible here (null).

`status` is "ok" when every part known is healthy and ready, else "degraded" with `degraded` naming
the parts that are not. No secrets: addresses and counts only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.engine_client import EngineClient

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class StatusSources:
    services: dict[str, str]  # service name -> gRPC address ("" = not configured)
    stack_state: Path | None = None  # tide up's stack.json


def supervisor_view(path: Path | None) -> dict[str, dict]:
    """Per process {state, restarts, last_exit, pid} from tide up's stack.json ({} when unknown)."""
    if path is None:
        return {}
    try:
        return dict(json.loads(path.read_text()).get("services") or {})
    except (OSError, ValueError) as e:
        log.warning("stack state unreadable", extra={"path": str(path), "error": str(e)})
        return {}


async def grpc_health(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the server at `address` says SERVING within `timeout_s`."""
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except (grpc.RpcError, OSError, TimeoutError):
        return False


async def stack_status(sources: StatusSources, engine: EngineClient) -> dict:
    supervised = supervisor_view(sources.stack_state)
    probed = {name: addr for name, addr in sources.services.items() if addr}
    healthy = dict(zip(probed, await asyncio.gather(*(grpc_health(a) for a in probed.values())), strict=True))
    services: dict[str, dict] = {}
    for name, addr in probed.items():
        services[name] = {"address": addr, "healthy": healthy[name]}
    for i, w in enumerate(engine.workers()):
        services[f"inference-{i}"] = {"address": w.address, "healthy": w.healthy}
    for name, s in supervised.items():
        entry = services.setdefault(name, {"address": None, "healthy": s.get("state") == "ready"})
        entry.update(state=s.get("state"), restarts=s.get("restarts"), last_exit=s.get("last_exit"))
    for entry in services.values():
        entry.setdefault("state", "ready" if entry["healthy"] else "unreachable")
        entry.setdefault("restarts", None)
    degraded = sorted(n for n, e in services.items() if not e["healthy"] or e["state"] != "ready")
    return {"status": "degraded" if degraded else "ok", "degraded": degraded, "serving": engine.is_ready(),
            "services": services, "supervised": bool(supervised), "time_unix_s": time.time()}

"""GET /v1/status and /ready on a real gateway with a real worker: the other services' gRPC health
asked live, tide up's process table (its stack.json) merged in, "degraded" naming what is not ready."""

from __future__ import annotations

import json
import os

import httpx

from gateway.harness import free_port, serve_gateway
from tide.grpcutil import GrpcServer
from tide.memory import rss_bytes


def test_status_names_every_part_and_what_is_degraded(tokenizer, worker, tmp_path):
    stack_json = tmp_path / "stack.json"
    # "redis" is this test's own process: a pid that exists, so the gateway reads its resident memory
    table = {"redis": {"state": "ready", "restarts": 1, "last_exit": None, "pid": os.getpid()},
             "trainer": {"state": "restarting", "restarts": 2, "last_exit": -9, "pid": 12},
             "inference-0": {"state": "ready", "restarts": 0, "last_exit": None, "pid": 13}}
    stack_json.write_text(json.dumps({"services": table}))
    nothing_there = f"127.0.0.1:{free_port()}"
    with GrpcServer() as registry, serve_gateway(tokenizer, (worker.address,), registry_addr=registry.target,
                                                 trainer_addr=nothing_there, stack_state=str(stack_json)) as url:
        doc = httpx.get(f"{url}/v1/status", timeout=30).json()
        services = doc["services"]
        assert services["registry"] == {"address": registry.target, "healthy": True, "state": "ready",
                                        "restarts": None}
        assert services["trainer"]["healthy"] is False and services["trainer"]["state"] == "restarting"
        assert services["trainer"]["restarts"] == 2 and services["trainer"]["last_exit"] == -9
        assert services["redis"]["restarts"] == 1 and services["redis"]["state"] == "ready"
        assert services["inference-0"]["address"] == worker.address and services["inference-0"]["healthy"]
        assert "controller" not in services  # not configured: not shown
        mine = rss_bytes()
        assert 0.5 * mine < services["redis"]["rss_bytes"] < 2 * mine
        assert doc["rss_bytes"] >= services["redis"]["rss_bytes"]
        memory = doc["workers"][0]["memory"]  # the worker's own report: RSS beside what its tensors take
        assert memory["weights_bytes"] > 0 and memory["kv_cache_bytes"] > 0 and memory["draft_bytes"] >= 0
        # the cache is held as written (tide.allocator.zeros_on_demand): its resident part is what RSS holds
        assert 0 <= memory["kv_cache_resident_bytes"] <= memory["kv_cache_bytes"]
        assert memory["rss_bytes"] > memory["weights_bytes"] + memory["kv_cache_resident_bytes"]
        assert doc["status"] == "degraded" and doc["degraded"] == ["trainer"] and doc["serving"] is True
        ready = httpx.get(f"{url}/ready").json()  # serving, and says what is being restarted
        assert ready["status"] == "degraded" and ready["degraded"] == ["trainer"]

        table["trainer"].update(state="ready", restarts=3)
        stack_json.write_text(json.dumps({"services": table}))
        registry.set_serving("", False)
        doc = httpx.get(f"{url}/v1/status", timeout=30).json()
        assert doc["degraded"] == ["registry", "trainer"]  # trainer: its address does not answer
        assert doc["services"]["registry"]["state"] == "unreachable"
        text = json.dumps(doc).lower()
        assert not any(word in text for word in ("secret", "password", "credential", "bearer", "admin_token"))


def test_status_without_tide_up_is_the_gateways_own_view(client):
    doc = client.get("/v1/status").json()
    assert doc["supervised"] is False and doc["status"] == "ok" and doc["degraded"] == []
    assert [name for name in doc["services"]] == ["inference-0"]
    assert client.get("/ready").json()["status"] == "ready"

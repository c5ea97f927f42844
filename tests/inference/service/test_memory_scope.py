"""The speculation memory's scope over real gRPC: a request's key id is its scope (TIDE_SPECULATION_
MEMORY_SCOPE=key, the default), one scope for all with `stack`, and `no_memory` keeps it out."""

from __future__ import annotations

import pytest
from inference.service.svc import request, run_stream, stub

from tide.proto.tide.v1 import inference_pb2


@pytest.mark.parametrize("scope", ["key", "stack"])
def test_key_ids_are_the_memorys_scopes_unless_shared(make_service, scope):
    svc = make_service(speculation_memory_mb=1, speculation_memory_scope=scope)
    client = stub(svc)
    for rid, key, no_memory in (("a1", "aaaa", False), ("b1", "bbbb", False), ("b2", "bbbb", True)):
        run_stream(client, request(rid, [5, 9, 14, 5, 9, 14, 5, 9], max_tokens=8, key_id=key, no_memory=no_memory))
    memory = svc.worker.engine.memory
    assert memory.added == 2  # b2 opted out
    assert memory.scopes() == (["aaaa", "bbbb"] if scope == "key" else [""])
    # operators see it in the worker's status (and the gateway's /v1/status): held, budget, tokens
    report = client.GetStatus(inference_pb2.GetWorkerStatusRequest(), timeout=10).memory
    assert report.speculation_memory_budget_bytes == 2**20
    assert 0 < report.speculation_memory_bytes == memory.nbytes <= 2**20
    assert report.speculation_memory_tokens == memory.tokens >= 2 * 8


def test_memory_off_by_setting(make_service):
    svc = make_service(speculation_memory_mb=0)
    assert svc.worker.engine.memory is None
    report = stub(svc).GetStatus(inference_pb2.GetWorkerStatusRequest(), timeout=10).memory
    assert (report.speculation_memory_bytes, report.speculation_memory_budget_bytes) == (0, 0)

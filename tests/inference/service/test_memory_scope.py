"""The speculation memory's scope over real gRPC: a request's key id is its scope (TIDE_SPECULATION_
MEMORY_SCOPE=key, the default), one scope for all with `stack`, and `no_memory` keeps it out."""

from __future__ import annotations

import pytest
from inference.service.svc import request, run_stream, stub


@pytest.mark.parametrize("scope", ["key", "stack"])
def test_key_ids_are_the_memorys_scopes_unless_shared(make_service, scope):
    svc = make_service(speculation_memory_mb=1, speculation_memory_scope=scope)
    client = stub(svc)
    for rid, key, no_memory in (("a1", "aaaa", False), ("b1", "bbbb", False), ("b2", "bbbb", True)):
        run_stream(client, request(rid, [5, 9, 14, 5, 9, 14, 5, 9], max_tokens=8, key_id=key, no_memory=no_memory))
    memory = svc.worker.engine.memory
    assert memory.added == 2  # b2 opted out
    assert memory.scopes() == (["aaaa", "bbbb"] if scope == "key" else [""])


def test_memory_off_by_setting(make_service):
    svc = make_service(speculation_memory_mb=0)
    assert svc.worker.engine.memory is None

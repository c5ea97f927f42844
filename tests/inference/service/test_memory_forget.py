"""Deletion requests reach a worker's speculation memory in RAM, over real Redis and gRPC: a
ForgetNotice on the forget stream (what the trainer publishes for `tidectl data forget`) drops the
request's documents from the running worker's memory; a damaged notice is counted and dropped."""

from __future__ import annotations

from inference.service.svc import request, run_stream, stub, wait_for

from tide import streams

PROMPT = [5, 9, 14, 21, 33, 7, 2, 40, 11]


def test_a_forget_notice_empties_the_running_workers_memory_of_that_request(make_service):
    svc = make_service(worker_id="w1", speculation_memory_mb=1)
    memory = svc.worker.engine.memory
    run_stream(stub(svc), request("chatcmpl-a-0", PROMPT, max_tokens=12, key_id="key-a"))
    run_stream(stub(svc), request("chatcmpl-b-0", [3, 4, 6, 8], max_tokens=12, key_id="key-b"))
    wait_for(lambda: memory.added == 2 or None, what="both requests in the memory")
    st = svc.settings.storage
    r, stream = st.redis_client(), streams.StreamNames(st.stream_prefix).forget
    r.xadd(stream, {"type": "forget_notice", "v": streams.SCHEMA_VERSION, "data": "{}"})  # neither id: damaged
    streams.add(r, stream, streams.ForgetNotice(request_id="chatcmpl-a"))
    wait_for(lambda: svc.forgetter.stats["applied"] == 1 or None, what="the notice applied")
    assert svc.forgetter.stats["corrupt"] == 1 and svc.forgetter.stats["documents"] == 1
    assert memory.forgotten == 1 and memory.scopes() == ["key-b"]  # key-a's one document went, not key-b's
    run_stream(stub(svc), request("chatcmpl-a-1", PROMPT, max_tokens=12, key_id="key-a"))  # refused from now on
    assert memory.added == 2


def test_without_a_memory_there_is_no_reader(make_service):
    assert make_service(worker_id="w2").forgetter is None

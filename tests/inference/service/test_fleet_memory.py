"""The speculation memory across the fleet (TIDE_SPECULATION_MEMORY_FLEET) over real Redis and gRPC:
what one worker serves reaches another's memory in its scope, sealed under data keys; opted-out
requests are never published; a damaged entry is counted and dropped; a worker started later warms
from the stream; without the setting nothing is published."""

from __future__ import annotations

import base64
import hashlib

from inference.service.svc import request, run_stream, stub, wait_for

from tide import streams
from tide.datakeys import is_sealed
from tide.proto.tide.v1 import inference_pb2

KEY = "k1:" + base64.b64encode(bytes(range(32))).decode()
PROMPT = [5, 9, 14, 21, 33, 7, 2, 40, 11]


def _fleet(make_service, worker_id: str, **kw):
    return make_service(worker_id=worker_id, speculation_memory_mb=1, speculation_memory_fleet=True, **kw)


def _entries(svc) -> list[streams.MemoryEntry]:
    st = svc.settings.storage
    raw = st.redis_client().xrange(streams.StreamNames(st.stream_prefix).memory)
    return [streams.decode(fields, streams.MemoryEntry) for _, fields in raw]


def test_one_workers_output_reaches_the_others_memory_in_its_scope(make_service):
    w1, w2 = _fleet(make_service, "w1"), _fleet(make_service, "w2")
    tokens, _, _ = run_stream(stub(w1), request("a", PROMPT, max_tokens=12, key_id="key-a"))
    run_stream(stub(w1), request("b", PROMPT, max_tokens=12, key_id="key-b", no_memory=True))  # opted out
    wait_for(lambda: w2.fleet.stats["added"] == 1 or None, what="w1's request handed to w2's engine")
    run_stream(stub(w2), request("c", [3, 4], max_tokens=4))  # w2's next step adds it
    assert set(w2.worker.engine.memory.scopes()) == {"key-a", ""}  # the published scope, and w2's own request
    got = _entries(w1)
    assert [(e.worker_id, e.scope, e.prompt_tokens) for e in got] == [("w1", "key-a", len(PROMPT)), ("w2", "", 2)]
    assert got[0].target_model == "tiny-llama-0" and got[0].data_key_id == ""
    assert w1.fleet.stats["published"] == 1 and w2.fleet.stats["added"] == 1 and w2.fleet.stats["own"] == 1
    assert tokens  # the request itself was served as ever


def test_under_data_keys_the_stream_holds_sealed_ids_only(make_service, real_storage):
    sealed = real_storage.model_copy(update={"data_keys": KEY})
    w1, w2 = _fleet(make_service, "w1", storage=sealed), _fleet(make_service, "w2", storage=sealed)
    run_stream(stub(w1), request("a", PROMPT, max_tokens=12, key_id="key-a"))
    wait_for(lambda: w2.fleet.stats["added"] == 1 or None, what="the sealed entry opened by w2")
    (e,) = _entries(w1)
    assert e.data_key_id == "k1" and is_sealed(base64.b64decode(e.tokens))


def test_damaged_entries_are_dropped_and_a_late_worker_warms_from_the_stream(make_service):
    w1 = _fleet(make_service, "w1")
    run_stream(stub(w1), request("a", PROMPT, max_tokens=12, key_id="key-a"))
    wait_for(lambda: w1.fleet.stats["published"] == 1 or None, what="w1's entry published")
    st = w1.settings.storage
    r, stream = st.redis_client(), streams.StreamNames(st.stream_prefix).memory
    good = _entries(w1)[0]
    # raw XADDs a buggy or hostile producer could make: not JSON, a wrong checksum, ids past the vocabulary
    r.xadd(stream, {"type": "memory_entry", "v": "1", "data": "{not json"})
    bad_sum = streams.MemoryEntry(**{**good.__dict__, "worker_id": "w9", "sha256": "0" * 64})
    huge = base64.b64encode((10**6).to_bytes(4, "little")).decode()

    out_of_vocab = streams.MemoryEntry(**{**good.__dict__, "worker_id": "w9", "tokens": huge, "prompt_tokens": 0,
                                          "sha256": hashlib.sha256(base64.b64decode(huge)).hexdigest()})
    for e in (bad_sum, out_of_vocab):
        streams.add(r, stream, e)
    w2 = _fleet(make_service, "w2")  # starts after all of it: reads the window first
    wait_for(lambda: w2.fleet.stats["corrupt"] == 3 or None, what="three damaged entries counted")
    assert w2.fleet.stats["added"] == 1  # w1's, from before w2 started
    report = stub(w2).GetStatus(inference_pb2.GetWorkerStatusRequest(), timeout=10).memory
    run_stream(stub(w2), request("c", [3, 4], max_tokens=4))
    assert w2.worker.engine.memory.scopes() == ["", "key-a"] and report.speculation_memory_budget_bytes == 2**20


def test_without_the_setting_nothing_is_published(make_service):
    w1 = make_service(worker_id="w1", speculation_memory_mb=1)
    run_stream(stub(w1), request("a", PROMPT, max_tokens=12))
    assert w1.fleet is None and w1.worker.engine.memory.added == 1
    st = w1.settings.storage
    assert st.redis_client().xlen(streams.StreamNames(st.stream_prefix).memory) == 0

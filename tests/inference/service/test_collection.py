"""Hidden-state export end to end: real S3 blobs, refs on the real chunk stream, rows = committed tokens."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import torch
from inference.service.svc import ADMIN_TOKEN, request, run_stream, stub, wait_for

from tide import blobs, streams
from tide.chunks import decode_chunk
from tide.proto.tide.v1 import inference_pb2

PROMPTS = [[5, 9, 14, 5, 9, 14, 5, 9], [40, 41, 42, 43, 40, 41, 70], [7, 3, 88, 21, 60, 7, 3, 30, 31]]


def chunk_refs(redis_client, prefix: str) -> list[streams.ChunkRef]:
    return [streams.decode(f, streams.ChunkRef) for _, f in redis_client.xrange(streams.StreamNames(prefix).chunks)]


def test_chunks_hold_exactly_the_committed_tokens(make_service, tiny_model, redis_client, s3_client, s3_bucket,
                                                  unique_prefix):
    svc = make_service(collection=True, chunk_tokens=64, flush_interval_s=0.3)
    client = stub(svc)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda i: run_stream(client, request(f"r{i}", PROMPTS[i], 40, workload="chat")),
                                range(len(PROMPTS))))
    full = [p + toks for p, (toks, _, _) in zip(PROMPTS, results, strict=True)]
    # every token the target processed: prompt + output except the last sampled token
    expected_rows = sum(len(f) - 1 for f in full)
    refs = wait_for(lambda: (r := chunk_refs(redis_client, unique_prefix)) and
                    sum(x.num_tokens for x in r) >= expected_rows and r, what="chunk refs")
    assert sum(r.num_tokens for r in refs) == expected_rows
    assert len(refs) >= 2  # 64-row chunks: the 150 rows span several
    assert sorted(blobs.list_keys(s3_client, s3_bucket)) == sorted(r.key for r in refs)  # no orphan blobs

    seen: dict[int, list[int]] = {i: [] for i in range(len(full))}
    agree = total = 0
    lm_head = tiny_model.lm_head.float()
    for ref in refs:
        data = blobs.get_bytes(s3_client, ref.bucket, ref.key, expected_sha256=ref.sha256)
        assert hashlib.sha256(data).hexdigest() == ref.sha256 and len(data) == ref.size_bytes
        chunk = decode_chunk(data, expected_target="tiny-llama-0")
        assert (chunk.meta.chunk_id, chunk.meta.worker_id, chunk.num_tokens) == (ref.chunk_id, "test-worker",
                                                                                 ref.num_tokens)
        assert ref.workload == chunk.meta.workload == "chat" and ref.draft_version == "ngram"
        greedy = (chunk.final.float() @ lm_head.T).argmax(-1)
        for a, b in chunk.segments():
            ids, pos = chunk.input_ids[a:b].tolist(), chunk.positions[a:b].tolist()
            owners = [i for i, f in enumerate(full) if f[pos[0]:pos[0] + len(ids)] == ids]
            assert len(owners) == 1, f"segment at {pos[0]} matches requests {owners}"
            i = owners[0]
            seen[i].extend(pos)
            n_prompt = len(PROMPTS[i])
            assert chunk.loss_mask[a:b].tolist() == [int(p >= n_prompt - 1) for p in pos]
            for row, p in zip(range(a, b), pos, strict=True):
                if p >= n_prompt - 1:  # the target's greedy choice after this row is the next committed token
                    total += 1
                    agree += int(greedy[row]) == full[i][p + 1]
    for i, f in enumerate(full):
        assert sorted(seen[i]) == list(range(len(f) - 1)), f"request {i}: rows missing or repeated"
    assert agree / total > 0.9  # rows hold the states the target decided with (bf16 storage may flip ties)


def test_collection_toggled_by_decision(make_service, redis_client, unique_prefix):
    svc = make_service(collection=False)
    assert svc.worker.engine.capture_listeners == []  # collection off: the engine captures nothing
    client, admin = stub(svc), stub(svc, ADMIN_TOKEN)
    run_stream(client, request("off", PROMPTS[0], 10))
    on = admin.ApplyDecision(inference_pb2.Decision(decision_id="c-on", collection_enabled=True))
    assert on.status.collection_enabled and len(svc.worker.engine.capture_listeners) == 1
    run_stream(client, request("on", PROMPTS[1], 10))
    off = admin.ApplyDecision(inference_pb2.Decision(decision_id="c-off", collection_enabled=False))
    assert not off.status.collection_enabled and svc.worker.engine.capture_listeners == []
    refs = wait_for(lambda: chunk_refs(redis_client, unique_prefix), what="the partial chunk flushed on 'off'")
    assert sum(r.num_tokens for r in refs) == len(PROMPTS[1]) + 10 - 1  # only the request served while on
    run_stream(client, request("off-again", PROMPTS[2], 10))
    svc.exporter.flush_soon()
    assert svc.exporter.wait_idle(5)
    assert sum(r.num_tokens for r in chunk_refs(redis_client, unique_prefix)) == len(PROMPTS[1]) + 10 - 1


def test_buffers_full_drops_rows_and_memory_stays_bounded(tiny_model):
    """A stalled S3 (a fault a healthy test server cannot produce on demand): rows beyond the
    preallocated buffers are dropped and counted; the capture hook never blocks."""
    import threading

    from services.inference.exporter import ChunkExporter
    from tide.engine.engine import CapturedRows

    release = threading.Event()

    class StalledS3:
        def put_object(self, *a, **kw):
            release.wait(10)
            raise ConnectionError("stalled")

    exp = ChunkExporter(StalledS3(), "b", None, "s:chunks", target_model="t", worker_id="w", hidden_size=8,
                        chunk_tokens=16, buffers=2, flush_interval_s=60).start()
    h = 8
    for step in range(10):  # 10 x 8 rows = 80 rows into 2 x 16-row buffers
        rows = CapturedRows("r", "", 4, step * 8, list(range(8)), torch.zeros(8, 3 * h), torch.zeros(8, h))
        exp.add([rows], {"r": 4})
    assert exp.stats.tokens_dropped_full >= 80 - 3 * 16  # at most one buffer in upload + two filled
    release.set()
    exp.stop(timeout_s=10)
    assert exp.stats.chunks_dropped_s3 >= 1 and exp.stats.chunks_written == 0

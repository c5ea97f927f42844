"""Chunk intake of the trainer service with real Redis and S3: accepted chunks are recorded in the
S3 manifest before the ack; corrupt ones are dead-lettered with the reason and never recorded;
duplicates are deduped by chunk id; a dead consumer's pending entry is reclaimed; the manifest
survives a restart."""

from __future__ import annotations

import json
import socket

from grpc_health.v1 import health_pb2, health_pb2_grpc
from trainer.service.svc import bad_shape_blob, chunk_blob, publish, wait_for

from tide import blobs, streams
from tide.grpcutil import channel
from tide.proto.tide.v1 import trainer_pb2, trainer_pb2_grpc


def status(svc) -> trainer_pb2.TrainerStatus:
    return trainer_pb2_grpc.TrainerServiceStub(channel(svc.target)).GetStatus(trainer_pb2.GetTrainerStatusRequest(),
                                                                              timeout=5)


def pending(redis_client, prefix) -> int:
    return redis_client.xpending(streams.StreamNames(prefix).chunks, streams.TRAINER_GROUP)["pending"]


def test_valid_chunks_are_recorded_then_acked(make_trainer, tiny_dir, redis_client, s3_client, s3_bucket,
                                              unique_prefix):
    svc = make_trainer()
    health = health_pb2_grpc.HealthStub(channel(svc.target))
    for name in ("", "tide.v1.TrainerService"):
        assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    target = tiny_dir.name
    refs = [publish(redis_client, s3_client, s3_bucket, unique_prefix, target, f"c{i}", chunk_blob(target, f"c{i}"))
            for i in range(3)]
    st = wait_for(lambda: (s := status(svc)).chunks_consumed == 3 and s, what="3 accepted chunks")
    assert (st.target_model, st.buffered_chunks, st.buffered_tokens) == (target, 3, 3 * 64)
    assert st.state == trainer_pb2.TrainerStatus.STATE_IDLE and st.chunks_dead_lettered == 0
    wait_for(lambda: pending(redis_client, unique_prefix) == 0, what="every entry acked")
    keys = blobs.list_keys(s3_client, s3_bucket, "trainer/targets/")
    assert keys == sorted(svc.manifest.entry_key(target, r.chunk_id) for r in refs)
    entry = json.loads(s3_client.get_object(s3_bucket, keys[0]).read())
    assert entry["sha256"] == refs[0].sha256 and entry["key"] == refs[0].key and entry["num_tokens"] == 64


def test_corrupt_chunks_are_dead_lettered_with_the_reason(make_trainer, tiny_dir, redis_client, s3_client, s3_bucket,
                                                          unique_prefix):
    svc = make_trainer()
    target, names = tiny_dir.name, streams.StreamNames(unique_prefix)
    good = chunk_blob(target, "ok")
    publish(redis_client, s3_client, s3_bucket, unique_prefix, target, "sum", chunk_blob(target, "sum"),
            sha256="0" * 64)
    publish(redis_client, s3_client, s3_bucket, unique_prefix, target, "shape", bad_shape_blob(target, "shape"))
    publish(redis_client, s3_client, s3_bucket, unique_prefix, target, "count", chunk_blob(target, "count"),
            num_tokens=65)
    publish(redis_client, s3_client, s3_bucket, unique_prefix, "other-model", "tgt", chunk_blob(target, "tgt"))
    publish(redis_client, s3_client, s3_bucket, unique_prefix, target, "gone", good, store=False)
    publish(redis_client, s3_client, s3_bucket, unique_prefix, target, "swap", good)  # holds chunk "ok"
    redis_client.xadd(names.chunks, {"type": "chunk_ref", "v": "1", "data": "{not json"})
    publish(redis_client, s3_client, s3_bucket, unique_prefix, target, "ok", good)

    wait_for(lambda: status(svc).chunks_dead_lettered == 7, what="7 dead letters")
    letters = {(d.ref.chunk_id if d.ref else "?"): d.reason
               for d in (streams.decode(f, streams.DeadLetter) for _, f in redis_client.xrange(names.dead_letter))}
    assert "checksum mismatch" in letters["sum"]
    assert "invalid chunk" in letters["shape"] and "aux has shape" in letters["shape"]
    assert "65" in letters["count"] and "target model" in letters["tgt"]
    assert "not found" in letters["gone"] and "unparseable payload" in letters["?"]
    assert "reference names 'swap'" in letters["swap"]
    st = wait_for(lambda: (s := status(svc)).chunks_consumed == 1 and s, what="the good chunk")
    assert st.buffered_chunks == 1 and [e.chunk_id for e in svc.manifest.buffered(target)] == ["ok"]
    assert blobs.list_keys(s3_client, s3_bucket, "trainer/") == [svc.manifest.entry_key(target, "ok")]
    wait_for(lambda: pending(redis_client, unique_prefix) == 0, what="every entry acked")


def test_duplicates_are_deduplicated_by_chunk_id(make_trainer, tiny_dir, redis_client, s3_client, s3_bucket,
                                                 unique_prefix):
    svc = make_trainer()
    target = tiny_dir.name
    blob = chunk_blob(target, "dup")
    for _ in range(3):  # the worker re-announced it (at-least-once)
        publish(redis_client, s3_client, s3_bucket, unique_prefix, target, "dup", blob)
    st = wait_for(lambda: (s := status(svc)).chunks_deduplicated == 2 and s, what="2 duplicates")
    assert (st.chunks_consumed, st.buffered_chunks, st.chunks_dead_lettered) == (1, 1, 0)


def test_dead_consumers_pending_entry_is_reclaimed_and_manifest_survives_restart(
        make_trainer, tiny_dir, redis_client, s3_client, s3_bucket, unique_prefix):
    target, names = tiny_dir.name, streams.StreamNames(unique_prefix)
    redis_client.xgroup_create(names.chunks, streams.TRAINER_GROUP, id="0", mkstream=True)
    publish(redis_client, s3_client, s3_bucket, unique_prefix, target, "lost", chunk_blob(target, "lost"))
    # a trainer that read the entry and died before recording it
    assert redis_client.xreadgroup(streams.TRAINER_GROUP, "dead-trainer", {names.chunks: ">"}, count=1)
    first = make_trainer(claim_idle_ms=300)
    wait_for(lambda: status(first).chunks_consumed == 1, what="the reclaimed chunk")
    assert first.reader.consumer.stats.reclaimed == 1 and pending(redis_client, unique_prefix) == 0
    first.stop(grace_s=0.2)

    second = make_trainer(consumer="t-second")  # a new process: the manifest comes back from S3
    assert [e.chunk_id for e in second.manifest.buffered(target)] == ["lost"]
    publish(redis_client, s3_client, s3_bucket, unique_prefix, target, "lost", chunk_blob(target, "lost"))
    st = wait_for(lambda: (s := status(second)).chunks_deduplicated == 1 and s, what="the re-announced chunk")
    assert (st.chunks_consumed, st.buffered_chunks) == (0, 1)


def test_an_unreachable_store_is_a_transient_failure_not_the_chunks(tiny_dir, s3_client, s3_bucket):
    """The store being down must not dead-letter a chunk (the reader retries it in hand,
    tide.streams.Transient); a blob that is gone from a reachable store is rejected."""
    import pytest
    import urllib3
    from minio import Minio

    from services.trainer.ingest import ChunkIngest
    from services.trainer.manifest import Manifest

    target = tiny_dir.name
    blob = chunk_blob(target, "c0")
    ref = streams.ChunkRef(chunk_id="c0", bucket=s3_bucket, key="chunks/never-stored.safetensors",
                           size_bytes=len(blob), sha256=blobs.sha256_hex(blob), num_tokens=64, target_model=target,
                           draft_version="", workload="test", worker_id="test-worker", created_unix_s=0.0)
    msg = streams.Message("chunks", "1-0", ref, 1)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # a port nothing listens on (bound, never listening)
    down = Minio(f"127.0.0.1:{closed.getsockname()[1]}", access_key="k", secret_key="s", secure=False,
                 http_client=urllib3.PoolManager(retries=False))
    try:
        with pytest.raises(streams.Transient, match="unavailable"):
            ChunkIngest(down, Manifest(down, s3_bucket)).handle(msg)
    finally:
        closed.close()
    with pytest.raises(streams.Reject, match="not found"):
        ChunkIngest(s3_client, Manifest(s3_client, s3_bucket)).handle(msg)

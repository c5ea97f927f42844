"""The trainer's reconciler with real Redis and S3: a chunk blob that no stream entry names (its worker
died between writing the blob and adding its reference) is verified and re-enqueued exactly once,
then accepted into the manifest like any other chunk; a corrupt orphan is dead-lettered with the
reason; blobs that are referenced, dead-lettered or younger than the grace period are left alone,
also by a restarted trainer."""

from __future__ import annotations

import io

from trainer.service.svc import chunk_blob, metric, publish, wait_for

from tide import blobs, streams

WORKER = "crashed-worker"


def orphan(s3_client, bucket: str, target: str, chunk_id: str, blob: bytes) -> str:
    """A blob written the way the exporter writes it, with no XADD after it (the crash)."""
    key = f"chunks/{target}/{WORKER}/{chunk_id}.safetensors"
    blobs.put_bytes(s3_client, bucket, key, blob, metadata={"chunk-id": chunk_id})
    return key


def refs(redis_client, prefix: str) -> list[streams.ChunkRef]:
    return [streams.decode(f, streams.ChunkRef) for _, f in redis_client.xrange(streams.StreamNames(prefix).chunks)]


def letters(redis_client, prefix: str) -> list[streams.DeadLetter]:
    return [streams.decode(f, streams.DeadLetter)
            for _, f in redis_client.xrange(streams.StreamNames(prefix).dead_letter)]


def passes(svc) -> int:
    return svc.reconciler.stats.passes


def test_an_orphan_blob_is_enqueued_once_and_recorded(make_trainer, tiny_dir, redis_client, s3_client, s3_bucket,
                                                       unique_prefix):
    target = tiny_dir.name
    key = orphan(s3_client, s3_bucket, target, "orphan", chunk_blob(target, "orphan", seed=1))
    announced = publish(redis_client, s3_client, s3_bucket, unique_prefix, target, "announced",
                        chunk_blob(target, "announced", seed=2))
    svc = make_trainer(reconcile_interval_s=0.3, reconcile_grace_s=0.5)
    wait_for(lambda: svc.manifest.seen("orphan") and svc.manifest.seen("announced"), what="both chunks recorded")
    n = passes(svc)
    wait_for(lambda: passes(svc) >= n + 3, what="three more reconciler passes")

    keys = [r.key for r in refs(redis_client, unique_prefix)]
    assert keys.count(key) == 1 and keys.count(announced.key) == 1  # enqueued exactly once; the other left alone
    ref = next(r for r in refs(redis_client, unique_prefix) if r.key == key)
    assert (ref.chunk_id, ref.target_model, ref.num_tokens, ref.bucket) == ("orphan", target, 64, s3_bucket)
    assert ref.sha256 == blobs.stat(s3_client, s3_bucket, key).sha256
    assert sorted(e.chunk_id for e in svc.manifest.buffered(target)) == ["announced", "orphan"]
    assert svc.ingest.stats.accepted == 2 and svc.ingest.stats.deduplicated == 0
    assert letters(redis_client, unique_prefix) == []
    assert metric(svc, "tide_trainer_orphan_blobs_total", fate="enqueued") == 1
    assert metric(svc, "tide_trainer_orphan_blobs_total", fate="dead_lettered") == 0

    # a restarted trainer remembers nothing, but finds the entry it added on the stream
    svc.stop(grace_s=0.2)
    again = make_trainer(consumer="t-again", reconcile_interval_s=0.3, reconcile_grace_s=0.5)
    wait_for(lambda: passes(again) >= 3, what="three passes of the restarted trainer")
    assert [r.key for r in refs(redis_client, unique_prefix)].count(key) == 1
    assert again.reconciler.stats.enqueued == 0


def test_a_corrupt_orphan_is_dead_lettered_once(make_trainer, tiny_dir, redis_client, s3_client, s3_bucket,
                                                unique_prefix):
    target = tiny_dir.name
    garbage = orphan(s3_client, s3_bucket, target, "garbage", b"not a safetensors blob" * 10)
    good = chunk_blob(target, "flipped")
    flipped = f"chunks/{target}/{WORKER}/flipped.safetensors"  # stored checksum of other bytes (bit rot)
    s3_client.put_object(s3_bucket, flipped, io.BytesIO(good[:-1] + b"\x00"), len(good),
                         metadata={blobs.SHA256_META: blobs.sha256_hex(good)})
    svc = make_trainer(reconcile_interval_s=0.3, reconcile_grace_s=0.5)
    wait_for(lambda: len(letters(redis_client, unique_prefix)) == 2, what="two dead letters")
    n = passes(svc)
    wait_for(lambda: passes(svc) >= n + 3, what="three more reconciler passes")

    dead = {d.source_id: d for d in letters(redis_client, unique_prefix)}
    assert set(dead) == {garbage, flipped}  # each once
    assert "invalid chunk" in dead[garbage].reason and "checksum mismatch" in dead[flipped].reason
    assert all(d.source_stream == f"s3://{s3_bucket}" and d.consumer.endswith("/reconciler") for d in dead.values())
    assert refs(redis_client, unique_prefix) == [] and not svc.manifest.seen("garbage")
    assert metric(svc, "tide_trainer_orphan_blobs_total", fate="dead_lettered") == 2

    svc.stop(grace_s=0.2)
    again = make_trainer(consumer="t-again", reconcile_interval_s=0.3, reconcile_grace_s=0.5)
    wait_for(lambda: passes(again) >= 3, what="three passes of the restarted trainer")
    assert len(letters(redis_client, unique_prefix)) == 2 and again.reconciler.stats.dead_lettered == 0


def test_young_referenced_and_dead_lettered_blobs_are_left_alone(make_trainer, tiny_dir, redis_client, s3_client,
                                                                s3_bucket, unique_prefix):
    target, names = tiny_dir.name, streams.StreamNames(unique_prefix)
    young = orphan(s3_client, s3_bucket, target, "young", chunk_blob(target, "young"))
    # a chunk the trainer dead-lettered (checksum of its reference wrong): never re-enqueued
    publish(redis_client, s3_client, s3_bucket, unique_prefix, target, "rejected", chunk_blob(target, "rejected"),
            sha256="0" * 64)
    svc = make_trainer(reconcile_interval_s=0.2, reconcile_grace_s=60)  # "young" stays in flight throughout
    wait_for(lambda: len(letters(redis_client, unique_prefix)) == 1, what="the rejected chunk dead-lettered")
    n = passes(svc)
    wait_for(lambda: passes(svc) >= n + 3, what="three more reconciler passes")
    assert [r.chunk_id for r in refs(redis_client, unique_prefix)] == ["rejected"]
    assert svc.reconciler.stats.enqueued == svc.reconciler.stats.dead_lettered == 0
    assert redis_client.xlen(names.dead_letter) == 1 and blobs.stat(s3_client, s3_bucket, young).size_bytes > 0

    svc.stop(grace_s=0.2)
    aged = make_trainer(consumer="t-aged", reconcile_interval_s=0.2, reconcile_grace_s=0.5)
    wait_for(lambda: aged.manifest.seen("young"), what="the blob enqueued once it is older than the grace period")
    assert len(letters(redis_client, unique_prefix)) == 1  # the dead-lettered one stays dead
    assert [r.chunk_id for r in refs(redis_client, unique_prefix)] == ["rejected", "young"]


def test_one_pass_at_a_time_without_intake(tiny_dir, redis_client, s3_client, s3_bucket, unique_prefix):
    """The reconciler alone (no reader: nothing reaches the manifest): what the chunk stream names is
    left alone, an orphan is enqueued once, and a new reconciler finds that entry on the stream."""
    import time

    from services.trainer.manifest import Manifest
    from services.trainer.reconcile import Reconciler

    target, names = tiny_dir.name, streams.StreamNames(unique_prefix)
    key = orphan(s3_client, s3_bucket, target, "lonely", chunk_blob(target, "lonely"))
    named = publish(redis_client, s3_client, s3_bucket, unique_prefix, target, "named", chunk_blob(target, "named"))
    time.sleep(1.5)  # older than the grace period (S3 keeps whole seconds)

    def reconciler() -> Reconciler:
        return Reconciler(s3_client, s3_bucket, redis_client, names, Manifest(s3_client, s3_bucket).load(),
                          interval_s=60, grace_s=0.5)

    first = reconciler()
    assert first.run_once() == 1 and first.stats.last_orphans == 1
    assert first.run_once() == 0 and first.stats.enqueued == 1
    assert [r.key for r in refs(redis_client, unique_prefix)] == [named.key, key]
    second = reconciler()  # a restarted trainer: nothing remembered, the stream read again
    assert second.run_once() == 0 and second.stats.last_orphans == 0
    assert len(refs(redis_client, unique_prefix)) == 2 and letters(redis_client, unique_prefix) == []

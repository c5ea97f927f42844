"""The governed chunk store on a real trainer (gRPC), real Redis and real S3 (SeaweedFS): retention
deletes consumed chunks and trims the stream, a deleted chunk is never resurrected (intake,
reconciler, restart), the byte budget holds under sustained collection, `tidectl data forget`
removes a request's rows (rewriting a shared chunk), a sealed blob with a flipped byte is
quarantined, and a raw sealed blob holds none of its token ids in the clear."""

from __future__ import annotations

import base64
import json
import time

import torch
from support import scan
from trainer.service.svc import HIDDEN, chunk_blob, metric, publish, status, wait_for

from services.gateway.governance import key_id
from services.inference import fleet_memory
from tide import blobs, streams
from tide.chunks import ChunkBuilder, decode_chunk, encode_chunk
from tide.datakeys import Keyring
from tools.admin import cli

KEYS = "k2:" + base64.b64encode(bytes(range(1, 33))).decode() + ",k1:" + base64.b64encode(bytes(range(32))).decode()
HOUR = 3600.0


def request_chunk(target: str, chunk_id: str, requests: dict[str, list[int]], keys: dict[str, str]) -> bytes:
    """A chunk holding one segment per request (its token ids as given), the way the exporter builds it."""
    n = sum(len(v) for v in requests.values())
    b = ChunkBuilder(n, HIDDEN, target, worker_id="w")
    g = torch.Generator().manual_seed(0)
    for rid, ids in requests.items():
        k = len(ids)
        b.append(
            rid,
            torch.tensor(ids),
            torch.arange(k),
            torch.randn(k, 3 * HIDDEN, generator=g).bfloat16(),
            torch.randn(k, HIDDEN, generator=g).bfloat16(),
            key_id=keys.get(rid, ""),
        )
    return encode_chunk(b.flush(chunk_id=chunk_id))


def publish_ref(redis_client, s3_client, bucket, prefix, target, chunk_id, blob, ring: Keyring | None = None):
    """Store (sealed when `ring`) and announce with the chunk's request and key ids, as a worker does."""
    chunk = decode_chunk(blob)
    stored = ring.seal(blob) if ring is not None else blob
    key = f"chunks/{target}/w/{chunk_id}.safetensors"
    info = blobs.put_bytes(s3_client, bucket, key, stored)
    ref = streams.ChunkRef(
        chunk_id=chunk_id,
        bucket=bucket,
        key=key,
        size_bytes=info.size_bytes,
        sha256=info.sha256,
        num_tokens=chunk.num_tokens,
        target_model=target,
        draft_version="",
        workload="",
        worker_id="w",
        created_unix_s=time.time(),
        request_ids=list(chunk.meta.request_ids),
        key_ids=list(chunk.meta.key_ids),
        data_key_id=ring.current if ring is not None else "",
    )
    streams.add(redis_client, streams.StreamNames(prefix).chunks, ref)
    return ref


def test_retention_deletes_consumed_chunks_trims_and_never_resurrects(
    make_trainer, tiny_dir, redis_client, s3_client, s3_bucket, unique_prefix
):
    target = tiny_dir.name
    svc = make_trainer(
        sweep_interval_s=0,
        chunk_retention_h=1.0,
        chunk_unconsumed_retention_h=100.0,
        reconcile_interval_s=0.3,
        reconcile_grace_s=0.0,
    )
    refs = []
    for i in range(3):
        refs.append(
            publish(
                redis_client, s3_client, s3_bucket, unique_prefix, target, f"c{i}", chunk_blob(target, f"c{i}", seed=i)
            )
        )
        time.sleep(0.01)  # entry ids a few ms apart
    wait_for(lambda: svc.manifest.buffered_totals(target)[0] == 3, what="three chunks buffered")
    consumed = svc.manifest.buffered(target)[:2]
    svc.manifest.record_run(target, "run-1", consumed, {"result": "registered"})
    names = streams.StreamNames(unique_prefix)
    assert redis_client.xlen(names.chunks) == 3

    assert svc.governor.sweep(now=time.time() + 0.5 * HOUR) == {}  # nothing old enough yet
    done = svc.governor.sweep(now=time.time() + 2 * HOUR)
    assert done == {"retention_consumed": 2}
    keys = blobs.list_keys(s3_client, s3_bucket, "chunks/")
    assert keys == [refs[2].key]  # the unconsumed one stays (its retention is 100 h)
    assert redis_client.xlen(names.chunks) == 1  # acked entries older than the retention trimmed
    assert [e.chunk_id for e in svc.manifest.trained(target)] == []  # replay no longer offers them
    assert metric(svc, "tide_trainer_chunks_deleted_total", reason="retention_consumed") == 2
    assert dict(status(svc).chunks_deleted) == {"retention_consumed": 2}

    # never resurrected: a late duplicate reference, a blob restored by an interrupted deletion, a restart
    streams.add(redis_client, names.chunks, refs[0])
    wait_for(lambda: svc.ingest.stats.deleted == 1, what="the stale reference skipped")
    blobs.put_bytes(s3_client, s3_bucket, refs[1].key, chunk_blob(target, "c1", seed=1))
    n = svc.reconciler.stats.passes
    wait_for(lambda: svc.reconciler.stats.passes >= n + 2, what="two reconciler passes")
    assert svc.reconciler.stats.enqueued == 0 and svc.manifest.buffered_totals(target)[0] == 1
    svc.stop(grace_s=0.1)
    again = make_trainer(sweep_interval_s=0, chunk_retention_h=1.0, reconcile_interval_s=0)
    assert again.manifest.is_deleted("c0") and again.manifest.is_deleted("c1")
    assert {e.chunk_id for e in again.manifest.buffered(target)} == {"c2"}
    again.governor.sweep()
    assert blobs.list_keys(s3_client, s3_bucket, "chunks/") == [refs[2].key]  # the restored blob went too


def test_the_byte_budget_holds_under_sustained_collection(
    make_trainer, tiny_dir, redis_client, s3_client, s3_bucket, unique_prefix
):
    target = tiny_dir.name
    size = len(chunk_blob(target, "probe"))
    budget = 3 * size + size // 2
    svc = make_trainer(sweep_interval_s=0.2, chunk_bucket_bytes=budget, reconcile_interval_s=0)
    peak = 0
    for i in range(12):  # a chunk every ~0.1 s: several arrive between sweeps
        publish(redis_client, s3_client, s3_bucket, unique_prefix, target, f"b{i:02d}", chunk_blob(target, f"b{i:02d}"))
        time.sleep(0.1)
        if i % 4 == 3:
            svc.governor.sweep()
            stored = sum(o.size for o in s3_client.list_objects(s3_bucket, prefix="chunks/", recursive=True))
            assert stored <= budget
            peak = max(peak, stored)
    svc.governor.sweep()
    left = sorted(k.rsplit("/", 1)[-1] for k in blobs.list_keys(s3_client, s3_bucket, "chunks/"))
    assert left == ["b09.safetensors", "b10.safetensors", "b11.safetensors"]  # the newest kept, oldest gone
    assert svc.governor.stats.deleted["budget"] == 9 and peak <= budget
    stored = sum(o.size for o in s3_client.list_objects(s3_bucket, prefix="chunks/", recursive=True))
    assert metric(svc, "tide_trainer_bucket_chunk_bytes") == stored <= budget
    assert status(svc).bucket_budget_bytes == budget


def test_forget_removes_a_requests_rows(
    make_trainer, tiny_dir, redis_client, s3_client, s3_bucket, unique_prefix, trainer_storage, capsys
):
    target = tiny_dir.name
    ring = Keyring.parse(KEYS)
    alice, bob = key_id("alice-key"), key_id("bob-key")
    a0, b0, a1 = [11, 12, 13, 14, 15, 16], [70, 71, 72, 73], [21, 22, 23, 24, 25]
    shared = request_chunk(
        target, "shared", {"chatcmpl-a-0": a0, "chatcmpl-b-0": b0}, {"chatcmpl-a-0": alice, "chatcmpl-b-0": bob}
    )
    only_a = request_chunk(target, "only-a", {"chatcmpl-a-1": a1}, {"chatcmpl-a-1": alice})
    storage = trainer_storage.model_copy(update={"data_keys": KEYS})
    svc = make_trainer(storage=storage, sweep_interval_s=0, reconcile_interval_s=0)
    for cid, blob in (("shared", shared), ("only-a", only_a)):
        publish_ref(redis_client, s3_client, s3_bucket, unique_prefix, target, cid, blob, ring)
    wait_for(lambda: svc.manifest.buffered_totals(target)[0] == 2, what="both chunks recorded")
    raw = scan.s3_objects(s3_client, s3_bucket)
    assert not [k for k, b in raw.items() if k.startswith("chunks/") and scan.holds(b, a0[:3])]  # sealed at rest
    # what the fleet's speculation memory holds of them: entries naming their owners
    memory, forget = streams.StreamNames(unique_prefix).memory, streams.StreamNames(unique_prefix).forget
    for rid, scope in (("chatcmpl-a-0", ""), ("chatcmpl-b-0", bob), ("chatcmpl-a-1", ""), ("chatcmpl-b-1", bob)):
        owner = alice if rid.startswith("chatcmpl-a") else bob
        streams.add(redis_client, memory, fleet_memory.entry("w1", target, scope, [1, 2], [3, 4], owner, rid, ring))

    code = cli.main(
        [
            "data",
            "forget",
            "--request-id",
            "chatcmpl-a",
            "--trainer",
            svc.target,
            "--token",
            "test-admin-token",
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["chunks_deleted"] == ["only-a"] and report["chunks_rewritten"] == ["shared"]
    assert int(report["rows_removed"]) == len(a0) + len(a1)
    assert sorted(report["requests_removed"]) == ["chatcmpl-a-0", "chatcmpl-a-1"]
    assert report["memory_notice"] is True  # the workers' in-RAM memories are told, on the forget stream
    [(_, fields)] = redis_client.xrange(forget)
    notice = streams.decode(fields, streams.ForgetNotice)
    assert (notice.request_id, notice.key_id) == ("chatcmpl-a", "")
    left = [streams.decode(f, streams.MemoryEntry).request_id for _, f in redis_client.xrange(memory)]
    assert left == ["chatcmpl-b-0", "chatcmpl-b-1"]  # each of the request's choices went from the fleet's stream
    keys = blobs.list_keys(s3_client, s3_bucket, "chunks/")
    assert all("only-a" not in k for k in keys)
    [entry] = svc.manifest.buffered(target)
    rest = decode_chunk(blobs.get_bytes(s3_client, s3_bucket, entry.key, expected_sha256=entry.sha256), keyring=ring)
    assert rest.input_ids.tolist() == b0 and list(rest.meta.request_ids) == ["chatcmpl-b-0"]
    assert entry.request_ids == ["chatcmpl-b-0"] and entry.num_tokens == len(b0) and entry.data_key_id == "k2"
    # a chunk still in some worker's spool arrives later: rewritten (here: deleted) as it is recorded
    late = request_chunk(target, "late", {"chatcmpl-a-2": [31, 32, 33]}, {"chatcmpl-a-2": alice})
    publish_ref(redis_client, s3_client, s3_bucket, unique_prefix, target, "late", late, ring)
    wait_for(lambda: svc.manifest.is_deleted("late"), what="the late chunk forgotten on arrival")
    # forget by key id: bob's rows, the last ones, and his entries in the fleet's speculation memory
    memory = streams.StreamNames(unique_prefix).memory
    streams.add(redis_client, memory, fleet_memory.entry("w1", target, bob, [1, 2], [3, 4], "", "", ring))  # by scope
    streams.add(redis_client, memory, fleet_memory.entry("w1", target, alice, [1, 2], [3, 4], alice, "r", ring))
    assert cli.main(["data", "forget", "--key-id", bob, "--trainer", svc.target, "--token", "test-admin-token"]) == 0
    assert "memories told to drop them" in capsys.readouterr().out
    left = [streams.decode(f, streams.MemoryEntry).scope for _, f in redis_client.xrange(memory)]
    assert left == [alice]
    assert streams.decode(redis_client.xrange(forget)[-1][1], streams.ForgetNotice).key_id == bob
    assert blobs.list_keys(s3_client, s3_bucket, "chunks/") == []
    assert svc.governor.stats.deleted["forget"] == 3


def test_a_flipped_byte_is_quarantined(
    make_trainer, tiny_dir, redis_client, s3_client, s3_bucket, unique_prefix, trainer_storage
):
    target = tiny_dir.name
    ring = Keyring.parse(KEYS)
    sealed = bytearray(ring.seal(chunk_blob(target, "tampered")))
    sealed[len(sealed) // 2] ^= 0x01  # one bit of the ciphertext; the reference's SHA-256 is of these bytes
    storage = trainer_storage.model_copy(update={"data_keys": KEYS})
    svc = make_trainer(storage=storage, sweep_interval_s=0, reconcile_interval_s=0)
    publish(redis_client, s3_client, s3_bucket, unique_prefix, target, "tampered", bytes(sealed), num_tokens=64)
    publish(
        redis_client,
        s3_client,
        s3_bucket,
        unique_prefix,
        target,
        "fine",
        ring.seal(chunk_blob(target, "fine")),
        num_tokens=64,
    )
    wait_for(lambda: svc.manifest.seen("fine") and svc.ingest.stats.quarantined == 1, what="intake")
    letters = [
        streams.decode(f, streams.DeadLetter)
        for _, f in redis_client.xrange(streams.StreamNames(unique_prefix).dead_letter)
    ]
    assert [d.ref.chunk_id for d in letters] == ["tampered"] and letters[0].reason.startswith("quarantined")
    assert not svc.manifest.seen("tampered") and status(svc).chunks_quarantined == 1
    assert metric(svc, "tide_trainer_chunks_quarantined_total") == 1
    assert [e.chunk_id for e in svc.manifest.buffered(target)] == ["fine"]


def test_a_drafts_card_says_what_traffic_trained_it(tiny_dir):
    from services.trainer.cycle import TrainingCycle
    from services.trainer.governance import Policy
    from services.trainer.manifest import ManifestEntry
    from services.trainer.settings import TrainerSettings

    def entry(cid, t, rids, n):
        return ManifestEntry(chunk_id=cid, bucket="b", key=f"chunks/{cid}", sha256="0" * 64, size_bytes=1,
                             num_tokens=n, target_model="t", draft_version="", workload="", worker_id="w",
                             created_unix_s=t, added_unix_s=t, request_ids=rids, key_ids=["k"] * len(rids),
                             data_key_id="k2")

    policy = Policy(retention_s=24 * HOUR, unconsumed_retention_s=168 * HOUR, budget_bytes=1 << 30)
    cycle = TrainingCycle(TrainerSettings(target=str(tiny_dir)), None, None, None, policy=policy)
    doc = cycle._data_provenance([entry("a", 100.0, ["chatcmpl-x-0", "chatcmpl-x-1", "cmpl-y-0"], 50)],
                                 [entry("b", 40.0, ["cmpl-z-0"], 30)])
    assert doc["first_collected_unix_s"] == 40.0 and doc["last_collected_unix_s"] == 100.0
    assert doc["requests"] == 3 and doc["tokens"] == 80 and doc["new_tokens"] == 50 and doc["encrypted"]
    assert doc["retention"] == {"consumed_retention_h": 24.0, "unconsumed_retention_h": 168.0,
                                "bucket_budget_bytes": 1 << 30}

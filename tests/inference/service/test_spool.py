"""The exporter's on-disk spool with real Redis and S3: chunks whose S3 write fails are spooled and
uploaded (oldest first) once S3 is back, none lost; a full spool evicts its oldest chunks for new
ones and counts them; a restarted worker re-sends what its predecessor spooled, chunks and refs that
were waiting for Redis alike."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from inference.service.svc import closed_port_url, request, run_stream, storage, stub, wait_for
from prometheus_client import REGISTRY

from tide import blobs, streams
from tide.chunks import decode_chunk
from tide.servers import S3Server

PROMPT = [5, 9, 14, 5, 9, 14, 5, 9]


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def rows(max_tokens: int) -> int:
    """Rows one request exports: every token the target processed (prompt + output - the last)."""
    return len(PROMPT) + max_tokens - 1


def chunk_refs(redis_client, prefix: str) -> list[streams.ChunkRef]:
    return [streams.decode(f, streams.ChunkRef) for _, f in redis_client.xrange(streams.StreamNames(prefix).chunks)]


def spool_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


def assert_all_stored(s3_client, bucket: str, refs: list[streams.ChunkRef]) -> None:
    """Every ref's blob is in S3, verifies against the ref and decodes to the chunk it names."""
    assert len({r.chunk_id for r in refs}) == len(refs)
    for ref in refs:
        data = blobs.get_bytes(s3_client, bucket, ref.key, expected_sha256=ref.sha256)
        chunk = decode_chunk(data, expected_target="tiny-llama-0")
        assert (chunk.meta.chunk_id, chunk.num_tokens, len(data)) == (ref.chunk_id, ref.num_tokens, ref.size_bytes)


def test_chunks_exported_during_an_s3_outage_arrive_when_it_returns(make_service, redis_server, redis_client,
                                                                     unique_prefix, tmp_path):
    spool = tmp_path / "spool"
    spooled_before = metric("tide_chunks_spooled_total")
    with S3Server(workdir=tmp_path / "s3", stop_timeout_s=2.0) as s3:
        s3_client = s3.endpoint.client()
        s3_client.make_bucket("outage")
        st = storage(redis_server.url, s3.endpoint.endpoint, s3.access_key, s3.secret_key, "outage", unique_prefix)
        svc = make_service(storage=st, collection=True, chunk_tokens=16, flush_interval_s=0.2,
                           chunk_spool_dir=str(spool))
        client = stub(svc)
        run_stream(client, request("before", PROMPT, max_tokens=12))
        wait_for(lambda: sum(r.num_tokens for r in chunk_refs(redis_client, unique_prefix)) == rows(12),
                 what="the chunks exported before the outage")
        announced = len(chunk_refs(redis_client, unique_prefix))

        s3.stop(timeout_s=2.0)  # the work dir (the data) stays for the restart
        tokens, _, last = run_stream(client, request("during", PROMPT, max_tokens=40))
        assert len(tokens) == 40 and last.HasField("final")  # serving never waits on S3
        svc.exporter.flush_soon()
        assert svc.exporter.wait_idle(20)
        wait_for(lambda: svc.exporter.stats.tokens_spooled == rows(40), what="every row of the outage spooled")
        assert svc.exporter.stats.chunks_spooled >= 3 and svc.exporter.stats.chunks_dropped_s3 == 0
        assert len(chunk_refs(redis_client, unique_prefix)) == announced  # never a ref without its blob
        names = spool_files(spool)
        assert sum(n.endswith(".safetensors") for n in names) == svc.exporter.stats.chunks_spooled
        assert metric("tide_chunks_spooled_total") - spooled_before == svc.exporter.stats.chunks_spooled

        s3.restart()  # same port, same data
        refs = wait_for(lambda: (r := chunk_refs(redis_client, unique_prefix))
                        and sum(x.num_tokens for x in r) >= rows(12) + rows(40) and r,
                        timeout_s=40, what="the spooled chunks uploaded and announced")
        assert sum(r.num_tokens for r in refs) == rows(12) + rows(40)  # none lost, none twice
        assert sorted(blobs.list_keys(s3_client, "outage", "chunks/")) == sorted(r.key for r in refs)
        assert_all_stored(s3_client, "outage", refs)
        created = [r.created_unix_s for r in refs[announced:]]
        assert created == sorted(created)  # oldest first
        wait_for(lambda: spool_files(spool) == [] and svc.exporter.spool.bytes == 0, what="an empty spool")
        assert svc.exporter.stats.chunks_unspooled == svc.exporter.stats.chunks_spooled
        svc.stop(grace_s=0.5)


def test_chunks_exported_while_s3_hangs_arrive_when_it_resumes(make_service, redis_server, redis_client,
                                                               unique_prefix, tmp_path):
    """SIGSTOP: S3's port still accepts connections but nothing answers. The write in flight times out
    (10 s) and is spooled, later chunks are spooled behind it, the unspooler's retries hang on their
    own thread; after SIGCONT everything arrives."""
    spool = tmp_path / "spool"
    with S3Server(workdir=tmp_path / "s3", stop_timeout_s=2.0) as s3:
        s3.endpoint.client().make_bucket("hung")
        st = storage(redis_server.url, s3.endpoint.endpoint, s3.access_key, s3.secret_key, "hung", unique_prefix)
        svc = make_service(storage=st, collection=True, chunk_tokens=16, chunk_buffers=16, flush_interval_s=0.2,
                           chunk_spool_dir=str(spool))
        os.killpg(s3.pid, signal.SIGSTOP)
        try:
            tokens, _, last = run_stream(stub(svc), request("hung", PROMPT, max_tokens=40))
            assert len(tokens) == 40 and last.HasField("final")
            svc.exporter.flush_soon()
            assert svc.exporter.wait_idle(30)
            wait_for(lambda: svc.exporter.stats.tokens_spooled == rows(40), timeout_s=30,
                     what="every row spooled while S3 hangs")
            assert svc.exporter.stats.tokens_dropped_full == 0 and chunk_refs(redis_client, unique_prefix) == []
        finally:
            os.killpg(s3.pid, signal.SIGCONT)
        refs = wait_for(lambda: (r := chunk_refs(redis_client, unique_prefix))
                        and sum(x.num_tokens for x in r) >= rows(40) and r, timeout_s=40,
                        what="the spooled chunks uploaded once S3 resumed")
        assert sum(r.num_tokens for r in refs) == rows(40)
        assert_all_stored(s3.endpoint.client(), "hung", refs)
        wait_for(lambda: spool_files(spool) == [], what="an empty spool")
        svc.stop(grace_s=0.5)


def test_a_full_spool_evicts_its_oldest_chunks_and_counts(make_service, redis_server, redis_client, unique_prefix,
                                                          tmp_path):
    st = storage(redis_server.url, closed_port_url(), "k", "s", "bucket", unique_prefix)
    spool, cap = tmp_path / "spool", 25_000  # about two of these chunks (16 rows: ~10 KB) fit
    evicted_before = metric("tide_chunks_dropped_total", reason="spool_evicted")
    deleted_before = metric("tide_chunk_spool_deleted_total", reason="budget")
    svc = make_service(storage=st, collection=True, chunk_tokens=16, chunk_buffers=8, flush_interval_s=0.2,
                       chunk_spool_dir=str(spool), chunk_spool_bytes=cap)
    run_stream(stub(svc), request("r1", PROMPT, max_tokens=60))
    svc.exporter.flush_soon()
    assert svc.exporter.wait_idle(20)
    stats = svc.exporter.stats
    # (the first failing S3 call takes a while: rows beyond the 8 buffers are dropped meanwhile)
    wait_for(lambda: stats.tokens_spooled + stats.tokens_dropped_full == rows(60), what="every row spooled or dropped")
    assert stats.chunks_spooled >= 3 and stats.chunks_evicted_spool >= 1 and stats.chunks_dropped_spool_full == 0
    assert stats.chunks_dropped_s3 == stats.chunks_evicted_spool  # evicted: the only way a spooled chunk is lost
    assert metric("tide_chunks_dropped_total", reason="spool_evicted") - evicted_before == stats.chunks_evicted_spool
    assert metric("tide_chunk_spool_deleted_total", reason="budget") - deleted_before == stats.chunks_evicted_spool
    assert svc.exporter.spooled_chunks == stats.chunks_spooled - stats.chunks_evicted_spool
    on_disk = sum(p.stat().st_size for p in spool.iterdir())
    assert on_disk == svc.exporter.spool.bytes <= cap
    assert redis_client.xlen(streams.StreamNames(unique_prefix).chunks) == 0


def test_the_spool_keeps_the_newest_chunks_within_its_budget(tmp_path):
    """Oldest first, without servers: S3 refuses every write; six chunks arrive one by one at a spool
    that holds two and a half. The newest ones stay, the oldest are evicted and counted; none is
    dropped for want of room."""
    import time

    import torch

    from services.inference.exporter import ChunkExporter
    from tide.engine.engine import CapturedRows

    class RefusingS3:
        def put_object(self, *a, **kw):
            raise ConnectionError("S3 is down")

    exp = ChunkExporter(RefusingS3(), "b", None, "s:chunks", target_model="t", worker_id="w", hidden_size=8,
                        chunk_tokens=16, buffers=2, flush_interval_s=60, spool_dir=tmp_path / "spool",
                        spool_max_bytes=1 << 30).start()
    deleted_before = metric("tide_chunk_spool_deleted_total", reason="budget")
    bytes_before = metric("tide_chunk_spool_deleted_bytes_total", reason="budget")

    def add_chunk(i: int) -> None:
        rows_ = CapturedRows(f"r{i}", "", 4, 0, list(range(16)), torch.zeros(16, 3 * 8), torch.zeros(16, 8))
        exp.add([rows_], {f"r{i}": 4})  # 16 rows: one full chunk, written (spooled) by the flusher
        deadline = time.monotonic() + 10
        while exp.stats.chunks_spooled < i + 1:
            assert time.monotonic() < deadline, "the chunk was never spooled"
            time.sleep(0.01)

    try:
        add_chunk(0)
        one = exp.spool.bytes
        exp.spool.max_bytes = cap = int(2.5 * one)
        for i in range(1, 6):
            add_chunk(i)
            assert exp.spool.bytes <= cap
        kept = [e.ref.request_ids for e in exp._backlog]
        assert kept[-2:] == [["r4"], ["r5"]], kept  # the newest stay, in order
        assert exp.stats.chunks_dropped_spool_full == 0
        assert exp.stats.chunks_evicted_spool == 6 - len(kept) >= 3
        assert exp.stats.chunks_dropped_s3 == exp.stats.chunks_evicted_spool
        deleted = metric("tide_chunk_spool_deleted_total", reason="budget") - deleted_before
        assert deleted == exp.stats.chunks_evicted_spool
        assert metric("tide_chunk_spool_deleted_bytes_total", reason="budget") - bytes_before \
            == exp.stats.bytes_evicted_spool >= 3 * one * 0.9
        on_disk = sorted(p.name for p in (tmp_path / "spool").iterdir() if p.name.endswith(".safetensors"))
        assert len(on_disk) == len(kept)
    finally:
        exp.stop(timeout_s=5)


def served_while_s3_is_unreachable(make_service, redis_server, s3_server, s3_bucket, unique_prefix, spool):
    """A worker whose S3 address answers nothing serves 30 tokens with collection on and stops: its
    chunks, the last partial one included (spooled on the way out), are in `spool`."""
    down = storage(redis_server.url, closed_port_url(), s3_server.access_key, s3_server.secret_key, s3_bucket,
                   unique_prefix)
    first = make_service(storage=down, collection=True, chunk_tokens=16, flush_interval_s=0.2,
                         chunk_spool_dir=str(spool))
    run_stream(stub(first), request("r1", PROMPT, max_tokens=30))
    first.stop(grace_s=0.5)
    return first


def test_a_restarted_worker_resends_its_spooled_chunks(make_service, real_storage, redis_server, redis_client,
                                                       s3_server, s3_client, s3_bucket, unique_prefix, tmp_path):
    spool = tmp_path / "spool"
    first = served_while_s3_is_unreachable(make_service, redis_server, s3_server, s3_bucket, unique_prefix, spool)
    assert first.exporter.stats.tokens_spooled == rows(30) and first.exporter.stats.chunks_dropped_s3 == 0
    entries = [json.loads((spool / n).read_text()) for n in spool_files(spool) if n.endswith(".json")]
    assert len(entries) == first.exporter.stats.chunks_spooled >= 2
    assert all(e["state"] == "blob" and e["ref"]["worker_id"] == "test-worker" for e in entries)
    assert redis_client.xlen(streams.StreamNames(unique_prefix).chunks) == 0

    second = make_service(storage=real_storage, collection=False, chunk_spool_dir=str(spool))
    refs = wait_for(lambda: (r := chunk_refs(redis_client, unique_prefix))
                    and sum(x.num_tokens for x in r) >= rows(30) and r, timeout_s=20,
                    what="the previous run's chunks re-sent")
    assert sum(r.num_tokens for r in refs) == rows(30)
    assert sorted(r.chunk_id for r in refs) == sorted(e["ref"]["chunk_id"] for e in entries)
    assert sorted(blobs.list_keys(s3_client, s3_bucket, "chunks/")) == sorted(r.key for r in refs)
    assert_all_stored(s3_client, s3_bucket, refs)
    wait_for(lambda: spool_files(spool) == [], what="an empty spool")
    assert second.exporter.stats.chunks_unspooled == len(refs)


def served_while_redis_is_unreachable(make_service, s3_server, s3_client, s3_bucket, unique_prefix, spool):
    """(the stopped service, the keys of its blobs): a 30-token request served with collection on, S3
    up and Redis unreachable, so its chunks are stored and their refs wait in `spool`."""
    no_redis = storage(f"redis://{closed_port_url()}/0", s3_server.endpoint, s3_server.access_key,
                       s3_server.secret_key, s3_bucket, unique_prefix)
    first = make_service(storage=no_redis, collection=True, chunk_tokens=16, flush_interval_s=0.2,
                         chunk_spool_dir=str(spool))
    run_stream(stub(first), request("r1", PROMPT, max_tokens=30))
    first.stop(grace_s=0.5)
    return first, blobs.list_keys(s3_client, s3_bucket, "chunks/")


def test_refs_waiting_for_redis_survive_a_restart(make_service, real_storage, s3_server, s3_client, s3_bucket,
                                                  redis_client, unique_prefix, tmp_path):
    spool = tmp_path / "spool"
    first, keys = served_while_redis_is_unreachable(make_service, s3_server, s3_client, s3_bucket, unique_prefix,
                                                    spool)
    assert len(keys) >= 2 and first.exporter.stats.chunks_written == 0  # blobs stored, refs not announced
    entries = [json.loads((spool / n).read_text()) for n in spool_files(spool)]
    assert sorted(e["ref"]["key"] for e in entries) == keys and {e["state"] for e in entries} == {"ref"}

    second = make_service(storage=real_storage, collection=False, chunk_spool_dir=str(spool))
    refs = wait_for(lambda: (r := chunk_refs(redis_client, unique_prefix)) and len(r) >= len(keys) and r,
                    timeout_s=20, what="the previous run's refs announced")
    assert sorted(r.key for r in refs) == keys and sum(r.num_tokens for r in refs) == rows(30)
    assert_all_stored(s3_client, s3_bucket, refs)
    wait_for(lambda: spool_files(spool) == [], what="an empty spool")
    assert second.exporter.stats.chunks_written == len(keys)


def test_blobs_stored_by_a_worker_killed_before_their_refs_are_announced_by_its_successor(
        make_service, real_storage, s3_server, s3_client, s3_bucket, redis_client, unique_prefix, tmp_path):
    """A SIGKILL between a chunk's S3 write and its XADD leaves an "intent" entry and a stored blob
    (the state is made here from a real run's entries, as a kill cannot be timed into that gap); a
    kill before the write finished leaves an intent and no blob. The next worker on the spool
    announces the first kind and drops the second."""
    spool = tmp_path / "spool"
    _, keys = served_while_redis_is_unreachable(make_service, s3_server, s3_client, s3_bucket, unique_prefix, spool)
    names = [n for n in spool_files(spool) if n.endswith(".json")]
    assert len(keys) >= 2 and len(names) == len(keys)
    for n in names:  # what the kill leaves: the intent written before the blob, never turned into a ref
        entry = json.loads((spool / n).read_text())
        (spool / n).write_text(json.dumps({**entry, "state": "intent"}))
    unstored = {**entry, "state": "intent",
                "ref": {**entry["ref"], "chunk_id": "never-stored", "key": entry["ref"]["key"] + ".never"}}
    (spool / "000000000999-never-stored.json").write_text(json.dumps(unstored))

    make_service(storage=real_storage, collection=False, chunk_spool_dir=str(spool))
    refs = wait_for(lambda: (r := chunk_refs(redis_client, unique_prefix)) and len(r) >= len(keys) and r,
                    timeout_s=20, what="the stored blobs announced")
    wait_for(lambda: spool_files(spool) == [], what="an empty spool")
    assert sorted(r.key for r in chunk_refs(redis_client, unique_prefix)) == keys  # the unstored one is not
    assert sum(r.num_tokens for r in refs) == rows(30)
    assert_all_stored(s3_client, s3_bucket, refs)


def test_a_corrupt_spool_entry_is_dropped_and_counted_the_rest_resent(make_service, real_storage, redis_server,
                                                                       redis_client, s3_server, s3_client,
                                                                       s3_bucket, unique_prefix, tmp_path):
    spool = tmp_path / "spool"
    served_while_s3_is_unreachable(make_service, redis_server, s3_server, s3_bucket, unique_prefix, spool)
    blob_files = sorted(p for p in spool.iterdir() if p.suffix == ".safetensors")
    assert len(blob_files) >= 2
    rotten = blob_files[0]
    data = bytearray(rotten.read_bytes())
    data[-1] ^= 0xFF  # bit rot: same size, other bytes
    rotten.write_bytes(bytes(data))
    (spool / ".000000000099-x.safetensors.tmp").write_bytes(b"half")  # a write a crash interrupted
    (spool / "000000000099-x.safetensors").write_bytes(b"no json")  # a blob whose entry was never committed
    corrupt_before = metric("tide_chunks_dropped_total", reason="spool_corrupt")

    second = make_service(storage=real_storage, collection=False, chunk_spool_dir=str(spool))
    wait_for(lambda: spool_files(spool) == [], timeout_s=20, what="the spool worked off")
    refs = chunk_refs(redis_client, unique_prefix)
    assert len(refs) == len(blob_files) - 1 and rotten.stem.split("-", 1)[1] not in {r.chunk_id for r in refs}
    assert sorted(blobs.list_keys(s3_client, s3_bucket, "chunks/")) == sorted(r.key for r in refs)
    assert_all_stored(s3_client, s3_bucket, refs)
    assert metric("tide_chunks_dropped_total", reason="spool_corrupt") - corrupt_before == 1
    assert second.exporter.stats.chunks_dropped_s3 == 1

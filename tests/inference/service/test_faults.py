"""Telemetry on the real stream, and serving through Redis / S3 outages (real servers stopped, or
closed ports): requests succeed, drop counters move, publishing resumes when Redis returns."""

from __future__ import annotations

import redis
from inference.service.svc import closed_port_url, request, run_stream, step_records, storage, stub, wait_for
from prometheus_client import REGISTRY

from tide import streams
from tide.servers import RedisServer

PROMPT = [5, 9, 14, 5, 9, 14, 5, 9]


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_step_records_arrive_on_the_telemetry_stream(make_service, redis_client, unique_prefix):
    svc = make_service()
    tokens, _, last = run_stream(stub(svc), request("t1", PROMPT, max_tokens=25, workload="gsm8k"))
    # the last step's record may still be on its way when the stream's final event arrives
    recs = wait_for(lambda: (r := step_records(redis_client, unique_prefix)) and svc.telemetry.buffered == 0
                    and 1 + sum(x.emitted_tokens for x in r if "t1" in x.request_ids) >= len(tokens) and r,
                    what="step records of every emitted token")
    assert all(r.worker_id == "test-worker" and r.target_model == "tiny-llama-0" for r in recs)
    assert [r.step for r in recs] == sorted(r.step for r in recs)
    mine = [r for r in recs if "t1" in r.request_ids]
    assert all(r.workload == ["gsm8k"] * r.batch_size and r.drafter == "ngram" for r in mine)
    # the first token comes from prefill; every decode step emits accepted + 1
    assert 1 + sum(r.emitted_tokens for r in mine) == len(tokens) == 25
    assert sum(r.prefill_tokens for r in recs) == len(PROMPT)
    assert svc.telemetry.stats.published == len(recs) and svc.telemetry.stats.dropped == 0


def test_redis_unreachable_keeps_serving_and_drops_oldest(make_service, s3_server, s3_bucket, unique_prefix):
    st = storage(f"redis://{closed_port_url()}/0", s3_server.endpoint, s3_server.access_key, s3_server.secret_key,
                 s3_bucket, unique_prefix)
    dropped_before = metric("tide_telemetry_records_dropped_total")
    svc = make_service(storage=st, telemetry_buffer=4, collection=True, flush_interval_s=0.2)
    tokens, _, last = run_stream(stub(svc), request("r1", PROMPT, max_tokens=30))
    assert len(tokens) == 30 and last.HasField("final")
    wait_for(lambda: svc.telemetry.stats.errors > 0, what="a failed publish")
    assert svc.telemetry.buffered <= 4
    assert svc.telemetry.stats.dropped > 0 and svc.telemetry.stats.published == 0
    assert metric("tide_telemetry_records_dropped_total") - dropped_before == svc.telemetry.stats.dropped
    # chunk blobs are written (S3 is up) but their refs wait for Redis
    wait_for(lambda: svc.exporter.stats.redis_errors > 0, what="a failed chunk-ref XADD")
    assert svc.exporter.pending_refs >= 1 and svc.exporter.stats.chunks_written == 0


def test_redis_restart_recovers(make_service, s3_server, s3_bucket, unique_prefix, tmp_path):
    server = RedisServer(workdir=tmp_path / "redis").start()
    try:
        st = storage(server.url, s3_server.endpoint, s3_server.access_key, s3_server.secret_key, s3_bucket,
                     unique_prefix)
        svc = make_service(storage=st, collection=True, flush_interval_s=0.2)
        client = stub(svc)
        names = streams.StreamNames(unique_prefix)
        run_stream(client, request("before", PROMPT, max_tokens=10))
        wait_for(lambda: svc.telemetry.stats.published > 0, what="telemetry before the outage")
        server.stop()
        published = svc.telemetry.stats.published
        tokens, _, last = run_stream(client, request("during", PROMPT, max_tokens=20))
        assert len(tokens) == 20 and last.HasField("final")
        wait_for(lambda: svc.telemetry.stats.errors > 0 and svc.exporter.pending_refs > 0, what="failures")
        server.start()  # same port, empty data set
        r = redis.Redis.from_url(server.url)
        # records buffered during the outage are sent once Redis is back
        wait_for(lambda: any("during" in streams.decode(f, streams.StepRecord).request_ids
                             for _, f in r.xrange(names.telemetry)), timeout_s=20, what="telemetry after the outage")
        wait_for(lambda: r.xlen(names.chunks) > 0 and svc.exporter.pending_refs == 0, timeout_s=20,
                 what="chunk refs announced after Redis came back")
        assert svc.telemetry.stats.published > published
    finally:
        server.stop()


def test_s3_unreachable_keeps_serving_and_drops_chunks(make_service, redis_server, redis_client, unique_prefix):
    """Without a spool (TIDE_CHUNK_SPOOL_BYTES=0) chunks are dropped at once; with one: test_spool.py."""
    st = storage(redis_server.url, closed_port_url(), "k", "s", "bucket", unique_prefix)
    dropped_before = metric("tide_chunks_dropped_total", reason="s3")
    svc = make_service(storage=st, collection=True, chunk_tokens=16, flush_interval_s=0.2, chunk_spool_bytes=0)
    tokens, _, last = run_stream(stub(svc), request("r1", PROMPT, max_tokens=40))
    assert len(tokens) == 40 and last.HasField("final")
    wait_for(lambda: svc.exporter.stats.chunks_dropped_s3 >= 2, what="chunks dropped")
    assert metric("tide_chunks_dropped_total", reason="s3") - dropped_before == svc.exporter.stats.chunks_dropped_s3
    assert svc.exporter.stats.chunks_written == 0
    assert redis_client.xlen(streams.StreamNames(unique_prefix).chunks) == 0  # never a ref without its blob

"""Opt-out and encryption at rest on a real worker (gRPC), real Redis and real S3 (SeaweedFS).

An opted-out request (`no_capture`, what the gateway sends for `store: false`, a no-train API key or
the stack switch) leaves its token ids in no object of the bucket, no stream entry and no spool
file, scanned byte for byte; an eligible request served beside it does (the scans' positive
control). With data keys configured no raw blob or spool file holds a token id in the clear."""

from __future__ import annotations

import base64

import pytest
from inference.service.svc import closed_port_url, request, run_stream, stub, wait_for
from support import scan

from services.inference.worker import Worker
from tide import streams
from tide.chunks import ChunkUnauthentic, decode_chunk
from tide.datakeys import Keyring, is_sealed, sealed_key_id

SECRET = [90, 3, 77, 12, 61, 44, 90, 3, 77, 12]  # the opted-out prompt (tiny vocabulary: ids < 96)
OPEN = [5, 9, 14, 5, 9, 14, 5, 9, 21, 33]  # an eligible one
KEY = "k1:" + base64.b64encode(bytes(range(32))).decode()


def _serve_both(svc) -> None:
    client = stub(svc)
    secret = request("secret-0", SECRET, 30)
    secret.no_capture = True
    run_stream(client, secret)
    run_stream(client, request("open-0", OPEN, 30, key_id="kid-open"))
    svc.exporter.flush_soon()
    assert svc.exporter.wait_idle(10)


def _refs(redis_client, prefix):
    return [streams.decode(f, streams.ChunkRef) for _, f in redis_client.xrange(streams.StreamNames(prefix).chunks)]


def test_opted_out_request_is_stored_nowhere(make_service, redis_client, s3_client, s3_bucket, unique_prefix, tmp_path):
    svc = make_service(collection=True, chunk_tokens=64, flush_interval_s=0.2)
    _serve_both(svc)
    refs = wait_for(lambda: _refs(redis_client, unique_prefix), what="chunk refs")
    assert {rid for r in refs for rid in r.request_ids} == {"open-0"}
    assert {k for r in refs for k in r.key_ids} == {"kid-open"} and all(r.data_key_id == "" for r in refs)
    objects = scan.s3_objects(s3_client, s3_bucket)
    entries = scan.stream_entries(redis_client, unique_prefix)
    assert objects and entries
    assert any(scan.holds(b, OPEN[:6]) for b in objects.values())  # positive control: the scan finds rows
    assert not [k for k, b in {**objects, **entries}.items() if scan.holds(b, SECRET[:4])]

    # S3 down: the eligible request's chunk goes to the spool, the opted-out one's nowhere
    spool = tmp_path / "spool-down"
    down = svc.settings.storage.model_copy(update={"s3_endpoint": closed_port_url()})
    svc2 = make_service(
        collection=True, chunk_tokens=64, flush_interval_s=0.2, storage=down, chunk_spool_dir=str(spool)
    )
    _serve_both(svc2)
    assert any(scan.holds(b, OPEN[:6]) for b in scan.files(spool).values())
    spooled = scan.files(tmp_path)  # every worker's spool directory
    assert not [k for k, b in spooled.items() if scan.holds(b, SECRET[:4])]


def test_stack_switch_refuses_collection(make_service):
    svc = make_service(collection=True, train_on_traffic=False)
    assert isinstance(svc.worker, Worker) and not svc.worker.train_on_traffic
    assert svc.worker.engine.capture_listeners == []  # nothing captured at all


def test_blobs_and_spool_files_are_sealed(make_service, redis_client, s3_client, s3_bucket, unique_prefix, tmp_path):
    base = make_service(collection=False)
    sealed_storage = base.settings.storage.model_copy(update={"data_keys": KEY})
    svc = make_service(collection=True, chunk_tokens=64, flush_interval_s=0.2, storage=sealed_storage)
    run_stream(stub(svc), request("open-1", OPEN, 30))
    svc.exporter.flush_soon()
    assert svc.exporter.wait_idle(10)
    refs = wait_for(lambda: _refs(redis_client, unique_prefix), what="chunk refs")
    objects = scan.s3_objects(s3_client, s3_bucket)
    assert objects and all(is_sealed(b) and sealed_key_id(b) == "k1" for b in objects.values())
    assert all(r.data_key_id == "k1" for r in refs)
    assert not [k for k, b in objects.items() if scan.holds(b, OPEN[:3])]  # no token id in the clear
    ring = Keyring.parse(KEY)
    rows = [t for b in objects.values() for t in decode_chunk(b, keyring=ring).input_ids.tolist()]
    assert rows[: len(OPEN)] == OPEN  # ... yet the rows are all there for the trainer
    with pytest.raises(ChunkUnauthentic):
        decode_chunk(next(iter(objects.values())), keyring=Keyring.empty())  # no key: unreadable
    # the spool holds the same sealed bytes when S3 is down
    down = sealed_storage.model_copy(update={"s3_endpoint": closed_port_url()})
    spool = tmp_path / "spool-sealed"
    svc2 = make_service(
        collection=True, chunk_tokens=64, flush_interval_s=0.2, storage=down, chunk_spool_dir=str(spool)
    )
    run_stream(stub(svc2), request("open-2", OPEN, 30))
    svc2.exporter.flush_soon()
    assert svc2.exporter.wait_idle(10)
    blobs_ = {k: b for k, b in scan.files(spool).items() if k.endswith(".safetensors")}
    assert blobs_ and all(is_sealed(b) for b in blobs_.values())
    assert not [k for k, b in scan.files(spool).items() if scan.holds(b, OPEN[:3])]

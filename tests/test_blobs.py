"""tide.blobs against the real S3-compatible server (the shared `s3_server` fixture)."""

from __future__ import annotations

import io
import os
import threading

import pytest
from minio.error import S3Error

from tide import blobs
from tide.blobs import ChecksumMismatch, PointerConflict, StorageSettings

# ------------------------------------------------------------------------------------ settings


def test_settings_from_env():
    s = StorageSettings.from_env(
        {
            "TIDE_S3_ENDPOINT": "https://s3.internal:9000/",
            "TIDE_S3_ACCESS_KEY": "ak",
            "TIDE_S3_SECRET_KEY": "very-secret",
            "TIDE_S3_BUCKET": "bkt",
            "TIDE_REDIS_URL": "redis://r:6380/1",
        }
    )
    assert (s.s3_endpoint, s.s3_secure, s.s3_bucket, s.redis_url) == (
        "s3.internal:9000",
        True,
        "bkt",
        "redis://r:6380/1",
    )
    assert "very-secret" not in repr(s)
    with pytest.raises(AttributeError):
        s.s3_bucket = "other"  # type: ignore[misc]
    plain = StorageSettings.from_env({"TIDE_S3_ENDPOINT": "http://minio:9000"})
    assert (plain.s3_endpoint, plain.s3_secure, plain.stream_prefix) == ("minio:9000", False, "tide")


def test_settings_are_built_once(monkeypatch):
    blobs.storage_settings.cache_clear()
    monkeypatch.setenv("TIDE_S3_BUCKET", "first")
    first = blobs.storage_settings()
    monkeypatch.setenv("TIDE_S3_BUCKET", "second")
    assert blobs.storage_settings() is first and first.s3_bucket == "first"
    blobs.storage_settings.cache_clear()


def test_settings_clients_reach_the_servers(s3_server, redis_server, s3_bucket):
    s = StorageSettings.from_env(
        {
            "TIDE_S3_ENDPOINT": s3_server.url,
            "TIDE_S3_ACCESS_KEY": s3_server.access_key,
            "TIDE_S3_SECRET_KEY": s3_server.secret_key,
            "TIDE_REDIS_URL": redis_server.url,
        }
    )
    assert s.s3_client().bucket_exists(s3_bucket)
    assert s.redis_client().ping()


# --------------------------------------------------------------------------------------- blobs


def test_ensure_bucket_is_idempotent(s3_client, unique_prefix):
    blobs.ensure_bucket(s3_client, unique_prefix)
    blobs.ensure_bucket(s3_client, unique_prefix)
    assert s3_client.bucket_exists(unique_prefix)
    s3_client.remove_bucket(unique_prefix)


def test_put_get_roundtrip_with_checksum(s3_client, s3_bucket):
    data = os.urandom(100_000)
    info = blobs.put_bytes(s3_client, s3_bucket, "chunks/a.safetensors", data, metadata={"worker": "w0"})
    assert info.sha256 == blobs.sha256_hex(data) and info.size_bytes == len(data) and info.etag
    assert blobs.stat(s3_client, s3_bucket, "chunks/a.safetensors") == info
    assert blobs.get_bytes(s3_client, s3_bucket, "chunks/a.safetensors") == data
    assert blobs.get_bytes(s3_client, s3_bucket, "chunks/a.safetensors", expected_sha256=info.sha256) == data


def test_get_detects_corruption_and_names_the_key(s3_client, s3_bucket):
    good = blobs.put_bytes(s3_client, s3_bucket, "chunks/b", b"original bytes")
    # Same key now holds other bytes but still claims the old checksum (a torn/corrupt write).
    s3_client.put_object(s3_bucket, "chunks/b", io.BytesIO(b"tampered bytes"), 14, metadata={"sha256": good.sha256})
    with pytest.raises(ChecksumMismatch, match="chunks/b") as err:
        blobs.get_bytes(s3_client, s3_bucket, "chunks/b")
    assert err.value.key == "chunks/b" and err.value.expected == good.sha256
    assert err.value.actual == blobs.sha256_hex(b"tampered bytes")


def test_get_checks_the_referenced_checksum(s3_client, s3_bucket):
    blobs.put_bytes(s3_client, s3_bucket, "chunks/c", b"payload")
    with pytest.raises(ChecksumMismatch, match="chunks/c"):
        blobs.get_bytes(s3_client, s3_bucket, "chunks/c", expected_sha256="0" * 64)


def test_get_refuses_unverifiable_objects(s3_client, s3_bucket):
    s3_client.put_object(s3_bucket, "foreign", io.BytesIO(b"abc"), 3)
    with pytest.raises(ChecksumMismatch, match="no SHA-256 recorded"):
        blobs.get_bytes(s3_client, s3_bucket, "foreign")
    assert blobs.get_bytes(s3_client, s3_bucket, "foreign", expected_sha256=blobs.sha256_hex(b"abc")) == b"abc"
    assert blobs.stat(s3_client, s3_bucket, "foreign").sha256 is None


def test_missing_blob_raises_no_such_key(s3_client, s3_bucket):
    with pytest.raises(S3Error) as err:
        blobs.get_bytes(s3_client, s3_bucket, "nope")
    assert err.value.code == "NoSuchKey"


def test_put_file_multipart_keeps_checksum(s3_client, s3_bucket, tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(os.urandom(6 * 1024 * 1024 + 123))  # > 5 MiB: multipart upload
    info = blobs.put_file(s3_client, s3_bucket, "drafts/v1/model.safetensors", path, part_size=5 * 1024 * 1024)
    assert info.size_bytes == path.stat().st_size
    assert blobs.stat(s3_client, s3_bucket, "drafts/v1/model.safetensors").sha256 == info.sha256
    assert blobs.get_bytes(s3_client, s3_bucket, "drafts/v1/model.safetensors") == path.read_bytes()


def test_list_keys_by_prefix(s3_client, s3_bucket):
    for key in ("drafts/v2/config.json", "drafts/v1/config.json", "drafts/v1/model.safetensors", "chunks/x"):
        blobs.put_bytes(s3_client, s3_bucket, key, b"{}")
    assert blobs.list_keys(s3_client, s3_bucket, "drafts/v1/") == [
        "drafts/v1/config.json",
        "drafts/v1/model.safetensors",
    ]
    assert len(blobs.list_keys(s3_client, s3_bucket)) == 4


# ------------------------------------------------------------------------------------ pointers


def test_pointer_create_update_and_conflicts(s3_client, s3_bucket):
    assert blobs.get_pointer(s3_client, s3_bucket, "ptr.json") is None
    etag1 = blobs.put_pointer(s3_client, s3_bucket, "ptr.json", {"current": "v1", "gen": 1}, expected_etag=None)
    with pytest.raises(PointerConflict, match="already exists"):
        blobs.put_pointer(s3_client, s3_bucket, "ptr.json", {"current": "vX", "gen": 1}, expected_etag=None)
    read = blobs.get_pointer(s3_client, s3_bucket, "ptr.json")
    assert read == blobs.Pointer({"current": "v1", "gen": 1}, etag1)
    etag2 = blobs.put_pointer(s3_client, s3_bucket, "ptr.json", {"current": "v2", "gen": 2}, expected_etag=etag1)
    assert etag2 != etag1
    with pytest.raises(PointerConflict, match="no longer at ETag"):
        blobs.put_pointer(s3_client, s3_bucket, "ptr.json", {"current": "v3", "gen": 3}, expected_etag=etag1)
    assert blobs.get_pointer(s3_client, s3_bucket, "ptr.json").value == {"current": "v2", "gen": 2}


def test_concurrent_conditional_writes_have_one_winner(s3_client, s3_bucket):
    base = blobs.update_pointer(s3_client, s3_bucket, "race.json", lambda v: {"gen": 0})
    outcomes: list[str] = []
    barrier = threading.Barrier(6)

    def racer(i: int) -> None:
        barrier.wait()
        try:
            blobs.put_pointer(s3_client, s3_bucket, "race.json", {"gen": 1, "by": i}, expected_etag=base.etag)
            outcomes.append("won")
        except PointerConflict:
            outcomes.append("lost")

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["lost"] * 5 + ["won"]


def test_update_pointer_loses_no_increment(s3_client, s3_bucket):
    def bump(value):
        return {"n": (value or {"n": 0})["n"] + 1}

    def worker() -> None:
        for _ in range(5):
            blobs.update_pointer(s3_client, s3_bucket, "counter.json", bump)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert blobs.get_pointer(s3_client, s3_bucket, "counter.json").value == {"n": 15}

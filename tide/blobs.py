"""S3 helpers on the `minio` client: checksummed blobs, atomic JSON pointers, storage settings.

Every blob TIDE writes (hidden-state chunks, draft checkpoint files) carries its SHA-256 (lowercase
hex) in the object's user metadata (`x-amz-meta-sha256`), and readers verify it: a corrupt or
truncated download raises `ChecksumMismatch` naming the key instead of training on bad data.

Pointers are small JSON objects that change in place (e.g. a registry pointer state). They are
written with S3 conditional writes: `If-None-Match: *` to create, `If-Match: <etag>` to replace,
so two writers can never silently overwrite each other; the loser gets `PointerConflict` and
re-reads. SeaweedFS (>= 3.9x, tested here) and MinIO (2024+) honour both headers. The `minio`
client has no public way to send them, so conditional writes go through a short-lived presigned
PUT URL (public API) and urllib3 (minio's own HTTP library).

Configuration comes from the environment once (`storage_settings()`), see `StorageSettings`.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import urllib3
from minio import Minio
from minio.error import S3Error
from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from tide.settings import NOT_FROM_ENV, TideSettings

SHA256_META = "sha256"  # stored as x-amz-meta-sha256
_SHA256_HEADER = "x-amz-meta-sha256"
_COPY_BUFSIZE = 1 << 20


class ChecksumMismatch(Exception):
    """A blob's bytes do not match the SHA-256 it was stored or referenced with."""

    def __init__(self, bucket: str, key: str, expected: str | None, actual: str):
        self.bucket, self.key, self.expected, self.actual = bucket, key, expected, actual
        what = f"expected {expected}" if expected else "no SHA-256 recorded for it"
        super().__init__(f"checksum mismatch for s3://{bucket}/{key}: {what}, got {actual}")


class PointerConflict(Exception):
    """A conditional pointer write lost a race: the pointer changed (or exists) since it was read."""


@dataclass(frozen=True)
class BlobInfo:
    bucket: str
    key: str
    size_bytes: int
    sha256: str | None  # None for objects written without our metadata
    etag: str


# ---------------------------------------------------------------------------------- settings


class StorageSettings(TideSettings):
    """Where Redis and S3 are. Built once from the environment; pass it explicitly, never mutate.

    `TIDE_S3_ENDPOINT` is "host:port" or "http(s)://host:port" (https means TLS); the stream-name
    prefix is explained in `tide.streams.StreamNames`.
    """

    model_config = SettingsConfigDict(env_prefix="TIDE_")

    s3_endpoint: str = Field("127.0.0.1:9000", description='S3 endpoint, "host:port" or "http(s)://host:port" '
                             "(https: TLS)")
    s3_access_key: str = Field("", description="S3 access key")
    s3_secret_key: str = Field("", repr=False, description="S3 secret key")
    s3_bucket: str = Field("tide", description="the bucket of TIDE's objects")
    s3_secure: bool = Field(False, json_schema_extra=NOT_FROM_ENV, description="TLS (an https:// endpoint)")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis, a redis:// URL")
    stream_prefix: str = Field("tide", description="prefix of the Redis stream names")
    # encryption at rest of captured traffic (tide/datakeys.py); the first key seals, every key opens
    data_keys: str = Field("", repr=False,
                           description='keys that encrypt chunk blobs and spool files (AES-256-GCM), '
                           '"id:base64key,..." (32-byte keys); the first seals new blobs, every one decrypts '
                           "(rotation: put the new key first); empty and no key file = stored in the clear")
    data_key_file: str = Field("", description="file of such keys, one \"id:base64key\" a line (# comments), after "
                               "TIDE_DATA_KEYS' (`tidectl data new-key ID` prints a fresh line)")

    @model_validator(mode="before")
    @classmethod
    def _split_scheme(cls, data: Any) -> Any:
        """An endpoint with a scheme sets `s3_secure` (https) and loses the scheme and a trailing "/"."""
        endpoint = data.get("s3_endpoint") if isinstance(data, dict) else None
        if isinstance(endpoint, str):
            bare = endpoint.removeprefix("https://").removeprefix("http://").rstrip("/")
            data = {**data, "s3_endpoint": bare}
            if bare != endpoint.rstrip("/"):
                data["s3_secure"] = endpoint.startswith("https://")
        return data

    def s3_client(self) -> Minio:
        return Minio(
            self.s3_endpoint,
            access_key=self.s3_access_key,
            secret_key=self.s3_secret_key,
            secure=self.s3_secure,
        )

    def keyring(self):  # -> tide.datakeys.Keyring
        """The data keys (KeyringError on a malformed key or an unreadable file)."""
        from tide.datakeys import Keyring

        return Keyring.load(self.data_keys, self.data_key_file)

    def redis_client(self, **kwargs: Any):  # -> redis.Redis
        import redis

        return redis.Redis.from_url(self.redis_url, **kwargs)


@functools.cache
def storage_settings() -> StorageSettings:
    """The process-wide settings, read from the environment on first use."""
    return StorageSettings.from_env()


@functools.cache
def data_keyring():  # -> tide.datakeys.Keyring
    """The process-wide data keys (`storage_settings().keyring()`), for readers given no ring."""
    return storage_settings().keyring()


# ------------------------------------------------------------------------------------- blobs


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ensure_bucket(client: Minio, bucket: str) -> None:
    """Create `bucket` unless it exists (safe when several services race to create it)."""
    if client.bucket_exists(bucket):
        return
    try:
        client.make_bucket(bucket)
    except S3Error as e:
        if e.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise


def put_bytes(
    client: Minio,
    bucket: str,
    key: str,
    data: bytes,
    *,
    content_type: str = "application/octet-stream",
    metadata: Mapping[str, str] | None = None,
) -> BlobInfo:
    """Store `data` with its SHA-256 in the object metadata; returns what was stored."""
    digest = sha256_hex(data)
    meta = {**(metadata or {}), SHA256_META: digest}
    result = client.put_object(bucket, key, io.BytesIO(data), len(data), content_type=content_type, metadata=meta)
    return BlobInfo(bucket, key, len(data), digest, _unquote(result.etag))


def put_file(client: Minio, bucket: str, key: str, path: str | Path, **kwargs: Any) -> BlobInfo:
    """Like `put_bytes` for a file on disk (draft checkpoints); hashes it without loading it whole."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_COPY_BUFSIZE):
            h.update(chunk)
    digest = h.hexdigest()
    meta = {**kwargs.pop("metadata", {}), SHA256_META: digest}
    result = client.fput_object(bucket, key, str(path), metadata=meta, **kwargs)
    return BlobInfo(bucket, key, os.path.getsize(path), digest, _unquote(result.etag))


def get_bytes(client: Minio, bucket: str, key: str, *, expected_sha256: str | None = None) -> bytes:
    """Fetch a blob and verify it: against `expected_sha256` when given (e.g. from a ChunkRef),
    and against the SHA-256 stored with it. Raises ChecksumMismatch when either differs, or when
    there is nothing to verify against; minio's S3Error (code NoSuchKey) when it does not exist."""
    resp = client.get_object(bucket, key)
    try:
        data = resp.read()
        stored = resp.headers.get(_SHA256_HEADER)
    finally:
        resp.close()
        resp.release_conn()
    actual = sha256_hex(data)
    for reference in (expected_sha256, stored):
        if reference is not None and reference.lower() != actual:
            raise ChecksumMismatch(bucket, key, reference.lower(), actual)
    if expected_sha256 is None and stored is None:
        raise ChecksumMismatch(bucket, key, None, actual)
    return data


def stat(client: Minio, bucket: str, key: str) -> BlobInfo:
    st = client.stat_object(bucket, key)
    return BlobInfo(bucket, key, st.size or 0, (st.metadata or {}).get(_SHA256_HEADER), _unquote(st.etag))


def list_keys(client: Minio, bucket: str, prefix: str = "") -> list[str]:
    """All object keys under `prefix` (recursively), sorted."""
    return sorted(o.object_name for o in client.list_objects(bucket, prefix=prefix, recursive=True))


def _unquote(etag: str | None) -> str:
    return (etag or "").strip('"')


# ----------------------------------------------------------------------------------- pointers


@dataclass(frozen=True)
class Pointer:
    value: dict[str, Any]
    etag: str  # pass back to put_pointer(expected_etag=...) to replace exactly this version


_http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=5.0, read=30.0), retries=False)


def get_pointer(client: Minio, bucket: str, key: str) -> Pointer | None:
    """The pointer's JSON value and ETag, or None if it does not exist."""
    try:
        resp = client.get_object(bucket, key)
    except S3Error as e:
        if e.code == "NoSuchKey":
            return None
        raise
    try:
        body, etag = resp.read(), _unquote(resp.headers.get("ETag"))
    finally:
        resp.close()
        resp.release_conn()
    value = json.loads(body)
    if not isinstance(value, dict):
        raise ValueError(f"pointer s3://{bucket}/{key} does not hold a JSON object")
    return Pointer(value, etag)


def put_pointer(client: Minio, bucket: str, key: str, value: dict[str, Any], *, expected_etag: str | None) -> str:
    """Write `value` only if the pointer is still at `expected_etag` (None: only if it does not
    exist yet). Returns the new ETag; raises PointerConflict when the condition fails.

    ETags are content hashes, so a value that returns to an earlier content would match a stale
    ETag (ABA): keep a counter in the value that every write bumps (PointerState.generation)."""
    body = json.dumps(value, separators=(",", ":"), sort_keys=True).encode()
    headers = {"Content-Type": "application/json"}
    if expected_etag is None:
        headers["If-None-Match"] = "*"
    else:
        headers["If-Match"] = f'"{expected_etag}"'
    url = client.get_presigned_url("PUT", bucket, key, expires=timedelta(minutes=5))
    resp = _http.request("PUT", url, body=body, headers=headers)
    if resp.status == 412 or (resp.status == 409 and b"ConditionalRequestConflict" in resp.data):
        state = "already exists" if expected_etag is None else f"is no longer at ETag {expected_etag}"
        raise PointerConflict(f"pointer s3://{bucket}/{key} {state}")
    if resp.status != 200:
        raise RuntimeError(f"conditional PUT s3://{bucket}/{key} failed: HTTP {resp.status} {resp.data[:500]!r}")
    return _unquote(resp.headers.get("ETag"))


def update_pointer(
    client: Minio,
    bucket: str,
    key: str,
    change: Callable[[dict[str, Any] | None], dict[str, Any]],
    *,
    attempts: int = 20,
) -> Pointer:
    """Read-modify-write with optimistic concurrency: `change(current or None)` returns the new
    value; retried on conflict. `change` must be a pure function of its input."""
    for _ in range(attempts):
        current = get_pointer(client, bucket, key)
        new = change(None if current is None else current.value)
        try:
            etag = put_pointer(client, bucket, key, new, expected_etag=None if current is None else current.etag)
        except PointerConflict:
            continue
        return Pointer(new, etag)
    raise PointerConflict(f"pointer s3://{bucket}/{key}: gave up after {attempts} conflicting attempts")

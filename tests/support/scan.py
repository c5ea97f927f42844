"""Byte-for-byte scans for token ids in stored data (the data-governance tests).

A sequence of token ids is searched for as the chunk tensors would hold it (int64 and int32,
little-endian, back to back) and as JSON or text would (decimal, with and without spaces)."""

from __future__ import annotations

import struct
from pathlib import Path


def patterns(ids: list[int]) -> list[bytes]:
    n = len(ids)
    return [
        struct.pack(f"<{n}q", *ids),
        struct.pack(f"<{n}i", *ids),
        ", ".join(map(str, ids)).encode(),
        ",".join(map(str, ids)).encode(),
    ]


def holds(data: bytes, ids: list[int]) -> bool:
    return any(p in data for p in patterns(ids))


def s3_objects(client, bucket: str) -> dict[str, bytes]:
    """Every object of the bucket, raw (no checksum or decryption)."""
    out = {}
    for o in client.list_objects(bucket, recursive=True):
        resp = client.get_object(bucket, o.object_name)
        try:
            out[o.object_name] = resp.read()
        finally:
            resp.close()
            resp.release_conn()
    return out


def stream_entries(redis_client, prefix: str) -> dict[str, bytes]:
    """Every entry of every stream under `prefix`, as its fields' bytes."""
    out = {}
    for key in redis_client.scan_iter(f"{prefix}:*"):
        if redis_client.type(key) not in (b"stream", "stream"):
            continue
        for eid, fields in redis_client.xrange(key):
            out[f"{key}/{eid}"] = b"".join(
                (k if isinstance(k, bytes) else str(k).encode())
                + b"="
                + (v if isinstance(v, bytes) else str(v).encode())
                for k, v in fields.items()
            )
    return out


def files(directory: str | Path) -> dict[str, bytes]:
    root = Path(directory)
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()} if root.exists() else {}

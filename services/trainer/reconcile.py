"""Reconciler: chunk blobs in S3 that no stream entry names are verified, then re-enqueued or dead-lettered.

An inference worker writes a chunk's blob and only then XADDs its reference (services/inference/
exporter.py). A worker killed in between, or one that dropped references while Redis was down,
leaves a blob that nothing names: without this it would never be trained on. Every `interval_s`
seconds (the first pass at start) one pass:

1. lists the blobs under `<prefix>/` (`*.safetensors`) last modified more than `grace_s` ago:
   younger ones may still get their reference (the exporter adds it right after the blob);
2. leaves out those whose chunk id (the key's file name) the manifest has recorded or tombstoned
   (deleted by retention, the budget or forget: a deleted chunk is never resurrected), those this
   reconciler handled before, and those named by an entry of the chunk stream (pending or acked)
   or of the dead-letter stream (a letter's reference, or the blob of an earlier reconciler letter).
   Both streams are read incrementally (the entries added since the last pass), after the listing,
   so a reference added while the pass lists is seen;
3. downloads each blob left and verifies it: the SHA-256 stored with it (tide.blobs.get_bytes) and
   tide.chunks.decode_chunk. A valid chunk is re-enqueued: XADD of a `ChunkRef` built from its
   header, size and SHA-256; the intake then checks and records it like any other (ingest.py). A
   corrupt one (a sealed blob failing authentication too) goes to the dead-letter stream with the
   reason (source_stream "s3://<bucket>", source_id its key, consumer "trainer/reconciler"), once.
   A blob of a chunk id the manifest already holds under another key is only remembered.

Idempotent: a blob is enqueued or dead-lettered at most once per reconciler (it remembers the key),
and a restarted one finds its earlier entries on the streams. Should two replicas both enqueue a
blob, the manifest's conditional write records its chunk id once (manifest.py), the second
reference is counted as a duplicate. S3 or Redis failing ends the pass (counted, logged); the next
one starts over. A worker holding references while Redis is down for longer than the grace period
re-sends them itself later: those chunks arrive twice, deduplicated the same way.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import PurePosixPath

import redis
from minio import Minio
from minio.error import S3Error

from services.trainer.ingest import MAX_CHUNK_BYTES
from services.trainer.manifest import Manifest
from tide import blobs, streams
from tide.blobs import ChecksumMismatch
from tide.chunks import ChunkInvalid, decode_chunk
from tide.datakeys import Keyring, sealed_key_id
from tide.streams import ChunkRef, DeadLetter, PayloadError, StreamNames

log = logging.getLogger(__name__)

CONSUMER = f"{streams.TRAINER_GROUP}/reconciler"  # the dead letters' `consumer`
_SUFFIX = ".safetensors"
_BATCH = 1000  # stream entries per XRANGE


@dataclass
class ReconcileStats:
    passes: int = 0  # passes that finished
    errors: int = 0  # passes that ended early (S3 or Redis unreachable, ...)
    enqueued: int = 0  # orphan blobs re-enqueued on the chunk stream
    dead_lettered: int = 0  # orphan blobs that failed verification
    last_orphans: int = 0  # blobs the last finished pass found unreferenced


class Reconciler:
    """Runs `run_once` every `interval_s` in a thread ("chunk-reconciler") until `stop()`."""

    def __init__(self, s3: Minio, bucket: str, client: redis.Redis, names: StreamNames, manifest: Manifest, *,
                 prefix: str = "chunks", interval_s: float = 60.0, grace_s: float = 120.0,
                 keyring: Keyring | None = None) -> None:
        self.s3, self.bucket, self.client, self.names, self.manifest = s3, bucket, client, names, manifest
        self.keyring = keyring if keyring is not None else Keyring.empty()
        self.prefix, self.interval_s, self.grace_s = prefix.strip("/"), interval_s, grace_s
        self.stats = ReconcileStats()
        self._handled: set[str] = set()  # keys this reconciler enqueued, dead-lettered or found recorded
        self._named: set[str] = set()  # keys named by stream entries read so far
        self._cursors: dict[str, str] = {}  # stream -> last entry id read
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle

    def start(self) -> Reconciler:
        self._thread = threading.Thread(target=self._run, name="chunk-reconciler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception as e:  # S3 or Redis down, ...: the next pass starts over
                self.stats.errors += 1
                log.warning("chunk reconciler: pass failed (%s: %s); retrying in %.0f s", type(e).__name__, e,
                            self.interval_s)
            self._stop.wait(self.interval_s)

    # ---- one pass

    def run_once(self) -> int:
        """One pass; returns how many orphan blobs it enqueued or dead-lettered."""
        cutoff = time.time() - self.grace_s
        candidates = []
        for obj in self.s3.list_objects(self.bucket, prefix=f"{self.prefix}/", recursive=True):
            key = obj.object_name
            if not key.endswith(_SUFFIX) or key in self._handled:
                continue
            if obj.last_modified is None or obj.last_modified.timestamp() > cutoff:
                continue  # in flight: its reference may be on its way
            if self.manifest.seen(_chunk_id(key)) or self.manifest.is_deleted(_chunk_id(key)):
                continue  # recorded, or deleted (a tombstone: never resurrected; the data sweep removes the blob)
            candidates.append((key, obj.size or 0))
        if candidates:
            self._read_streams()
        orphans = [(k, size) for k, size in candidates if k not in self._named]
        done = 0
        for key, size in orphans:
            if self._stop.is_set():
                break
            done += self._reconcile(key, size)
        self._prune()
        self.stats.passes += 1
        self.stats.last_orphans = len(orphans)
        return done

    def _reconcile(self, key: str, size: int) -> int:
        if size > MAX_CHUNK_BYTES:
            return self._dead_letter(key, size, f"orphan blob of {size} bytes exceeds the limit of {MAX_CHUNK_BYTES}")
        try:
            data = blobs.get_bytes(self.s3, self.bucket, key)
        except ChecksumMismatch as e:
            return self._dead_letter(key, size, f"checksum mismatch: {e}")
        except S3Error as e:
            if e.code == "NoSuchKey":  # deleted since the listing
                return 0
            raise
        try:
            chunk = decode_chunk(data, keyring=self.keyring)
        except ChunkInvalid as e:  # a sealed blob failing authentication too (ChunkUnauthentic): quarantined
            return self._dead_letter(key, len(data), f"invalid chunk: {e}")
        meta = chunk.meta
        if self.manifest.seen(meta.chunk_id) or self.manifest.is_deleted(meta.chunk_id):  # nothing to do
            self._handled.add(key)
            return 0
        parts = PurePosixPath(key).parts  # <prefix>/<target>/<worker>/<chunk id>.safetensors
        worker = meta.worker_id or (parts[-2] if len(parts) >= 3 else "") or "unknown"
        ref = ChunkRef(chunk_id=meta.chunk_id, bucket=self.bucket, key=key, size_bytes=len(data),
                       sha256=blobs.sha256_hex(data), num_tokens=chunk.num_tokens, target_model=meta.target_model,
                       draft_version=meta.draft_version, workload=meta.workload, worker_id=worker,
                       created_unix_s=meta.created_at, request_ids=list(meta.request_ids),
                       key_ids=list(meta.key_ids), data_key_id=sealed_key_id(data))
        entry_id = streams.add(self.client, self.names.chunks, ref)
        self._handled.add(key)
        self.stats.enqueued += 1
        log.warning("chunk reconciler: blob s3://%s/%s had no reference; re-enqueued chunk %s (%d tokens of %s from "
                    "%s) as %s", self.bucket, key, meta.chunk_id, chunk.num_tokens, meta.target_model, worker,
                    entry_id)
        return 1

    def _dead_letter(self, key: str, size: int, reason: str) -> int:
        letter = DeadLetter(reason=reason, consumer=CONSUMER, source_stream=f"s3://{self.bucket}", source_id=key,
                            raw={"bucket": self.bucket, "key": key, "size_bytes": str(size)},
                            time_unix_s=time.time())
        streams.add(self.client, self.names.dead_letter, letter, maxlen=streams.DEAD_LETTER_MAXLEN)
        self._handled.add(key)
        self.stats.dead_lettered += 1
        log.error("chunk reconciler: dead-lettered orphan blob s3://%s/%s: %s", self.bucket, key, reason)
        return 1

    # ---- what the streams name

    def _read_streams(self) -> None:
        """Add the keys named by entries added since the last read (both streams)."""
        for stream in (self.names.chunks, self.names.dead_letter):
            start = self._cursors.get(stream)
            while True:
                entries = self.client.xrange(stream, min="-" if start is None else f"({start}", max="+",
                                             count=_BATCH)
                for entry_id, fields in entries:
                    key = _named_key(fields)
                    if key:
                        self._named.add(key)
                    start = _text(entry_id)
                if len(entries) < _BATCH:
                    break
            if start is not None:
                self._cursors[stream] = start

    def _prune(self) -> None:
        """Forget stream-named keys whose chunks the manifest holds (they never become candidates)."""
        if len(self._named) > 10_000:
            self._named = {k for k in self._named if not self.manifest.seen(_chunk_id(k))}


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _chunk_id(key: str) -> str:
    name = PurePosixPath(key).name
    return name[:-len(_SUFFIX)] if name.endswith(_SUFFIX) else name


def _named_key(fields: dict) -> str:
    """The blob key an entry of the chunk or dead-letter stream names ("" when none can be read)."""
    f = {_text(k): _text(v) for k, v in (fields or {}).items()}
    try:
        data = json.loads(f.get("data", ""))
    except json.JSONDecodeError:
        return ""
    if not isinstance(data, dict):
        return ""
    if f.get("type") == "chunk_ref":
        return str(data.get("key", ""))
    if f.get("type") == "dead_letter":
        try:
            letter = streams.from_dict(DeadLetter, data)
        except PayloadError:
            return ""
        if letter.ref is not None:
            return letter.ref.key
        if letter.source_stream.startswith("s3://"):
            return letter.source_id
        return _named_key(letter.raw)  # an unparseable chunk entry: its raw fields, if they name a key
    return ""

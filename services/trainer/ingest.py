"""Chunk intake: read chunk references (consumer group "trainer"), verify, validate, record. No gRPC.

For each `ChunkRef` (tide.streams), in order:
1. a chunk id already in the manifest is a duplicate (at-least-once delivery): counted, acked;
2. the blob is downloaded and its SHA-256 checked against the reference and the stored one
   (tide.blobs.get_bytes), its size against the reference;
3. it is decoded and validated (tide.chunks.decode_chunk: tensors, dtypes, shapes, segments,
   finite values, the reference's target model) and must carry the reference's chunk id and token
   count;
4. it is recorded in the manifest (manifest.py) and only then acked.
A sealed blob (tide/datakeys.py) is opened with the trainer's data keys in step 3; one that fails
authentication is quarantined like a corrupt one (dead-lettered, counted in `quarantined`, never
trained on). A chunk id with a tombstone (deleted by retention, the budget or forget:
governance.py) is skipped; a chunk holding rows of a forgotten request or API key is rewritten
without them right after it is recorded.
A chunk failing 2-3 (or whose blob is gone) raises `tide.streams.Reject`: the consumer writes it
to the dead-letter stream with the reason and acks it; it is counted and never trained on. S3 or
Redis being unreachable is not the chunk's fault: S3 failures other than a missing blob raise
`tide.streams.Transient`, so the reader retries the entry in hand every few seconds until the store
is back (never dead-lettering it for the outage); Redis outages are ridden out by the consumer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis
import urllib3
from minio import Minio
from minio.error import MinioException, S3Error

from services.trainer.manifest import Manifest, ManifestEntry
from tide import blobs, streams
from tide.blobs import ChecksumMismatch
from tide.chunks import ChunkInvalid, ChunkUnauthentic, decode_chunk
from tide.datakeys import Keyring
from tide.streams import ChunkRef, Consumer, ConsumerThread, Message, Reject, Transient

log = logging.getLogger(__name__)

MAX_CHUNK_BYTES = 1 << 30  # a reference announcing more is refused before downloading
_GONE = ("NoSuchKey", "NoSuchBucket")
# what the object store raises while it is down, restarting or overloaded (minio: S3Error and its
# ServerError / InvalidResponseError siblings; urllib3 once its own retries are spent; the socket)
_STORE_DOWN = (MinioException, urllib3.exceptions.HTTPError, OSError)


@dataclass
class IngestStats:
    accepted: int = 0  # new chunks recorded in the manifest
    deduplicated: int = 0  # references to chunk ids already recorded
    accepted_tokens: int = 0
    quarantined: int = 0  # sealed blobs that failed authentication (dead-lettered)
    deleted: int = 0  # references to chunks deleted since (tombstoned): skipped


class ChunkIngest:
    """The stream handler (thread-confined: called by one consumer thread)."""

    def __init__(self, s3: Minio, manifest: Manifest, keyring: Keyring | None = None, governor=None) -> None:
        self.s3, self.manifest = s3, manifest
        self.keyring = keyring if keyring is not None else Keyring.empty()
        self.governor = governor  # services.trainer.governance.DataGovernor (forgotten rows), or None
        self.stats = IngestStats()

    def handle(self, msg: Message[ChunkRef]) -> None:
        try:
            self._handle(msg.payload, msg)
        except _STORE_DOWN as e:  # a missing blob was rejected in _handle; anything else is the store's state
            raise Transient(f"object store unavailable ({getattr(e, 'code', None) or type(e).__name__})") from e

    def _handle(self, ref: ChunkRef, msg: Message[ChunkRef]) -> None:
        if self.manifest.is_deleted(ref.chunk_id):
            self.stats.deleted += 1
            log.info("chunk %s was deleted (retention, budget or forget): skipped", ref.chunk_id)
            return
        if self.manifest.seen(ref.chunk_id):
            self.stats.deduplicated += 1
            log.info("chunk %s already recorded (delivery %d of entry %s): skipped", ref.chunk_id, msg.deliveries,
                     msg.entry_id)
            return
        if ref.size_bytes > MAX_CHUNK_BYTES:
            raise Reject(f"chunk {ref.chunk_id}: {ref.size_bytes} bytes exceeds the limit of {MAX_CHUNK_BYTES}")
        try:
            data = blobs.get_bytes(self.s3, ref.bucket, ref.key, expected_sha256=ref.sha256)
        except ChecksumMismatch as e:
            raise Reject(f"checksum mismatch: {e}") from None
        except S3Error as e:
            if e.code in _GONE:
                raise Reject(f"blob s3://{ref.bucket}/{ref.key} not found ({e.code})") from None
            raise
        if len(data) != ref.size_bytes:
            raise Reject(f"chunk {ref.chunk_id}: blob has {len(data)} bytes, the reference says {ref.size_bytes}")
        try:
            chunk = decode_chunk(data, expected_target=ref.target_model, keyring=self.keyring)
        except ChunkUnauthentic as e:
            self.stats.quarantined += 1
            raise Reject(f"quarantined: {e}") from None
        except ChunkInvalid as e:
            raise Reject(f"invalid chunk: {e}") from None
        if chunk.meta.chunk_id != ref.chunk_id:
            raise Reject(f"blob holds chunk {chunk.meta.chunk_id!r}, the reference names {ref.chunk_id!r}")
        if chunk.num_tokens != ref.num_tokens:
            raise Reject(f"chunk {ref.chunk_id}: {chunk.num_tokens} tokens, the reference says {ref.num_tokens}")
        entry = ManifestEntry.from_ref(ref)
        if self.manifest.add(entry):
            if self.governor is not None and self.governor.matches_forgotten(entry):
                self.governor.apply_forgotten(entry)
            self.stats.accepted += 1
            self.stats.accepted_tokens += ref.num_tokens
            log.info("chunk %s accepted: %d tokens of %s from %s", ref.chunk_id, ref.num_tokens, ref.target_model,
                     ref.worker_id)
        else:  # another replica recorded it between our check and our write
            self.stats.deduplicated += 1


class ChunkReader(ConsumerThread[ChunkRef]):
    """The chunk consumer in a thread ("chunk-reader") until `stop()` (waits up to 10 s); unacked
    entries stay pending on exit."""

    def __init__(self, client: redis.Redis, names: streams.StreamNames, consumer: str, ingest: ChunkIngest,
                 claim_idle_ms: int = 120_000, block_ms: int = 500, reclaim_every_s: float = 5.0) -> None:
        self.ingest = ingest
        super().__init__(Consumer(client, names.chunks, streams.TRAINER_GROUP, consumer, ChunkRef,
                                  dead_letter_stream=names.dead_letter, claim_idle_ms=claim_idle_ms,
                                  block_ms=block_ms, reclaim_every_s=reclaim_every_s, count=4),
                         ingest.handle, name="chunk reader", join_timeout_s=10.0, logger=log)

"""Training Signal Extractor: accepted tokens' target states -> host buffers -> S3 chunk -> stream ref.

`add` is the capture hook (engine loop thread, only while collection is on): it copies each
committed row (prompt rows and accepted tokens; see `tide.chunks` for what a row is) into the
active preallocated `ChunkBuilder`. A full builder is handed to the background flusher and the
next free one becomes active; with none free (the flusher is behind) rows are dropped and
counted. The flusher also closes a partial chunk `flush_interval_s` seconds after its first row.
It encodes the chunk (safetensors + SHA-256), writes the blob to S3 and only then XADDs its
`ChunkRef`. S3 down: the chunk is dropped (counted, logged once per outage). Redis down: the ref
waits in a bounded queue (oldest dropped, counted) and is retried; serving never waits on either.

Memory: `buffers` x `chunk_tokens` rows x (8H + 25) bytes (H = hidden size; 28 MB for the reference
model at the defaults 3 x 2048), plus one chunk being encoded and uploaded.
loss_mask = 1 for rows whose next token is generated output (position >= prompt length - 1).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import redis

from services.inference import metrics
from tide import blobs, streams
from tide.chunks import ChunkBuilder, ChunkInvalid, encode_chunk, learnable_rows

log = logging.getLogger(__name__)


@dataclass
class ExporterStats:
    chunks_written: int = 0  # blob in S3 and ref on the stream
    tokens_exported: int = 0
    bytes_written: int = 0
    tokens_dropped_full: int = 0  # rows dropped because every buffer was full
    chunks_dropped_invalid: int = 0  # chunks that failed validation (e.g. non-finite states)
    chunks_dropped_s3: int = 0  # chunks whose blob could not be written
    tokens_dropped_s3: int = 0
    refs_dropped: int = 0  # refs of stored blobs dropped while Redis was down (pending queue full)
    s3_errors: int = 0
    redis_errors: int = 0


@dataclass
class _Buffer:
    builder: ChunkBuilder
    draft_version: str = ""
    workloads: set[str] = field(default_factory=set)
    opened_s: float = 0.0  # monotonic time of the first row


class ChunkExporter:
    def __init__(self, s3, bucket: str, redis_client: redis.Redis, stream: str, *, target_model: str,
                 worker_id: str, hidden_size: int, chunk_tokens: int = 2048, buffers: int = 3,
                 flush_interval_s: float = 30.0, key_prefix: str = "chunks", pin_memory: bool = False,
                 max_pending_refs: int = 1000) -> None:
        if buffers < 1 or chunk_tokens < 1:
            raise ValueError("buffers and chunk_tokens must be >= 1")
        self.s3, self.bucket, self.redis, self.stream = s3, bucket, redis_client, stream
        self.target_model, self.worker_id = target_model, worker_id
        self.flush_interval_s, self.key_prefix = flush_interval_s, key_prefix.strip("/")
        self.stats = ExporterStats()
        self._free = [_Buffer(ChunkBuilder(chunk_tokens, hidden_size, target_model, worker_id, pin_memory))
                      for _ in range(buffers)]
        self._active: _Buffer | None = self._free.pop()
        self._full: deque[_Buffer] = deque()
        self._refs: deque[streams.ChunkRef] = deque(maxlen=max_pending_refs)
        self._draft_version = ""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._flush_now = False
        self._idle = threading.Event()
        self._thread: threading.Thread | None = None
        self._s3_down = self._redis_down = self._dropping = False

    # ---- engine loop thread

    def add(self, rows, prompt_lens: Mapping[str, int]) -> None:
        """Capture hook: copy `rows` (list of engine CapturedRows) into the active buffer."""
        with self._lock:
            for r in rows:
                n = len(r.token_ids)
                pos, mask = learnable_rows(r.start, n, prompt_lens.get(r.request_id, 0))
                off = 0
                while off < n:
                    buf = self._active_locked()
                    if buf is None:
                        self._drop_full(n - off)
                        break
                    if buf.builder.num_tokens == 0:
                        buf.opened_s = time.monotonic()
                        buf.draft_version = self._draft_version
                    off += buf.builder.append(r.request_id, r.token_ids[off:], pos[off:], r.aux[off:],
                                              r.final[off:], mask[off:])
                    buf.workloads.add(r.workload)
                    if buf.builder.free == 0:
                        self._rotate_locked()

    def set_draft_version(self, version: str) -> None:
        """The draft now serving; a partial chunk of another version is closed first."""
        with self._lock:
            if version != self._draft_version and self._active and self._active.builder.num_tokens:
                self._rotate_locked()
                self._wake.set()
            self._draft_version = version

    def flush_soon(self) -> None:
        """Close the partial chunk and write it in the background (collection turned off, shutdown)."""
        self._flush_now = True
        self._idle.clear()
        self._wake.set()

    # ---- any thread

    def start(self) -> ChunkExporter:
        self._thread = threading.Thread(target=self._run, name="chunk-flusher", daemon=True)
        self._thread.start()
        return self

    def wait_idle(self, timeout_s: float) -> bool:
        """After `flush_soon`: wait until everything buffered was written (or dropped)."""
        return self._idle.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Write what is buffered (one attempt), then stop the flusher."""
        self._flush_now = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    @property
    def pending_refs(self) -> int:
        return len(self._refs)

    # ---- internals (lock held)

    def _active_locked(self) -> _Buffer | None:
        if self._active is None and self._free:
            self._active = self._free.pop()
            if self._dropping:
                log.warning("chunk export: buffers available again; collecting")
                self._dropping = False
        return self._active

    def _rotate_locked(self) -> None:
        if self._active is not None and self._active.builder.num_tokens:
            self._full.append(self._active)
            self._active = None
            self._wake.set()

    def _drop_full(self, n: int) -> None:
        if not self._dropping:
            log.warning("chunk export: all %d buffers are full (S3 slow or down); dropping rows", len(self._full))
            self._dropping = True
        self.stats.tokens_dropped_full += n
        metrics.CHUNK_TOKENS_DROPPED.labels("buffers_full").inc(n)

    # ---- flusher thread

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            self._wake.wait(min(1.0, self.flush_interval_s / 4))
            self._wake.clear()
            with self._lock:
                a = self._active
                due = a is not None and a.builder.num_tokens and time.monotonic() - a.opened_s >= self.flush_interval_s
                if due or self._flush_now:
                    self._flush_now = False
                    self._rotate_locked()
                ready = list(self._full)
                self._full.clear()
            for buf in ready:
                self._write(buf)
            self._announce_pending()
            with self._lock:
                if not self._full and not self._flush_now:
                    self._idle.set()
            if stopping:
                return

    def _write(self, buf: _Buffer) -> None:
        workload = next(iter(buf.workloads)) if len(buf.workloads) == 1 else ""
        chunk = buf.builder.flush(draft_version=buf.draft_version, workload=workload)  # copies the rows
        buf.workloads = set()
        with self._lock:
            self._free.append(buf)
        if chunk is None:
            return
        n = chunk.num_tokens
        try:
            data = encode_chunk(chunk)
        except ChunkInvalid as e:
            self.stats.chunks_dropped_invalid += 1
            metrics.CHUNKS_DROPPED.labels("invalid").inc()
            metrics.CHUNK_TOKENS_DROPPED.labels("invalid").inc(n)
            log.error("chunk export: dropping an invalid chunk: %s", e)
            return
        try:
            key = f"{self.key_prefix}/{self.target_model}/{self.worker_id}/{chunk.meta.chunk_id}.safetensors"
            info = blobs.put_bytes(self.s3, self.bucket, key, data, metadata={"chunk-id": chunk.meta.chunk_id})
        except Exception as e:  # S3 down, bucket missing, ...: drop, count, keep serving
            self.stats.s3_errors += 1
            self.stats.chunks_dropped_s3 += 1
            self.stats.tokens_dropped_s3 += n
            metrics.CHUNKS_DROPPED.labels("s3").inc()
            metrics.CHUNK_TOKENS_DROPPED.labels("s3").inc(n)
            if not self._s3_down:
                log.warning("chunk export: S3 write failed (%s); dropping chunks until it works again", e)
                self._s3_down = True
            return
        if self._s3_down:
            log.warning("chunk export: S3 writes work again")
            self._s3_down = False
        self.stats.bytes_written += info.size_bytes
        metrics.CHUNK_BYTES.inc(info.size_bytes)
        ref = streams.ChunkRef(
            chunk_id=chunk.meta.chunk_id, bucket=self.bucket, key=key, size_bytes=info.size_bytes,
            sha256=info.sha256, num_tokens=n, target_model=self.target_model, draft_version=buf.draft_version,
            workload=workload, worker_id=self.worker_id, created_unix_s=chunk.meta.created_at)
        if len(self._refs) == self._refs.maxlen:
            self.stats.refs_dropped += 1
            metrics.CHUNKS_DROPPED.labels("ref_queue_full").inc()
        self._refs.append(ref)  # a full deque drops its oldest ref

    def _announce_pending(self) -> None:
        """XADD waiting refs in order; stop at the first failure (retried on the next round)."""
        while self._refs:
            ref = self._refs[0]
            try:
                streams.add(self.redis, self.stream, ref)
            except redis.RedisError as e:
                self.stats.redis_errors += 1
                if not self._redis_down:
                    log.warning("chunk export: redis unreachable (%s); %d chunk refs waiting", e, len(self._refs))
                    self._redis_down = True
                return
            self._refs.popleft()
            self.stats.chunks_written += 1
            self.stats.tokens_exported += ref.num_tokens
            metrics.CHUNKS_WRITTEN.inc()
            metrics.CHUNK_TOKENS.inc(ref.num_tokens)
            if self._redis_down:
                log.warning("chunk export: redis reachable again")
                self._redis_down = False

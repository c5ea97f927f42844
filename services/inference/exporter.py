"""Training Signal Extractor: accepted tokens' target states -> host buffers -> S3 chunk -> stream ref.

`add` is the capture hook (engine loop thread, only while collection is on): it copies each
committed row (prompt rows and accepted tokens; see `tide.chunks` for what a row is) into the
active preallocated `ChunkBuilder`. A full builder is handed to the background flusher and the
next free one becomes active; with none free (the flusher is behind) rows are dropped and
counted. The flusher also closes a partial chunk `flush_interval_s` seconds after its first row.
It encodes the chunk (safetensors + SHA-256), writes the blob to S3 and only then XADDs its
`ChunkRef`; serving never waits on either.

S3 down: the chunk goes to the on-disk spool (`ChunkSpool`, when one is configured) and is uploaded
from there, oldest first, once S3 answers again (retried with exponential backoff, 0.5 s doubling
to 30 s; while spooled chunks wait, new ones join the spool behind them instead of each waiting out
a failing S3 call). The spool is a byte budget, oldest first: a new chunk that does not fit evicts
the oldest spooled chunks (never the one being uploaded) until it does ("spool_evicted", and
`tide_chunk_spool_deleted_total{reason="budget"}`). A chunk is dropped (counted by reason) only then,
when it cannot fit even so ("spool_full": bigger than the budget, or the rest is waiting refs), when
the spool is unwritable ("spool_error"), when a spooled blob fails its checksum on reading
back ("spool_corrupt"), or, without a spool, at once ("s3"). Redis down: the ref waits in a
bounded queue (`max_pending_refs`; beyond it the oldest is dropped and counted, "ref_queue_full":
its blob is in S3, where the trainer's reconciler finds it) and is retried; waiting refs are also
written to the spool, so a restarted worker announces them. On start the exporter re-sends what its
spool holds from a previous run (spooled chunks and waiting refs alike).

Killed between the blob and its ref: before each direct S3 write the ref goes to the spool as an
"intent" (a JSON of ~0.5 KB; one per chunk of 2048 tokens), removed once the ref is XADDed. A
restarted worker asks S3 about each intent it finds: a stored blob of the right size is announced
(seconds after the restart, not when the trainer's reconciler finds it minutes later), a missing one
was never written and the intent is dropped; while S3 does not answer, it asks again every round.

Governance: only rows of requests eligible for training reach `add` (the worker filters on each
request's `capture` flag, which the gateway sets from `store`, the API key's policy and the
stack-wide TIDE_TRAIN_ON_TRAFFIC); each chunk records its rows' request ids and API key ids, and
its bytes are sealed (AES-256-GCM, tide/datakeys.py) before they reach S3 or the spool.

Memory: `buffers` x `chunk_tokens` rows x (8H + 25) bytes (H = hidden size; 28 MB for the reference
model at the defaults 3 x 2048), plus one chunk being encoded and uploaded.
loss_mask = 1 for rows whose next token is generated output (position >= prompt length - 1).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import redis

from services.inference import metrics
from tide import blobs, streams
from tide.chunks import ChunkBuilder, ChunkInvalid, encode_chunk, learnable_rows
from tide.datakeys import Keyring
from tide.resources import one_torch_thread

log = logging.getLogger(__name__)

RETRY_MIN_S, RETRY_MAX_S = 0.5, 30.0  # backoff of the spooled chunks' upload attempts


@dataclass
class ExporterStats:
    chunks_written: int = 0  # blob in S3 and ref on the stream
    tokens_exported: int = 0
    bytes_written: int = 0
    tokens_dropped_full: int = 0  # rows dropped because every buffer was full
    chunks_dropped_invalid: int = 0  # chunks that failed validation (e.g. non-finite states)
    chunks_dropped_s3: int = 0  # chunks whose blob never reached S3 (spool full, unwritable or corrupt; no spool)
    tokens_dropped_s3: int = 0
    chunks_dropped_spool_full: int = 0  # of chunks_dropped_s3: the spool had no room, even evicting
    chunks_evicted_spool: int = 0  # of chunks_dropped_s3: spooled, then evicted (oldest first) for a newer one
    bytes_evicted_spool: int = 0
    chunks_spooled: int = 0  # chunks written to the spool because S3 failed (or spooled ones were waiting)
    tokens_spooled: int = 0
    chunks_unspooled: int = 0  # spooled chunks uploaded to S3 after all
    refs_dropped: int = 0  # refs of stored blobs dropped while Redis was down (pending queue full)
    s3_errors: int = 0
    redis_errors: int = 0
    spool_errors: int = 0  # spool files that could not be written, read or removed


# ------------------------------------------------------------------------------------------ spool


class SpoolCorrupt(Exception):
    """A spooled entry that cannot be used (unreadable metadata, a blob that fails its checksum)."""


@dataclass
class SpoolEntry:
    """One spooled item: `state` "blob" = the chunk's bytes are in the spool (upload, then announce);
    "ref" = the blob is in S3, the reference waits for Redis; "intent" = the blob was being written
    straight to S3 (stored or not: ask S3). `ref` describes the blob exactly."""

    seq: int
    name: str  # file name stem: "<seq>-<chunk id>"
    state: str
    ref: streams.ChunkRef
    size: int = 0  # bytes on disk (metadata + blob)


class ChunkSpool:
    """A bounded directory of chunks that could not be written to S3 and of references that could not
    be added to the stream. Used by one thread (the flusher); the directory must be one worker's own.

    Each entry is `<seq>-<chunk id>.json` — {"format": 1, "state": "blob" | "ref" | "intent", "ref": {ChunkRef}}
    — plus, in state "blob", `<seq>-<chunk id>.safetensors`: the encoded chunk exactly as it is to be
    stored in S3 (no pickle). Files are written to a temporary name, fsynced and renamed, the blob
    before its JSON: the JSON is the entry's commit. `seq` orders entries (oldest first) across
    restarts. `open()` removes temporary files, blobs without a JSON (a crash mid-write) and blobs of
    "ref" entries (a crash between the two steps of `mark_stored`); unreadable JSON is dropped and
    counted. A blob is verified (size, SHA-256 against its ref) whenever it is read back.
    `bytes` (every entry's files) never exceeds `max_bytes`: `put_*` returns None when full (the
    exporter evicts its oldest chunks first, `entry_size` says how much room a new one needs).
    """

    FORMAT = 1

    def __init__(self, directory: str | Path, max_bytes: int) -> None:
        self.dir, self.max_bytes = Path(directory), max_bytes
        self.bytes = 0
        self.entries: dict[int, SpoolEntry] = {}
        self._next = 0

    def open(self) -> tuple[list[SpoolEntry], int]:
        """Scan the directory (created on the first write): (its usable entries oldest first, how many
        were unusable and removed)."""
        if not self.dir.is_dir():
            return [], 0
        files = {p.name: p for p in self.dir.iterdir() if p.is_file()}
        bad = 0
        for name, path in files.items():
            if name.startswith("."):  # an interrupted write
                path.unlink(missing_ok=True)
        for name, path in sorted(files.items()):
            if not name.endswith(".json") or name.startswith("."):
                continue
            stem = name[:-5]
            blob = files.get(stem + ".safetensors")
            try:
                entry = self._parse(stem, path.read_bytes())
            except (OSError, SpoolCorrupt) as e:
                log.error("chunk spool: dropping unreadable entry %s: %s", path, e)
                bad += 1
                path.unlink(missing_ok=True)
                if blob is not None:
                    blob.unlink(missing_ok=True)
                continue
            if entry.state == "blob" and blob is None:
                log.error("chunk spool: entry %s has lost its blob; dropping it", path)
                bad += 1
                path.unlink(missing_ok=True)
                continue
            if entry.state == "ref" and blob is not None:
                blob.unlink(missing_ok=True)  # stored in S3 before a crash: only the ref is left to send
            entry.size = path.stat().st_size + (blob.stat().st_size if entry.state == "blob" else 0)
            self.entries[entry.seq] = entry
            self.bytes += entry.size
        for name, path in files.items():  # a blob whose JSON was never written: the write did not finish
            if name.endswith(".safetensors") and not name.startswith(".") and name[:-12] + ".json" not in files:
                log.warning("chunk spool: removing %s (its write did not finish)", path)
                path.unlink(missing_ok=True)
        self._next = max(self.entries, default=-1) + 1
        return [self.entries[k] for k in sorted(self.entries)], bad

    def entry_size(self, ref: streams.ChunkRef, data: bytes | None) -> int:
        """The bytes a new entry for `ref` (with `data`: state "blob") takes in the spool."""
        return len(self._meta("blob" if data is not None else "ref", ref)) + (len(data) if data is not None else 0)

    def put_chunk(self, ref: streams.ChunkRef, data: bytes) -> SpoolEntry | None:
        """Spool a chunk's bytes (state "blob"); None when it does not fit. OSError: disk trouble."""
        return self._put("blob", ref, data)

    def put_ref(self, ref: streams.ChunkRef) -> SpoolEntry | None:
        """Spool a reference whose blob is stored (state "ref"); None when it does not fit."""
        return self._put("ref", ref, None)

    def put_intent(self, ref: streams.ChunkRef) -> SpoolEntry | None:
        """Spool a reference whose blob is about to be written to S3 (state "intent"); None when full."""
        return self._put("intent", ref, None)

    def read_blob(self, entry: SpoolEntry) -> bytes:
        """The spooled chunk's bytes, verified against its ref (SpoolCorrupt otherwise)."""
        try:
            data = (self.dir / f"{entry.name}.safetensors").read_bytes()
        except OSError as e:
            raise SpoolCorrupt(f"blob of {entry.name} unreadable: {e}") from None
        if len(data) != entry.ref.size_bytes or blobs.sha256_hex(data) != entry.ref.sha256:
            raise SpoolCorrupt(f"blob of {entry.name} has {len(data)} bytes with SHA-256 "
                               f"{blobs.sha256_hex(data)}, its ref says {entry.ref.size_bytes} bytes with "
                               f"{entry.ref.sha256}")
        return data

    def mark_stored(self, entry: SpoolEntry) -> None:
        """The blob is in S3: keep only the ref (the JSON rewritten first, then the blob removed; an
        "intent" has no blob)."""
        meta = self._meta("ref", entry.ref)
        self._atomic_write(self.dir / f"{entry.name}.json", meta)
        (self.dir / f"{entry.name}.safetensors").unlink(missing_ok=True)
        self.bytes -= entry.size - len(meta)
        entry.state, entry.size = "ref", len(meta)

    def remove(self, entry: SpoolEntry) -> None:
        if self.entries.pop(entry.seq, None) is None:
            return
        self.bytes -= entry.size
        for suffix in (".json", ".safetensors"):  # the commit first: a blob left alone is cleaned up on open
            (self.dir / f"{entry.name}{suffix}").unlink(missing_ok=True)

    def count(self, state: str) -> int:
        return sum(e.state == state for e in self.entries.values())

    # -- internals

    def _put(self, state: str, ref: streams.ChunkRef, data: bytes | None) -> SpoolEntry | None:
        meta = self._meta(state, ref)
        size = len(meta) + (len(data) if data is not None else 0)
        if self.bytes + size > self.max_bytes:
            return None
        seq = self._next
        self._next += 1
        name = f"{seq:012d}-{re.sub(r'[^A-Za-z0-9_-]', '_', ref.chunk_id)[:80]}"
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            if data is not None:
                self._atomic_write(self.dir / f"{name}.safetensors", data)
            self._atomic_write(self.dir / f"{name}.json", meta)
        except OSError:
            (self.dir / f"{name}.safetensors").unlink(missing_ok=True)
            raise
        entry = SpoolEntry(seq, name, state, ref, size)
        self.entries[seq] = entry
        self.bytes += size
        return entry

    def _meta(self, state: str, ref: streams.ChunkRef) -> bytes:
        return json.dumps({"format": self.FORMAT, "state": state, "ref": dataclasses.asdict(ref)},
                          separators=(",", ":"), sort_keys=True).encode()

    def _parse(self, stem: str, raw: bytes) -> SpoolEntry:
        try:
            meta = json.loads(raw)
            if not isinstance(meta, dict) or meta.get("format") != self.FORMAT:
                raise SpoolCorrupt(f"format {meta.get('format') if isinstance(meta, dict) else meta!r}, "
                                   f"this code reads {self.FORMAT}")
            if meta.get("state") not in ("blob", "ref", "intent"):
                raise SpoolCorrupt(f"state {meta.get('state')!r}")
            ref = streams.from_dict(streams.ChunkRef, meta.get("ref"))
            seq = int(stem.split("-", 1)[0])
        except (ValueError, streams.PayloadError) as e:  # JSONDecodeError and PayloadError are ValueErrors
            raise SpoolCorrupt(str(e)) from None
        return SpoolEntry(seq, stem, meta["state"], ref)

    def _atomic_write(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a power cut
        finally:
            os.close(fd)


# --------------------------------------------------------------------------------------- exporter


@dataclass
class _Buffer:
    builder: ChunkBuilder
    draft_version: str = ""
    workloads: set[str] = field(default_factory=set)
    opened_s: float = 0.0  # monotonic time of the first row


@dataclass
class _PendingRef:
    ref: streams.ChunkRef
    entry: SpoolEntry | None = None  # its spool entry, once it has one


class ChunkExporter:
    """See the module docstring. Threads: the engine's (`add`), the flusher ("chunk-flusher": encodes,
    writes new chunks to S3 or the spool, XADDs refs) and, with a spool, the unspooler
    ("chunk-unspooler": uploads spooled chunks with backoff, so a hung S3 never stalls the flusher
    on a retry). `_io` guards the spool, the spooled-chunk backlog and the pending refs."""

    def __init__(self, s3, bucket: str, redis_client: redis.Redis, stream: str, *, target_model: str,
                 worker_id: str, hidden_size: int, chunk_tokens: int = 2048, buffers: int = 3,
                 flush_interval_s: float = 30.0, key_prefix: str = "chunks", pin_memory: bool = False,
                 max_pending_refs: int = 1000, spool_dir: str | Path | None = None,
                 spool_max_bytes: int = 1 << 30, keyring: Keyring | None = None) -> None:
        if buffers < 1 or chunk_tokens < 1 or max_pending_refs < 1:
            raise ValueError("buffers, chunk_tokens and max_pending_refs must be >= 1")
        self.s3, self.bucket, self.redis, self.stream = s3, bucket, redis_client, stream
        self.target_model, self.worker_id = target_model, worker_id
        self.flush_interval_s, self.key_prefix = flush_interval_s, key_prefix.strip("/")
        self.stats = ExporterStats()
        # seals every blob before it leaves memory (S3 and the spool alike); empty = in the clear
        self.keyring = keyring if keyring is not None else Keyring.empty()
        self._free = [_Buffer(ChunkBuilder(chunk_tokens, hidden_size, target_model, worker_id, pin_memory))
                      for _ in range(buffers)]
        self._active: _Buffer | None = self._free.pop()
        self._full: deque[_Buffer] = deque()
        self._max_refs = max_pending_refs
        self._refs: deque[_PendingRef] = deque()
        self._draft_version = ""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._flush_now = False
        self._idle = threading.Event()
        self._thread: threading.Thread | None = None
        self._s3_down = self._redis_down = self._dropping = self._spool_full = False
        # the spool: chunks waiting for S3 (oldest first), and when to try S3 with them next
        self._io = threading.RLock()
        self._unspool_wake = threading.Event()
        self._unspooler: threading.Thread | None = None
        self._backlog: deque[SpoolEntry] = deque()
        self._intents: list[SpoolEntry] = []  # a previous run's, until S3 says whether their blobs are stored
        self._uploading: SpoolEntry | None = None  # the backlog's chunk the unspooler is uploading (never evicted)
        self._retry_at, self._retry_s = 0.0, RETRY_MIN_S
        self.spool = ChunkSpool(spool_dir, spool_max_bytes) if spool_dir and spool_max_bytes > 0 else None
        if self.spool is not None:
            self._open_spool()

    # ---- engine loop thread

    def add(self, rows, prompt_lens: Mapping[str, int], key_ids: Mapping[str, str] | None = None) -> None:
        """Capture hook: copy `rows` (list of engine CapturedRows) into the active buffer. With
        `key_ids` (request id -> API key id) only the rows of the requests it names are taken: the
        others opted out of training (the worker filters them already; this is the second lock)."""
        with self._lock:
            for r in rows:
                if key_ids is not None and r.request_id not in key_ids:
                    continue
                key_id = key_ids[r.request_id] if key_ids is not None else ""
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
                                              r.final[off:], mask[off:], key_id=key_id)
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
        if self.spool is not None:
            self._unspooler = threading.Thread(target=self._unspool_loop, name="chunk-unspooler", daemon=True)
            self._unspooler.start()
        return self

    def wait_idle(self, timeout_s: float) -> bool:
        """After `flush_soon`: wait until everything buffered was written, spooled or dropped."""
        return self._idle.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Write what is buffered (one attempt; to the spool while S3 is failing), then stop the
        threads. What is still spooled stays there for the next start."""
        self._flush_now = True
        self._stop.set()
        self._wake.set()
        self._unspool_wake.set()
        deadline = time.monotonic() + timeout_s
        for t in (self._thread, self._unspooler):
            if t is not None:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        if not any(t is not None and t.is_alive() for t in (self._thread, self._unspooler)):
            self._announce_pending()  # refs of chunks the unspooler stored after the flusher's last round

    @property
    def pending_refs(self) -> int:
        return len(self._refs)

    @property
    def spooled_chunks(self) -> int:
        """Chunks in the spool waiting for S3."""
        return len(self._backlog)

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

    # ---- flusher thread (and __init__, before any thread starts)

    def _open_spool(self) -> None:
        """Take over what a previous run left in the spool: chunks to upload, refs to announce."""
        entries, bad = self.spool.open()
        for _ in range(bad):
            self._count_dropped("spool_corrupt", None)
        for entry in entries:
            if entry.state == "blob":
                self._backlog.append(entry)
            elif entry.state == "intent":
                self._intents.append(entry)
            else:
                self._queue_ref(entry.ref, entry)
        if entries:
            log.warning("chunk export: spool %s holds %d chunks, %d refs and %d interrupted writes from a previous "
                        "run (%d bytes); re-sending them", self.spool.dir, len(self._backlog), len(self._refs),
                        len(self._intents), self.spool.bytes)

    def _resolve_intents(self) -> None:
        """Announce the previous run's interrupted writes whose blobs S3 holds; drop the others."""
        for entry in list(self._intents):
            try:
                info = blobs.stat(self.s3, entry.ref.bucket, entry.ref.key)
            except Exception as e:
                if getattr(e, "code", None) not in ("NoSuchKey", "NoSuchObject"):
                    log.warning("chunk export: cannot ask S3 about %s yet (%s)", entry.ref.key, e)
                    return  # S3 not answering: ask again next round
                info = None
            self._intents.remove(entry)
            with self._io:
                if info is not None and info.size_bytes == entry.ref.size_bytes:
                    log.warning("chunk export: announcing %s, stored before the previous run stopped",
                                entry.ref.chunk_id)
                    self._queue_ref(entry.ref, entry)
                else:  # its rows went with the previous run: nothing was stored
                    log.warning("chunk export: %s was never stored (the previous run stopped mid-write)",
                                entry.ref.chunk_id)
                    self._forget(entry)
        self._spool_gauges()

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            self._wake.wait(min(1.0, self.flush_interval_s / 4))
            self._wake.clear()
            if self._intents:
                self._resolve_intents()
            with self._lock:
                a = self._active
                due = a is not None and a.builder.num_tokens and time.monotonic() - a.opened_s >= self.flush_interval_s
                if due or self._flush_now:
                    self._flush_now = False
                    self._rotate_locked()
                ready = list(self._full)
                self._full.clear()
            with one_torch_thread():  # copying and checking rows: never a second OpenMP pool beside the engine's
                for buf in ready:
                    self._write(buf)
                    # each blob's reference right after the blob: a worker killed in between leaves at most
                    # one blob that only the trainer's reconciler finds (minutes later), not a round's worth
                    self._announce_pending()
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
            data = self.keyring.seal(encode_chunk(chunk))  # sealed before S3 or the spool sees a byte
        except ChunkInvalid as e:
            self.stats.chunks_dropped_invalid += 1
            metrics.CHUNKS_DROPPED.labels("invalid").inc()
            metrics.CHUNK_TOKENS_DROPPED.labels("invalid").inc(n)
            log.error("chunk export: dropping an invalid chunk: %s", e)
            return
        key = f"{self.key_prefix}/{self.target_model}/{self.worker_id}/{chunk.meta.chunk_id}.safetensors"
        ref = streams.ChunkRef(
            chunk_id=chunk.meta.chunk_id, bucket=self.bucket, key=key, size_bytes=len(data),
            sha256=blobs.sha256_hex(data), num_tokens=n, target_model=self.target_model,
            draft_version=buf.draft_version, workload=workload, worker_id=self.worker_id,
            created_unix_s=chunk.meta.created_at, request_ids=list(chunk.meta.request_ids),
            key_ids=list(chunk.meta.key_ids), data_key_id=self.keyring.current)
        with self._io:
            behind = bool(self._backlog)
        if behind:  # S3 is failing (or catching up): queue behind the spooled chunks, oldest first
            self._spool(ref, data)
            return
        intent = self._intent(ref)
        try:
            self._put(ref, data)
        except Exception as e:  # S3 down, bucket missing, ...: spool (or drop), count, keep serving
            self._s3_failed(e)
            with self._io:
                self._forget(intent)
            self._spool(ref, data)
            return
        with self._io:
            self._queue_ref(ref, intent)

    def _intent(self, ref: streams.ChunkRef) -> SpoolEntry | None:
        """Spool `ref` as an "intent" before its blob goes to S3 (None without a spool, or if it cannot:
        a kill in between then leaves the blob to the trainer's reconciler, as without a spool)."""
        if self.spool is None:
            return None
        with self._io:
            try:
                return self.spool.put_intent(ref)
            except OSError as e:
                self.stats.spool_errors += 1
                log.error("chunk export: cannot write an intent to the spool %s (%s)", self.spool.dir, e)
                return None

    def _spool(self, ref: streams.ChunkRef, data: bytes) -> None:
        if self.spool is None:
            self._count_dropped("s3", ref)
            return
        with self._io:
            try:
                need = self.spool.entry_size(ref, data)
                if self.spool.bytes + need > self.spool.max_bytes:
                    self._make_room(need)
                entry = self.spool.put_chunk(ref, data)
            except OSError as e:
                self.stats.spool_errors += 1
                log.error("chunk export: cannot write chunk %s to the spool %s (%s); dropping it", ref.chunk_id,
                          self.spool.dir, e)
                self._count_dropped("spool_error", ref)
                return
            if entry is None:
                if not self._spool_full:
                    log.warning("chunk export: spool %s is full (%d of %d bytes) and has no chunk left to evict for "
                                "one of %d bytes; dropping chunks until it drains", self.spool.dir, self.spool.bytes,
                                self.spool.max_bytes, self.spool.entry_size(ref, data))
                    self._spool_full = True
                self.stats.chunks_dropped_spool_full += 1
                self._count_dropped("spool_full", ref)
                return
            self._backlog.append(entry)
            self.stats.chunks_spooled += 1
            self.stats.tokens_spooled += ref.num_tokens
            metrics.CHUNKS_SPOOLED.inc()
            self._spool_gauges()
        self._unspool_wake.set()

    def _make_room(self, need: int) -> None:
        """(`_io` held) Evict the oldest spooled chunks (not the one in upload) until `need` more bytes
        fit; none when even evicting all of them would not make room."""
        victims = [e for e in self._backlog if e is not self._uploading]
        if self.spool.max_bytes - self.spool.bytes + sum(e.size for e in victims) < need:
            return
        first = True
        for entry in victims:
            if self.spool.bytes + need <= self.spool.max_bytes:
                break
            if first and not self._spool_full:
                log.warning("chunk export: spool %s is full (%d of %d bytes); evicting its oldest chunks for new ones "
                            "until S3 takes them", self.spool.dir, self.spool.bytes, self.spool.max_bytes)
                self._spool_full = True
            first = False
            size = entry.size
            self._backlog.remove(entry)
            self._forget(entry)
            self.stats.chunks_evicted_spool += 1
            self.stats.bytes_evicted_spool += size
            metrics.SPOOL_DELETED.labels("budget").inc()
            metrics.SPOOL_BYTES_DELETED.labels("budget").inc(size)
            self._count_dropped("spool_evicted", entry.ref)

    def _count_dropped(self, reason: str, ref: streams.ChunkRef | None) -> None:
        """A chunk that never reached S3 (`ref` None: an unreadable spool entry, size unknown)."""
        self.stats.chunks_dropped_s3 += 1
        metrics.CHUNKS_DROPPED.labels(reason).inc()
        if ref is not None:
            self.stats.tokens_dropped_s3 += ref.num_tokens
            metrics.CHUNK_TOKENS_DROPPED.labels(reason).inc(ref.num_tokens)

    def _announce_pending(self) -> None:
        """XADD waiting refs in order; stop at the first failure (retried on the next round) after
        writing the refs not yet in the spool there."""
        while True:
            with self._io:
                if not self._refs:
                    return
                pending = self._refs[0]
            try:
                streams.add(self.redis, self.stream, pending.ref)
            except redis.RedisError as e:
                self.stats.redis_errors += 1
                if not self._redis_down:
                    log.warning("chunk export: redis unreachable (%s); %d chunk refs waiting", e, len(self._refs))
                    self._redis_down = True
                self._spool_refs()
                return
            with self._io:
                if self._refs and self._refs[0] is pending:  # (not dropped meanwhile by a full queue)
                    self._refs.popleft()
                self._forget(pending.entry)
            self.stats.chunks_written += 1
            self.stats.tokens_exported += pending.ref.num_tokens
            metrics.CHUNKS_WRITTEN.inc()
            metrics.CHUNK_TOKENS.inc(pending.ref.num_tokens)
            if self._redis_down:
                log.warning("chunk export: redis reachable again")
                self._redis_down = False

    def _spool_refs(self) -> None:
        """Make waiting refs durable (a full spool leaves them in memory only)."""
        if self.spool is None:
            return
        with self._io:
            for pending in self._refs:
                if pending.entry is not None and pending.entry.state == "intent":
                    try:  # the blob is stored: the entry becomes a plain waiting ref
                        self.spool.mark_stored(pending.entry)
                    except OSError as e:  # stays an intent: a restart asks S3, which says stored
                        self.stats.spool_errors += 1
                        log.error("chunk export: cannot update spool entry %s (%s)", pending.entry.name, e)
                if pending.entry is not None:
                    continue
                try:
                    pending.entry = self.spool.put_ref(pending.ref)
                except OSError as e:
                    self.stats.spool_errors += 1
                    log.error("chunk export: cannot write a ref to the spool %s (%s)", self.spool.dir, e)
                    break
                if pending.entry is None:
                    break
            self._spool_gauges()

    # ---- unspooler thread

    def _unspool_loop(self) -> None:
        """Upload spooled chunks, oldest first; after a failure wait (0.5 s doubling to 30 s)."""
        while not self._stop.is_set():
            with self._io:
                entry = self._backlog[0] if self._backlog else None
                wait_s = self._retry_at - time.monotonic()
                self._uploading = entry if entry is not None and wait_s <= 0 else None
            if entry is None or wait_s > 0:
                self._unspool_wake.wait(1.0 if entry is None else min(wait_s, 1.0))
                self._unspool_wake.clear()
                continue
            try:
                self._unspool(entry)
            except Exception:  # never let the thread die: log, back off, go on
                log.exception("chunk export: uploading spooled chunk %s failed", entry.ref.chunk_id)
                self._s3_failed(None)
            finally:
                with self._io:
                    self._uploading = None

    def _unspool(self, entry: SpoolEntry) -> None:
        try:
            data = self.spool.read_blob(entry)
        except SpoolCorrupt as e:
            log.error("chunk export: dropping spooled chunk %s: %s", entry.ref.chunk_id, e)
            with self._io:
                self._backlog.remove(entry)
                self._forget(entry)
                self._count_dropped("spool_corrupt", entry.ref)
            return
        try:
            self._put(entry.ref, data)
        except Exception as e:
            self._s3_failed(e)
            return
        with self._io:
            self._backlog.remove(entry)  # (the oldest: the entry in upload is never evicted)
            self.stats.chunks_unspooled += 1
            metrics.CHUNKS_UNSPOOLED.inc()
            try:
                self.spool.mark_stored(entry)
            except OSError as e:  # the blob stays spooled: a restart would upload it again (same key)
                self.stats.spool_errors += 1
                log.error("chunk export: cannot update spool entry %s (%s)", entry.name, e)
            self._queue_ref(entry.ref, entry)
            if not self._backlog:
                self._spool_full = False
                log.warning("chunk export: every spooled chunk is in S3 now")
            self._spool_gauges()
        self._wake.set()  # the flusher announces the ref

    # ---- both

    def _put(self, ref: streams.ChunkRef, data: bytes) -> None:
        """Store the blob (raises what the S3 client raises)."""
        info = blobs.put_bytes(self.s3, ref.bucket, ref.key, data, metadata={"chunk-id": ref.chunk_id})
        with self._io:
            if self._s3_down:
                log.warning("chunk export: S3 writes work again")
                self._s3_down = False
            self._retry_s = RETRY_MIN_S
            self.stats.bytes_written += info.size_bytes
        metrics.CHUNK_BYTES.inc(info.size_bytes)

    def _s3_failed(self, e: Exception | None) -> None:
        with self._io:
            self._retry_at = time.monotonic() + self._retry_s
            self._retry_s = min(self._retry_s * 2, RETRY_MAX_S)
            if e is None:
                return
            self.stats.s3_errors += 1
            if not self._s3_down:
                what = "spooling chunks" if self.spool is not None else "dropping chunks"
                log.warning("chunk export: S3 write failed (%s); %s until it works again", e, what)
                self._s3_down = True

    def _queue_ref(self, ref: streams.ChunkRef, entry: SpoolEntry | None = None) -> None:
        """(`_io` held) A ref to announce; a full queue drops its oldest (the trainer's reconciler
        finds that blob in S3)."""
        if len(self._refs) >= self._max_refs:
            old = self._refs.popleft()
            self._forget(old.entry)
            self.stats.refs_dropped += 1
            metrics.CHUNKS_DROPPED.labels("ref_queue_full").inc()
        self._refs.append(_PendingRef(ref, entry))

    def _forget(self, entry: SpoolEntry | None) -> None:
        """(`_io` held) Remove a spool entry that is done with."""
        if entry is None or self.spool is None:
            return
        try:
            self.spool.remove(entry)
        except OSError as e:  # sent twice after a restart at worst: the trainer dedupes by chunk id
            self.stats.spool_errors += 1
            log.error("chunk export: cannot remove spool entry %s (%s)", entry.name, e)
        self._spool_gauges()

    def _spool_gauges(self) -> None:
        if self.spool is not None:
            metrics.SPOOL_BYTES.set(self.spool.bytes)
            metrics.SPOOL_ENTRIES.labels("chunk").set(len(self._backlog))
            metrics.SPOOL_ENTRIES.labels("ref").set(self.spool.count("ref"))

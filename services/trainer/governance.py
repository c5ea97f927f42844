"""The chunk store, governed: retention, a byte budget, forget, quarantine counts. No gRPC.

What it keeps bounded (docs/data-handling.md):

- **Retention.** A chunk blob a recorded run trained on (consumed) is deleted once it is older than
  `retention_s` (TIDE_CHUNK_RETENTION_H); any other once older than `unconsumed_retention_s`
  (TIDE_CHUNK_UNCONSUMED_RETENTION_H). Age = now - the object's last-modified time in S3 (when the
  worker stored it, or when `forget` last rewrote it).
- **A byte budget.** After retention, while the chunk blobs under the workers' prefix add up to more
  than `budget_bytes` (TIDE_CHUNK_BUCKET_BYTES), the oldest are deleted.
- **Streams trimmed to match.** The chunk stream loses entries older than the consumed retention
  that the trainer's group has read and acked (never one it still has to handle); the dead-letter
  stream loses those older than the unconsumed retention.
- **Forget.** `forget(request_id=... | key_id=...)` records the id (durably: chunks still in a
  worker's spool are rewritten when they arrive), then deletes every recorded chunk holding only
  such rows and rewrites every chunk that also holds others' rows without them (same chunk id and
  key, re-sealed with the current data key), and deletes the acked stream entries naming them.
  Drafts already trained on those rows keep existing: the weights are not data rows.

A deletion writes the chunk's tombstone first (manifest.py), then removes the blob and the manifest
entry, so neither the intake nor the reconciler ever records a deleted chunk again; a sweep that
finds a tombstoned blob (a deletion interrupted between the two) finishes it. Every deletion is
counted by reason (metrics.py: tide_trainer_chunks_deleted_total{reason}).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import redis
from minio import Minio
from minio.error import S3Error

from services.trainer.manifest import Manifest, ManifestEntry
from tide import blobs, streams
from tide.chunks import ChunkInvalid, decode_chunk, encode_chunk, request_matches, without_requests
from tide.datakeys import Keyring

log = logging.getLogger(__name__)

_SUFFIX = ".safetensors"
HOUR_S = 3600.0


@dataclass(frozen=True)
class Policy:
    """The retention policy in force (also written into each draft's provenance: cycle.py)."""

    retention_s: float = 24 * HOUR_S  # consumed chunks
    unconsumed_retention_s: float = 7 * 24 * HOUR_S
    budget_bytes: int = 0  # 0 = no budget

    def describe(self) -> dict:
        return {
            "consumed_retention_h": self.retention_s / HOUR_S,
            "unconsumed_retention_h": self.unconsumed_retention_s / HOUR_S,
            "bucket_budget_bytes": self.budget_bytes,
        }


@dataclass
class GovernanceStats:
    deleted: Counter = field(default_factory=Counter)  # chunks by reason
    deleted_bytes: Counter = field(default_factory=Counter)
    quarantined: int = 0  # sealed blobs that failed authentication (dead-lettered, never trained on)
    rows_forgotten: int = 0
    chunks_rewritten: int = 0
    stream_trimmed: int = 0  # chunk + dead-letter stream entries trimmed
    bucket_bytes: int = 0  # chunk blob bytes after the last sweep
    bucket_chunks: int = 0
    sweeps: int = 0
    errors: int = 0


@dataclass
class ForgetReport:
    kind: str  # "request_id" | "key_id"
    value: str
    chunks_deleted: list[str] = field(default_factory=list)
    chunks_rewritten: list[str] = field(default_factory=list)
    rows_removed: int = 0
    requests_removed: list[str] = field(default_factory=list)
    stream_entries_deleted: int = 0
    memory_notice: bool = False  # whether the workers' speculation memories were told (the forget stream)


class DataGovernor:
    """See the module docstring. `sweep` runs on its own thread every `interval_s` (0 = only when
    called); `forget` on the caller's (the gRPC handler's). One lock serialises them."""

    def __init__(
        self,
        s3: Minio,
        bucket: str,
        manifest: Manifest,
        client: redis.Redis | None,
        names: streams.StreamNames,
        keyring: Keyring,
        policy: Policy,
        *,
        chunk_prefix: str = "chunks",
        interval_s: float = 60.0,
    ) -> None:
        self.s3, self.bucket, self.manifest, self.redis, self.names = s3, bucket, manifest, client, names
        self.keyring, self.policy = keyring, policy
        self.chunk_prefix, self.interval_s = chunk_prefix.strip("/"), interval_s
        self.stats = GovernanceStats()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle

    def start(self) -> DataGovernor:
        if self.interval_s > 0:
            self._thread = threading.Thread(target=self._loop, name="data-governor", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sweep()
            except Exception:  # S3 / Redis down: the next sweep starts over
                self.stats.errors += 1
                log.exception("data sweep failed")

    # ---- retention and the budget

    def sweep(self, now: float | None = None) -> dict[str, int]:
        """One pass: retention, the byte budget, stream trimming. Returns chunks deleted by reason."""
        now = time.time() if now is None else now
        done: Counter = Counter()
        with self._lock:
            objects = sorted(
                (o.last_modified.timestamp() if o.last_modified else now, o.object_name, o.size or 0)
                for o in self.s3.list_objects(self.bucket, prefix=self.chunk_prefix + "/", recursive=True)
                if o.object_name.endswith(_SUFFIX)
            )
            consumed = self.manifest.trained_ids()
            kept: list[tuple[float, str, int]] = []
            for mtime, key, size in objects:
                cid = _chunk_id(key)
                age = now - mtime
                if self.manifest.is_deleted(cid):
                    reason = "tombstoned"  # a deletion interrupted between tombstone and blob
                elif cid in consumed and age > self.policy.retention_s:
                    reason = "retention_consumed"
                elif age > self.policy.unconsumed_retention_s:
                    reason = "retention_unconsumed"
                else:
                    kept.append((mtime, key, size))
                    continue
                self._delete(cid, key, size, reason)
                done[reason] += 1
            total = sum(size for _, _, size in kept)
            if self.policy.budget_bytes > 0:
                while kept and total > self.policy.budget_bytes:  # oldest first
                    _, key, size = kept.pop(0)
                    self._delete(_chunk_id(key), key, size, "budget")
                    done["budget"] += 1
                    total -= size
            self.stats.bucket_bytes, self.stats.bucket_chunks = total, len(kept)
            self.stats.sweeps += 1
            self._trim_streams(now)
        if done:
            log.info("data sweep: deleted %s; %d chunk bytes left in %d blobs", dict(done), total, len(kept))
        return dict(done)

    def _delete(self, chunk_id: str, key: str, size: int, reason: str) -> None:
        self.manifest.mark_deleted(chunk_id, reason)  # the tombstone first: nothing resurrects it
        self.s3.remove_object(self.bucket, key)
        target = _target_of(key, self.chunk_prefix)
        if target:
            self.manifest.drop_entry(target, chunk_id)
        if reason != "tombstoned":
            self.stats.deleted[reason] += 1
            self.stats.deleted_bytes[reason] += size

    def _trim_streams(self, now: float) -> None:
        if self.redis is None:
            return
        try:
            self.stats.stream_trimmed += self._trim(self.names.chunks, now - self.policy.retention_s, acked_only=True)
            self.stats.stream_trimmed += self._trim(
                self.names.dead_letter, now - self.policy.unconsumed_retention_s, acked_only=False
            )
        except redis.RedisError as e:
            log.warning("data sweep: cannot trim the streams (%s)", e)

    def _trim(self, stream: str, before_unix_s: float, acked_only: bool) -> int:
        """XTRIM MINID: entries older than `before_unix_s` (entry ids are ms timestamps); with
        `acked_only` never past the trainer group's oldest pending or undelivered entry."""
        minid = max(0, int(before_unix_s * 1000))
        if acked_only:
            groups = {_text(g["name"]): g for g in self.redis.xinfo_groups(stream)} if self.redis.exists(stream) else {}
            group = groups.get(streams.TRAINER_GROUP)
            if group is None:
                return 0  # nobody has read it yet: trim nothing
            last = _ms(_text(group["last-delivered-id"]))
            pending = self.redis.xpending(stream, streams.TRAINER_GROUP)
            oldest = _ms(_text(pending["min"])) if pending and pending.get("min") else None
            minid = min(minid, last if oldest is None else oldest)  # whole ms: never past an unread entry
        return int(self.redis.xtrim(stream, minid=str(minid), approximate=False) or 0)

    # ---- forget

    def forget(self, request_id: str = "", key_id: str = "") -> ForgetReport:
        """Remove every recorded row of a request (the gateway's response id, e.g. "chatcmpl-..."; each
        choice's rows match) or of an API key id. Raises ValueError unless exactly one is given."""
        if bool(request_id) == bool(key_id):
            raise ValueError("give exactly one of a request id and a key id")
        kind, value = ("request_id", request_id) if request_id else ("key_id", key_id)
        report = ForgetReport(kind, value)
        with self._lock:
            self.manifest.forget(kind, value)  # durable first: chunks arriving later are rewritten too
            for entry in self.manifest.all_entries():
                if self.manifest.is_deleted(entry.chunk_id) or not _matches(entry, kind, value):
                    continue
                self._remove_rows(entry, kind, value, report)
            report.stream_entries_deleted = self._delete_stream_entries(kind, value)
            report.stream_entries_deleted += self._delete_memory_entries(kind, value)
            report.memory_notice = self._notify_memories(kind, value)
        self.stats.rows_forgotten += report.rows_removed
        log.warning(
            "forget %s %s: %d chunks deleted, %d rewritten, %d rows, %d stream entries",
            kind,
            value,
            len(report.chunks_deleted),
            len(report.chunks_rewritten),
            report.rows_removed,
            report.stream_entries_deleted,
        )
        return report

    def matches_forgotten(self, entry: ManifestEntry) -> bool:
        f = self.manifest.forgotten
        return any(_matches(entry, "request_id", v) for v in f["request_id"]) or bool(set(entry.key_ids) & f["key_id"])

    def apply_forgotten(self, entry: ManifestEntry) -> None:
        """An entry just recorded that holds rows of a forgotten request or key: remove them."""
        with self._lock:
            for kind, values in self.manifest.forgotten.items():
                for value in sorted(values):
                    if not self.manifest.is_deleted(entry.chunk_id) and _matches(entry, kind, value):
                        report = ForgetReport(kind, value)
                        self._remove_rows(entry, kind, value, report)
                        self.stats.rows_forgotten += report.rows_removed
                        if report.chunks_rewritten:
                            entry = self._current(entry)

    def _current(self, entry: ManifestEntry) -> ManifestEntry:
        pointer = blobs.get_pointer(self.s3, self.bucket, self.manifest.entry_key(entry.target_model, entry.chunk_id))
        return ManifestEntry(**pointer.value) if pointer is not None else entry

    def _remove_rows(self, entry: ManifestEntry, kind: str, value: str, report: ForgetReport) -> None:
        try:
            data = blobs.get_bytes(self.s3, entry.bucket, entry.key, expected_sha256=entry.sha256)
            chunk = decode_chunk(data, keyring=self.keyring)
        except S3Error as e:
            if e.code != "NoSuchKey":
                raise
            self.manifest.mark_deleted(entry.chunk_id, "forget")  # gone already: keep it gone
            self.manifest.drop_entry(entry.target_model, entry.chunk_id)
            return
        except (blobs.ChecksumMismatch, ChunkInvalid) as e:  # unreadable: it cannot be rewritten, only removed
            log.warning("forget: chunk %s unreadable (%s); deleting it whole", entry.chunk_id, e)
            chunk = None
        m = chunk.meta if chunk is not None else None
        drop = (
            set()
            if m is None
            else {
                i
                for i, rid in enumerate(m.request_ids)
                if (kind == "request_id" and request_matches(rid, value))
                or (kind == "key_id" and m.key_ids and m.key_ids[i] == value)
            }
        )
        rest = None
        if chunk is not None and m.segment_requests:
            rest = without_requests(chunk, drop)
        removed = (
            chunk.num_tokens - (rest.num_tokens if rest is not None else 0) if chunk is not None else entry.num_tokens
        )
        report.rows_removed += removed
        report.requests_removed += [m.request_ids[i] for i in sorted(drop)] if m is not None else []
        if rest is None:
            self._delete(entry.chunk_id, entry.key, entry.size_bytes, "forget")
            report.chunks_deleted.append(entry.chunk_id)
            return
        blob = self.keyring.seal(encode_chunk(rest))
        info = blobs.put_bytes(self.s3, entry.bucket, entry.key, blob, metadata={"chunk-id": entry.chunk_id})
        new = dataclasses.replace(
            entry,
            sha256=info.sha256,
            size_bytes=info.size_bytes,
            num_tokens=rest.num_tokens,
            request_ids=list(rest.meta.request_ids),
            key_ids=list(rest.meta.key_ids),
            data_key_id=self.keyring.current,
        )
        self.manifest.replace(entry, new)
        self.stats.chunks_rewritten += 1
        report.chunks_rewritten.append(entry.chunk_id)

    def _delete_stream_entries(self, kind: str, value: str) -> int:
        """XDEL the chunk stream's acked entries whose reference names the id (unacked ones are
        handled by the intake, which rewrites their chunks, and go with trimming)."""
        if self.redis is None:
            return 0
        try:
            if not self.redis.exists(self.names.chunks):
                return 0
            groups = {_text(g["name"]): g for g in self.redis.xinfo_groups(self.names.chunks)}
            group = groups.get(streams.TRAINER_GROUP)
            if group is None:
                return 0
            last = _text(group["last-delivered-id"])
            pending = {
                _text(p["message_id"])
                for p in self.redis.xpending_range(
                    self.names.chunks, streams.TRAINER_GROUP, min="-", max="+", count=100_000
                )
            }
            doomed = []
            for eid, fields in self.redis.xrange(self.names.chunks, max=last):
                eid = _text(eid)
                try:
                    ref = streams.decode(fields, streams.ChunkRef)
                except streams.PayloadError:
                    continue
                entry = ManifestEntry.from_ref(ref, now=0.0)
                if eid not in pending and _matches(entry, kind, value):
                    doomed.append(eid)
            return int(self.redis.xdel(self.names.chunks, *doomed)) if doomed else 0
        except redis.RedisError as e:
            log.warning("forget: cannot delete stream entries (%s); they go with trimming", e)
            return 0


    def _delete_memory_entries(self, kind: str, value: str) -> int:
        """XDEL the fleet memory stream's entries of a request or an API key
        (TIDE_SPECULATION_MEMORY_FLEET: services/inference/fleet_memory.py names each entry's owners;
        under the `key` scope its scope is the key id too)."""
        if self.redis is None:
            return 0
        try:
            doomed = []
            for eid, fields in self.redis.xrange(self.names.memory):
                try:
                    e = streams.decode(fields, streams.MemoryEntry)
                except streams.PayloadError:
                    continue
                if (kind == "key_id" and value in (e.key_id, e.scope)) or (
                        kind == "request_id" and request_matches(e.request_id, value)):
                    doomed.append(_text(eid))
            return int(self.redis.xdel(self.names.memory, *doomed)) if doomed else 0
        except redis.RedisError as e:
            log.warning("forget: cannot delete memory stream entries (%s); they go with its window", e)
            return 0

    def _notify_memories(self, kind: str, value: str) -> bool:
        """Publish a ForgetNotice: every worker's speculation memory drops the id's documents from RAM
        (services/inference/memory_forget.py). False when Redis cannot take it (logged)."""
        if self.redis is None:
            return False
        notice = streams.ForgetNotice(key_id=value if kind == "key_id" else "",
                                      request_id=value if kind == "request_id" else "",
                                      created_unix_s=round(time.time(), 3))
        try:
            streams.add(self.redis, self.names.forget, notice)
            return True
        except redis.RedisError as e:
            log.error("forget: cannot tell the workers' speculation memories (%s): they keep the %s %s "
                      "until it is evicted", e, kind, value)
            return False


def _matches(entry: ManifestEntry, kind: str, value: str) -> bool:
    if kind == "key_id":
        return value in entry.key_ids
    return any(request_matches(rid, value) for rid in entry.request_ids)


def _chunk_id(key: str) -> str:
    return key.rsplit("/", 1)[-1].removesuffix(_SUFFIX)


def _target_of(key: str, prefix: str) -> str:
    """`<prefix>/<target>/<worker>/<chunk id>.safetensors` -> target (which may hold "/")."""
    parts = key[len(prefix) + 1 :].split("/")
    return "/".join(parts[:-2]) if len(parts) >= 3 else ""


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])

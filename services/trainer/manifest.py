"""The durable training-set manifest in object storage: which chunks the trainer accepted, and
which training run used them. No gRPC; S3 through the `minio` client and tide.blobs.

Layout under `<prefix>/targets/<target>/` in the trainer's bucket (target and chunk ids quoted):

    chunks/<chunk id>.json   one entry per accepted chunk (where its blob is, SHA-256, tokens, ...)
    runs/<run id>.json       one record per finished run: the chunk ids it trained on, its outcome

and under `<prefix>/governance/` (services/trainer/governance.py):

    deleted/<chunk id>.json    a tombstone per chunk deleted (retention, the byte budget, forget):
                               written before the blob goes, so neither the intake nor the
                               reconciler ever records a deleted chunk again
    forgotten/<sha256>.json    a request id or API key id `tidectl data forget` was asked to remove:
                               chunks that arrive later holding its rows are rewritten without them

An entry is created with a conditional write (`If-None-Match: *`, tide.blobs.put_pointer), so a
chunk id is recorded exactly once however many times its reference is delivered, and by whichever
trainer replica gets there first: that is the dedupe. The trainer acks a stream entry only after
its manifest entry exists, so an accepted chunk is never lost. A chunk is *buffered* from its entry
until a run record lists it, so a trainer killed mid-run trains on it again, never twice after a
recorded run. One object per chunk keeps every write O(1); `load()` lists the keys and reads only
the run records and the still-buffered entries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote, unquote

from minio import Minio

from tide import blobs
from tide.blobs import PointerConflict
from tide.streams import ChunkRef

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ManifestEntry:
    """An accepted chunk: its stream reference plus when the trainer accepted it."""

    chunk_id: str
    bucket: str
    key: str
    sha256: str
    size_bytes: int
    num_tokens: int
    target_model: str
    draft_version: str
    workload: str
    worker_id: str
    created_unix_s: float
    added_unix_s: float
    request_ids: list[str] = dataclasses.field(default_factory=list)  # whose rows (tidectl data forget)
    key_ids: list[str] = dataclasses.field(default_factory=list)
    data_key_id: str = ""  # the key that sealed the blob ("" = in the clear)

    @classmethod
    def from_ref(cls, ref: ChunkRef, now: float | None = None) -> ManifestEntry:
        fields = {f.name: getattr(ref, f.name) for f in dataclasses.fields(ChunkRef)}
        return cls(**fields, added_unix_s=time.time() if now is None else now)


class Manifest:
    """Thread-safe view of the manifest; the in-memory index mirrors what was written or loaded."""

    def __init__(self, s3: Minio, bucket: str, prefix: str = "trainer") -> None:
        self.s3, self.bucket, self.prefix = s3, bucket, prefix.strip("/")
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._buffered: dict[str, dict[str, ManifestEntry]] = {}  # target -> chunk id -> entry
        self.runs: dict[str, dict[str, dict]] = {}  # target -> run id -> record
        self._deleted: set[str] = set()  # chunk ids with a tombstone
        self.forgotten: dict[str, set[str]] = {"request_id": set(), "key_id": set()}

    def _dir(self, target_model: str) -> str:
        return f"{self.prefix}/targets/{quote(target_model, safe='')}"

    def entry_key(self, target_model: str, chunk_id: str) -> str:
        return f"{self._dir(target_model)}/chunks/{quote(chunk_id, safe='')}.json"

    def run_key(self, target_model: str, run_id: str) -> str:
        return f"{self._dir(target_model)}/runs/{quote(run_id, safe='')}.json"

    def deleted_key(self, chunk_id: str) -> str:
        return f"{self.prefix}/governance/deleted/{quote(chunk_id, safe='')}.json"

    def forgotten_key(self, kind: str, value: str) -> str:
        return f"{self.prefix}/governance/forgotten/{blobs.sha256_hex(f'{kind}:{value}'.encode())}.json"

    def is_deleted(self, chunk_id: str) -> bool:
        with self._lock:
            return chunk_id in self._deleted

    def deleted_count(self) -> int:
        with self._lock:
            return len(self._deleted)

    def mark_deleted(self, chunk_id: str, reason: str, now: float | None = None) -> None:
        """Write the chunk's tombstone (idempotent) and drop it from the in-memory index; the caller
        then removes the blob and the entry object (`drop_entry`)."""
        with contextlib.suppress(PointerConflict):  # already tombstoned
            blobs.put_pointer(self.s3, self.bucket, self.deleted_key(chunk_id),
                              {"chunk_id": chunk_id, "reason": reason, "unix_s": time.time() if now is None else now},
                              expected_etag=None)
        with self._lock:
            self._deleted.add(chunk_id)
            self._seen.add(chunk_id)
            for group in self._buffered.values():
                group.pop(chunk_id, None)

    def drop_entry(self, target_model: str, chunk_id: str) -> None:
        self.s3.remove_object(self.bucket, self.entry_key(target_model, chunk_id))

    def forget(self, kind: str, value: str) -> None:
        """Remember a request id / key id to keep out of chunks that arrive later (durable)."""
        with contextlib.suppress(PointerConflict):  # asked before
            blobs.put_pointer(self.s3, self.bucket, self.forgotten_key(kind, value),
                              {"kind": kind, "value": value, "unix_s": time.time()}, expected_etag=None)
        with self._lock:
            self.forgotten[kind].add(value)

    def replace(self, old: ManifestEntry, new: ManifestEntry) -> None:
        """A chunk rewritten in place (same id and key, fewer rows): its entry object and index follow."""
        key = self.entry_key(new.target_model, new.chunk_id)
        current = blobs.get_pointer(self.s3, self.bucket, key)
        blobs.put_pointer(self.s3, self.bucket, key, dataclasses.asdict(new),
                          expected_etag=None if current is None else current.etag)
        with self._lock:
            group = self._buffered.get(new.target_model, {})
            if old.chunk_id in group:
                group[new.chunk_id] = new
            records = [(run_id, r) for run_id, r in self.runs.get(new.target_model, {}).items()
                       if new.chunk_id in r.get("chunk_ids", [])]
        for run_id, record in records:  # replay reads the new SHA-256, and the old request ids go
            value = {**record, "chunks": [dataclasses.asdict(new) if f.get("chunk_id") == new.chunk_id else f
                                          for f in record.get("chunks", [])]}
            blobs.update_pointer(self.s3, self.bucket, self.run_key(new.target_model, run_id), lambda _, v=value: v)
            with self._lock:
                self.runs[new.target_model][run_id] = value

    def all_entries(self) -> list[ManifestEntry]:
        """Every recorded entry object, buffered or trained on (reads each: for forget, not hot paths)."""
        out = []
        for key in blobs.list_keys(self.s3, self.bucket, f"{self.prefix}/targets/"):
            parts = key[len(self.prefix) + 1:].split("/")
            if len(parts) == 4 and parts[2] == "chunks" and parts[3].endswith(".json"):
                pointer = blobs.get_pointer(self.s3, self.bucket, key)
                if pointer is not None:
                    out.append(ManifestEntry(**pointer.value))
        return out

    def trained_ids(self) -> set[str]:
        """Chunk ids some recorded run trained on (consumed), any target."""
        with self._lock:
            return {c for runs in self.runs.values() for r in runs.values() for c in r.get("chunk_ids", [])}

    def load(self) -> Manifest:
        """Read the manifest from storage (at start; replaces the in-memory index)."""
        chunk_keys: dict[str, dict[str, str]] = {}
        runs: dict[str, dict[str, dict]] = {}
        for key in blobs.list_keys(self.s3, self.bucket, f"{self.prefix}/targets/"):
            parts = key[len(self.prefix) + 1:].split("/")
            if len(parts) != 4 or not parts[3].endswith(".json"):
                continue
            target, kind, name = unquote(parts[1]), parts[2], unquote(parts[3][:-5])
            if kind == "chunks":
                chunk_keys.setdefault(target, {})[name] = key
            elif kind == "runs":
                pointer = blobs.get_pointer(self.s3, self.bucket, key)
                if pointer is not None:
                    runs.setdefault(target, {})[name] = pointer.value
        deleted: set[str] = set()
        forgotten: dict[str, set[str]] = {"request_id": set(), "key_id": set()}
        for key in blobs.list_keys(self.s3, self.bucket, f"{self.prefix}/governance/"):
            kind, _, name = key[len(self.prefix) + len("/governance/"):].partition("/")
            if kind == "deleted" and name.endswith(".json"):
                deleted.add(unquote(name[:-5]))
            elif kind == "forgotten":
                pointer = blobs.get_pointer(self.s3, self.bucket, key)
                if pointer is not None and pointer.value.get("kind") in forgotten:
                    forgotten[pointer.value["kind"]].add(str(pointer.value.get("value", "")))
        buffered: dict[str, dict[str, ManifestEntry]] = {}
        for target, keys in chunk_keys.items():
            trained = {c for r in runs.get(target, {}).values() for c in r.get("chunk_ids", [])}
            for chunk_id, key in keys.items():
                if chunk_id in trained or chunk_id in deleted:
                    continue
                pointer = blobs.get_pointer(self.s3, self.bucket, key)
                if pointer is not None:
                    buffered.setdefault(target, {})[chunk_id] = ManifestEntry(**pointer.value)
        with self._lock:
            self._seen = {c for keys in chunk_keys.values() for c in keys} | deleted
            self._buffered, self.runs = buffered, runs
            self._deleted, self.forgotten = deleted, forgotten
        log.info("manifest loaded: %d chunks (%d buffered), %d runs", len(self._seen),
                 sum(len(b) for b in buffered.values()), sum(len(r) for r in runs.values()))
        return self

    def seen(self, chunk_id: str) -> bool:
        with self._lock:
            return chunk_id in self._seen

    def add(self, entry: ManifestEntry) -> bool:
        """Record an accepted chunk; False when its id was already recorded (a duplicate)."""
        if self.seen(entry.chunk_id):
            return False
        key = self.entry_key(entry.target_model, entry.chunk_id)
        try:
            blobs.put_pointer(self.s3, self.bucket, key, dataclasses.asdict(entry), expected_etag=None)
        except PointerConflict:
            with self._lock:
                self._seen.add(entry.chunk_id)
            return False
        with self._lock:
            self._seen.add(entry.chunk_id)
            self._buffered.setdefault(entry.target_model, {})[entry.chunk_id] = entry
        return True

    def buffered(self, target_model: str) -> list[ManifestEntry]:
        """Accepted chunks of a target that no recorded run has trained on, oldest first."""
        with self._lock:
            entries = list(self._buffered.get(target_model, {}).values())
        return sorted(entries, key=lambda e: (e.created_unix_s, e.chunk_id))

    def buffered_totals(self, target_model: str | None = None) -> tuple[int, int]:
        """(chunks, tokens) buffered for one target, or for all when None."""
        with self._lock:
            groups = self._buffered.values() if target_model is None else [self._buffered.get(target_model, {})]
            entries = [e for g in groups for e in g.values()]
        return len(entries), sum(e.num_tokens for e in entries)

    def record_run(self, target_model: str, run_id: str, entries: list[ManifestEntry], record: dict) -> None:
        """Write a finished run's record; its chunks stop being buffered. The record keeps where each
        chunk lies (`chunks`), so later runs can replay them without reading every entry object."""
        value = {**record, "run_id": run_id, "target_model": target_model,
                 "chunk_ids": [e.chunk_id for e in entries], "chunks": [dataclasses.asdict(e) for e in entries]}
        chunk_ids = value["chunk_ids"]
        blobs.put_pointer(self.s3, self.bucket, self.run_key(target_model, run_id), value, expected_etag=None)
        with self._lock:
            self.runs.setdefault(target_model, {})[run_id] = value
            buffered = self._buffered.get(target_model, {})
            for c in chunk_ids:
                buffered.pop(c, None)

    def trained(self, target_model: str) -> list[ManifestEntry]:
        """Chunks that recorded runs of a target trained on (runs recorded before the record kept
        chunk locations contribute nothing), in run order, each once."""
        with self._lock:
            records = list(self.runs.get(target_model, {}).values())
            deleted = set(self._deleted)
        seen: dict[str, ManifestEntry] = {}
        for record in records:
            for fields in record.get("chunks", []):
                entry = ManifestEntry(**fields)
                if entry.chunk_id not in deleted:  # retention, the budget or forget removed it
                    seen.setdefault(entry.chunk_id, entry)
        return list(seen.values())

    def heldout_history(self, target_model: str, tokens: int, heldout: Callable[[str], bool]) -> list[ManifestEntry]:
        """Earlier runs' chunks that `heldout(chunk_id)` says were held out (never trained on), the
        newest first, about `tokens` tokens: added to a run's eval set (cycle.py)."""
        picked, total = [], 0
        for entry in reversed(self.trained(target_model)):
            if total >= tokens:
                break
            if heldout(entry.chunk_id):
                picked.append(entry)
                total += entry.num_tokens
        return picked

    def replay_sample(self, target_model: str, tokens: int, seed: str,
                      recent_share: float = 0.0) -> list[ManifestEntry]:
        """Earlier runs' chunks to rehearse, about `tokens` tokens: the newest chunks (in the order
        runs recorded them) for `recent_share` of them, then a uniform random sample (seeded, so a
        retried run picks the same) over the rest of the history, so every domain the draft learned
        keeps being represented in proportion to what was collected. The recent part makes a run
        train on the last few cycles' data of the current domain, not only on its own few chunks."""
        history = self.trained(target_model)  # oldest run first
        picked, total = [], 0
        for entry in reversed(history):
            if total >= recent_share * tokens:
                break
            picked.append(entry)
            total += entry.num_tokens
        chosen = {e.chunk_id for e in picked}
        pool = sorted((e for e in history if e.chunk_id not in chosen), key=lambda e: e.chunk_id)
        random.Random(seed).shuffle(pool)
        for entry in pool:
            if total >= tokens:
                break
            picked.append(entry)
            total += entry.num_tokens
        return picked

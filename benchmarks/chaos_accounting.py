"""Chunk accounting for `tide chaos`: where every hidden-state chunk is, read from the stores
themselves, never from counters that a crash could reset or miss.

`Ledger.read` takes one snapshot of
- S3: the chunk blobs (`<chunk prefix>/<target>/<worker>/<chunk id>.safetensors`);
- Redis: every entry of the chunk stream (`tide:chunks`), whether the trainer's consumer group has
  not read it yet (`waiting`: after the group's last-delivered id), holds it unacknowledged
  (`pending`, XPENDING) or acknowledged it (`acked`); every entry of the dead-letter stream;
- the trainer's manifest (services.trainer.manifest: one object per accepted chunk under
  `<prefix>/targets/<target>/chunks/`, listed, so a chunk recorded twice would show twice) and its
  run records (the chunk ids each run trained on).

`account(ledger, scope)` classifies each chunk id of `scope` (those that appeared during a
scenario: `Ledger.known` after minus before):
- trained: recorded in a manifest (the trainer accepted it; with automatic training off this is
  the intake), and its blob is still in S3;
- dead_lettered: on the dead-letter stream (corrupt, missing blob, too many failures) and not
  recorded;
- in_stream: not recorded, but a chunk-stream entry still waits for or is pending at the trainer
  (after a drain period there should be none);
- lost: any other. `why` says at which step it got stuck: `unannounced` (the blob is in S3 but no
  stream entry names it: the exporter died between its S3 write and its XADD, or the ref never
  reached Redis), `acked_unrecorded` (its entry was acknowledged yet it is neither recorded nor
  dead-lettered), `blob_missing` (recorded or announced, but the blob is not in S3).
`duplicated` counts chunks recorded more than once (several manifest objects for one chunk id, or
one blob content, by SHA-256, recorded under several chunk ids) or trained by more than one run.
`blobs` is the number of chunk blobs in S3 in scope, `rows` their token rows.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from urllib.parse import unquote

import redis
from minio import Minio

from services.trainer.manifest import Manifest
from tide import blobs, streams
from tide.streams import ChunkRef, DeadLetter, PayloadError

WAITING, PENDING, ACKED = "waiting", "pending", "acked"


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def chunk_id_of_key(key: str) -> str:
    """The chunk id in a blob key `<prefix>/<target>/<worker>/<chunk id>.safetensors`."""
    return key.rsplit("/", 1)[-1].removesuffix(".safetensors")


@dataclass
class Ledger:
    """One snapshot of the chunk data plane (see the module doc)."""

    blobs: dict[str, str] = field(default_factory=dict)  # chunk id -> blob key
    refs: dict[str, list[str]] = field(default_factory=dict)  # chunk id -> states of its stream entries
    recorded: collections.Counter = field(default_factory=collections.Counter)  # chunk id -> manifest objects
    sha: dict[str, str] = field(default_factory=dict)  # chunk id -> SHA-256 of its manifest entry
    tokens: dict[str, int] = field(default_factory=dict)  # chunk id -> token rows (its reference or entry)
    runs: collections.Counter = field(default_factory=collections.Counter)  # chunk id -> runs that trained it
    dead: dict[str, str] = field(default_factory=dict)  # chunk id -> dead-letter reason
    dead_unparsed: int = 0  # dead letters without a chunk reference
    stream_unparsed: int = 0  # chunk-stream entries that are not a ChunkRef

    @property
    def known(self) -> set[str]:
        """Every chunk id seen anywhere."""
        return set(self.blobs) | set(self.refs) | set(self.recorded) | set(self.dead)

    @classmethod
    def read(cls, s3: Minio, bucket: str, client: redis.Redis, names: streams.StreamNames,
             chunk_prefix: str = "chunks", manifest_prefix: str = "trainer") -> Ledger:
        led = cls()
        for key in blobs.list_keys(s3, bucket, chunk_prefix.strip("/") + "/"):
            if key.endswith(".safetensors"):
                led.blobs[chunk_id_of_key(key)] = key
        led._read_chunk_stream(client, names.chunks)
        led._read_dead_letters(client, names.dead_letter)
        led._read_manifest(s3, bucket, manifest_prefix.strip("/"))
        return led

    def _read_chunk_stream(self, client: redis.Redis, stream: str) -> None:
        last, pending = (0, 0), set()
        try:
            groups = client.xinfo_groups(stream)
        except redis.ResponseError:  # no stream yet
            return
        group = next((g for g in groups if _text(g["name"]) == streams.TRAINER_GROUP), None)
        if group is not None:
            last = _id_key(_text(group["last-delivered-id"]))
            pending = {_text(p["message_id"]) for p in client.xpending_range(
                stream, streams.TRAINER_GROUP, min="-", max="+", count=1_000_000)}
        for entry_id, fields in _xrange_all(client, stream):
            try:
                ref = streams.decode(fields, ChunkRef)
            except PayloadError:
                self.stream_unparsed += 1
                continue
            state = PENDING if entry_id in pending else WAITING if _id_key(entry_id) > last else ACKED
            self.tokens[ref.chunk_id] = ref.num_tokens
            self.refs.setdefault(ref.chunk_id, []).append(state)

    def _read_dead_letters(self, client: redis.Redis, stream: str) -> None:
        for _, fields in _xrange_all(client, stream):
            try:
                letter = streams.decode(fields, DeadLetter)
            except PayloadError:
                self.dead_unparsed += 1
                continue
            if letter.ref is None:
                self.dead_unparsed += 1
            else:
                self.dead.setdefault(letter.ref.chunk_id, letter.reason)

    def _read_manifest(self, s3: Minio, bucket: str, prefix: str) -> None:
        targets = set()
        for key in blobs.list_keys(s3, bucket, f"{prefix}/targets/"):
            parts = key[len(prefix) + 1:].split("/")  # targets/<target>/chunks/<id>.json
            if len(parts) == 4 and parts[2] == "chunks" and parts[3].endswith(".json"):
                self.recorded[unquote(parts[3][:-5])] += 1
                targets.add(unquote(parts[1]))
        manifest = Manifest(s3, bucket, prefix).load()
        for target in targets:
            for entry in manifest.buffered(target):
                self.sha[entry.chunk_id] = entry.sha256
                self.tokens[entry.chunk_id] = entry.num_tokens
        for target_runs in manifest.runs.values():
            for record in target_runs.values():
                for chunk_id in set(record.get("chunk_ids", [])):
                    self.runs[chunk_id] += 1
        for target in targets:  # trained chunks are no longer buffered: their SHA-256 from the run records
            for entry in manifest.trained(target):
                self.sha.setdefault(entry.chunk_id, entry.sha256)
                self.tokens.setdefault(entry.chunk_id, entry.num_tokens)


def _xrange_all(client: redis.Redis, stream: str, batch: int = 1000):
    start = "-"
    while True:
        entries = client.xrange(stream, min=start, max="+", count=batch)
        for eid, fields in entries:
            yield _text(eid), fields
        if len(entries) < batch:
            return
        start = "(" + _text(entries[-1][0])


def account(led: Ledger, scope: set[str], show: int = 5) -> dict:
    """Counts for the chunk ids of `scope` (module doc), with up to `show` lost ids and their step."""
    counts = collections.Counter()
    lost: list[tuple[str, str]] = []
    for cid in sorted(scope):
        states = led.refs.get(cid, [])
        if led.recorded[cid]:
            if cid in led.blobs:
                counts["trained"] += 1
            else:
                lost.append((cid, "blob_missing"))
        elif cid in led.dead:
            counts["dead_lettered"] += 1
        elif WAITING in states or PENDING in states:
            counts["in_stream"] += 1
        elif cid not in led.blobs:
            lost.append((cid, "blob_missing"))
        elif states:
            lost.append((cid, "acked_unrecorded"))
        else:
            lost.append((cid, "unannounced"))
    by_sha = collections.Counter(led.sha[c] for c in scope if led.recorded[c] and c in led.sha)
    duplicated = (sum(1 for c in scope if led.recorded[c] > 1 or led.runs[c] > 1)
                  + sum(n - 1 for n in by_sha.values() if n > 1))
    why = collections.Counter(w for _, w in lost)
    return {"blobs": sum(1 for c in scope if c in led.blobs), "trained": counts["trained"],
            "dead_lettered": counts["dead_lettered"], "in_stream": counts["in_stream"], "lost": len(lost),
            "duplicated": duplicated, "rows": sum(led.tokens.get(c, 0) for c in scope), "lost_why": dict(why),
            "lost_examples": [{"chunk_id": c, "why": w, "key": led.blobs.get(c, "")} for c, w in lost[:show]],
            "dead_reasons": dict(collections.Counter(led.dead[c].split(":")[0] for c in scope if c in led.dead
                                                     and not led.recorded[c]))}


def settled(led: Ledger, scope: set[str]) -> bool:
    """Whether every chunk of `scope` has reached its end: recorded or dead-lettered (none still in a
    stream, none lost that a little more time could still bring in)."""
    return all(led.recorded[c] or c in led.dead for c in scope)

"""Redis Streams: stream names, payload schemas and consumer-group helpers, defined once.

Streams (names under a deployment prefix, `StreamNames("tide")` -> "tide:telemetry", ...):
- telemetry: one `tide.telemetry.StepRecord` per engine step, workers -> controller;
- chunks: one `ChunkRef` per hidden-state chunk written to object storage, workers -> trainer;
- dead-letter: one `DeadLetter` per entry that could not be used (unparseable payload, a chunk
  that failed validation, a handler that kept failing). Entries are never dropped silently.
- memory: one `MemoryEntry` per finished request a worker added to its speculation memory, read
  by every other worker of the fleet (TIDE_SPECULATION_MEMORY_FLEET; a plain XREAD, no group: a
  broadcast, not work items). A rolling window: trimming loses nothing a worker needs.

Wire format of an entry: fields `type` (schema name), `v` (schema version) and `data` (the
payload as JSON). No pickle: every consumer can be written in any language. Decoding ignores
unknown JSON fields (a newer producer may add fields) but requires every field without a default
and checks each field's type, so a malformed entry is dead-lettered instead of crashing later.

Delivery is at-least-once: `Consumer` acks an entry only after its handler returns; entries left
pending by a consumer that died are reclaimed by another one (XAUTOCLAIM) after `claim_idle_ms`.
Handlers must therefore be idempotent (the trainer dedupes by `ChunkRef.chunk_id`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import re
import threading
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Self, TypeVar

import redis

from tide.telemetry import StepRecord

log = logging.getLogger(__name__)

SCHEMA_VERSION = "1"
TRAINER_GROUP = "trainer"  # consumer group of the chunk stream
CONTROLLER_GROUP = "controller"  # consumer group of the telemetry stream

# Approximate caps (XADD MAXLEN ~). Telemetry is a rolling window: at ~25 steps/s a worker fills
# 200k entries in about 2 h. Chunk refs are work items: trimming one before the trainer reads it
# loses that chunk, so the cap is far above any backlog a healthy trainer leaves.
TELEMETRY_MAXLEN = 200_000
CHUNKS_MAXLEN = 1_000_000
DEAD_LETTER_MAXLEN = 100_000
# A finished request's token ids are ~2 KB an entry (256 prompt + 128 output tokens, base64): 10k
# entries are ~20 MB of Redis, more than a 64 MiB speculation memory holds (~150 B a token indexed).
MEMORY_MAXLEN = 10_000
# Deletion requests for the workers' in-RAM speculation memories: a few a day at most.
FORGET_MAXLEN = 10_000


@dataclass(frozen=True)
class StreamNames:
    """The stream keys of one deployment; the prefix separates deployments (and tests)."""

    prefix: str = "tide"

    @property
    def telemetry(self) -> str:
        return f"{self.prefix}:telemetry"

    @property
    def chunks(self) -> str:
        return f"{self.prefix}:chunks"

    @property
    def dead_letter(self) -> str:
        return f"{self.prefix}:dead-letter"

    @property
    def memory(self) -> str:
        return f"{self.prefix}:memory"

    @property
    def forget(self) -> str:
        return f"{self.prefix}:forget"


def default_maxlen(stream: str) -> int:
    """The approximate length cap for a stream key named by `StreamNames`."""
    if stream.endswith(":telemetry"):
        return TELEMETRY_MAXLEN
    if stream.endswith(":chunks"):
        return CHUNKS_MAXLEN
    if stream.endswith(":memory"):
        return MEMORY_MAXLEN
    if stream.endswith(":forget"):
        return FORGET_MAXLEN
    return DEAD_LETTER_MAXLEN


class PayloadError(ValueError):
    """An entry's fields do not form a valid payload of the expected type."""


_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class ChunkRef:
    """Reference to one hidden-state chunk blob in object storage (see `tide.chunks`).

    `size_bytes` and `sha256` (lowercase hex) describe the blob exactly as stored, so the trainer
    verifies what it downloads; `num_tokens` counts the tokens whose states the chunk holds;
    `created_unix_s` is seconds since the epoch. `workload` is "" when unknown. `request_ids` and
    `key_ids` (beside it: each request's API key id, a hash, never the key) say whose rows the chunk
    holds, for `tidectl data forget`; `data_key_id` names the key that sealed the blob ("" = stored
    in the clear, tide/datakeys.py). None of these fields holds content.
    """

    chunk_id: str
    bucket: str
    key: str
    size_bytes: int
    sha256: str
    num_tokens: int
    target_model: str
    draft_version: str
    workload: str
    worker_id: str
    created_unix_s: float
    request_ids: list[str] = field(default_factory=list)
    key_ids: list[str] = field(default_factory=list)
    data_key_id: str = ""

    def __post_init__(self) -> None:
        for name in ("chunk_id", "bucket", "key", "target_model", "worker_id"):
            if not getattr(self, name):
                raise PayloadError(f"ChunkRef.{name} must not be empty")
        if self.size_bytes < 0 or self.num_tokens < 0:
            raise PayloadError("ChunkRef.size_bytes and num_tokens must be >= 0")
        if not _SHA256_RE.match(self.sha256):
            raise PayloadError(f"ChunkRef.sha256 must be 64 lowercase hex digits, got {self.sha256!r}")


@dataclass(frozen=True)
class DeadLetter:
    """An entry that was taken out of circulation, and why.

    `ref` is the parsed chunk reference when there was one (a chunk that failed validation),
    None when the entry could not even be parsed; `raw` then keeps its original fields.
    """

    reason: str
    consumer: str  # "<group>/<consumer>" that gave up on it
    source_stream: str
    source_id: str
    ref: ChunkRef | None = None
    raw: dict[str, str] = field(default_factory=dict)
    deliveries: int = 1
    time_unix_s: float = 0.0


@dataclass(frozen=True)
class MemoryEntry:
    """One finished request's token ids, published for the fleet's speculation memories.

    `tokens` is base64 of the ids as little-endian int32 — the prompt's last `prompt_tokens` then
    the output — sealed with the stack's data key when it has one (`data_key_id`, tide/datakeys.py);
    `sha256` (lowercase hex) is of those bytes as published, so a reader drops a damaged entry.
    `scope` is the memory scope the request read and fed (its API key id's hash, or "" when shared:
    services/inference/settings.py), `target_model` the tokenizer the ids belong to. `key_id` and
    `request_id` name its owners (as a chunk reference does), so that `tidectl data forget` finds the
    entry and every memory it joined drops it. Token ids only: no text.
    """

    worker_id: str
    target_model: str
    scope: str
    prompt_tokens: int
    tokens: str
    sha256: str
    data_key_id: str = ""
    created_unix_s: float = 0.0
    key_id: str = ""
    request_id: str = ""

    def __post_init__(self) -> None:
        if not self.worker_id or not self.target_model:
            raise PayloadError("MemoryEntry.worker_id and target_model must not be empty")
        if self.prompt_tokens < 0:
            raise PayloadError("MemoryEntry.prompt_tokens must be >= 0")
        if not _SHA256_RE.match(self.sha256):
            raise PayloadError(f"MemoryEntry.sha256 must be 64 lowercase hex digits, got {self.sha256!r}")


@dataclass(frozen=True)
class ForgetNotice:
    """A deletion request (`tidectl data forget`) for what the workers hold in RAM: every worker with a
    speculation memory drops the documents of `key_id` or of `request_id` (exactly one is set) and
    refuses them from then on. The trainer publishes it after deleting the stored rows."""

    key_id: str = ""
    request_id: str = ""
    created_unix_s: float = 0.0

    def __post_init__(self) -> None:
        if bool(self.key_id) == bool(self.request_id):
            raise PayloadError("ForgetNotice needs exactly one of key_id and request_id")


Payload = StepRecord | ChunkRef | DeadLetter | MemoryEntry | ForgetNotice
T = TypeVar("T", StepRecord, ChunkRef, DeadLetter, MemoryEntry, ForgetNotice)
PAYLOAD_TYPES: dict[str, type] = {"step_record": StepRecord, "chunk_ref": ChunkRef, "dead_letter": DeadLetter,
                                  "memory_entry": MemoryEntry, "forget_notice": ForgetNotice}
_TYPE_NAMES = {cls: name for name, cls in PAYLOAD_TYPES.items()}


# ------------------------------------------------------------------------------ (de)serialisation


def encode(payload: Payload) -> dict[str, str]:
    """Stream-entry fields for a payload."""
    data = json.dumps(dataclasses.asdict(payload), separators=(",", ":"), allow_nan=False)
    return {"type": _TYPE_NAMES[type(payload)], "v": SCHEMA_VERSION, "data": data}


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def decode(fields: dict, expected: type[T]) -> T:
    """Parse stream-entry fields (bytes or str) into `expected`; raises PayloadError."""
    f = {_text(k): _text(v) for k, v in (fields or {}).items()}
    if f.get("type") != _TYPE_NAMES[expected]:
        raise PayloadError(f"expected type {_TYPE_NAMES[expected]!r}, got {f.get('type')!r}")
    if f.get("v") != SCHEMA_VERSION:
        raise PayloadError(f"unsupported schema version {f.get('v')!r} (this code reads {SCHEMA_VERSION})")
    try:
        data = json.loads(f.get("data", ""))
    except json.JSONDecodeError as e:
        raise PayloadError(f"data is not JSON: {e}") from None
    return from_dict(expected, data)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """The resolved field types of a payload class (resolving them per entry cost the telemetry
    reader ~15 % of its CPU: one step record per engine step)."""
    return typing.get_type_hints(cls)


def from_dict(cls: type[T], data: Any) -> T:
    """Build dataclass `cls` from JSON data, checking field presence and types."""
    if not isinstance(data, dict):
        raise PayloadError(f"{cls.__name__} payload must be a JSON object")
    hints = _type_hints(cls)
    kwargs: dict[str, Any] = {}
    for fld in dataclasses.fields(cls):
        if fld.name not in data:
            if fld.default is dataclasses.MISSING and fld.default_factory is dataclasses.MISSING:
                raise PayloadError(f"{cls.__name__}.{fld.name} is missing")
            continue
        kwargs[fld.name] = _coerce(data[fld.name], hints[fld.name], f"{cls.__name__}.{fld.name}")
    try:
        return cls(**kwargs)
    except PayloadError:
        raise
    except (TypeError, ValueError) as e:
        raise PayloadError(f"invalid {cls.__name__}: {e}") from None


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where) if len(inner) == 1 else value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value)
    if origin is list:
        if not isinstance(value, list):
            raise PayloadError(f"{where} must be a list")
        return [_coerce(v, args[0], where) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise PayloadError(f"{where} must be an object")
        return {str(k): _coerce(v, args[1], where) for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise PayloadError(f"{where} must be a number")
        return float(value)
    if tp in (int, str, bool) and (not isinstance(value, tp) or (tp is int and isinstance(value, bool))):
        raise PayloadError(f"{where} must be {tp.__name__}")
    return value


# ------------------------------------------------------------------------------------- producer


def add(client: redis.Redis, stream: str, payload: Payload, *, maxlen: int | None = None) -> str:
    """XADD `payload` to `stream`, trimming to about `maxlen` entries (MAXLEN ~, cheap).

    Raises redis.RedisError when Redis is unreachable: callers that must keep serving (workers)
    catch it, count it and carry on.
    """
    if maxlen is None:
        maxlen = default_maxlen(stream)
    return _text(client.xadd(stream, encode(payload), maxlen=maxlen, approximate=True))


# ------------------------------------------------------------------------------------- consumer


class Reject(Exception):
    """Raised by a handler for an entry that must never be retried (e.g. checksum mismatch):
    the consumer dead-letters it with this reason and acks it."""


class Transient(Exception):
    """Raised by a handler when something it depends on is unavailable (the object store is down
    or restarting): not the entry's fault. The consumer keeps the entry in hand and calls the
    handler again with capped exponential backoff (`TRANSIENT_FIRST_S` doubling to
    `TRANSIENT_MAX_S`) until it returns, rejects, fails otherwise, or the consumer stops. The entry
    is not re-read, so an outage of any length adds nothing to its delivery count and never
    dead-letters it; its claim is refreshed (XCLAIM JUSTID) while it waits, so no other consumer
    takes it over. The entries behind it wait too: back-pressure, not a pile of failed deliveries.
    This needs `Consumer.run` (a ConsumerThread); under a bare `poll()` it is an ordinary failure."""


TRANSIENT_FIRST_S = 0.2  # first wait after a Transient failure (s)
TRANSIENT_MAX_S = 5.0  # cap of the doubling wait (s): a restarted dependency is noticed within this


@dataclass
class Message(Generic[T]):
    """One delivered entry, as a handler sees it."""

    stream: str
    entry_id: str
    payload: T
    deliveries: int  # 1 on first delivery; more after a crash or handler failure


@dataclass
class ConsumerStats:
    """Counters since the consumer was created (exported as metrics by the services)."""

    handled: int = 0  # handler returned and the entry was acked
    dead_lettered: int = 0  # unparseable, rejected, or failed max_deliveries times
    handler_errors: int = 0  # handler raised; entry left pending for a retry
    transient_retries: int = 0  # handler raised Transient; the entry in hand was retried
    reclaimed: int = 0  # stale pending entries taken over from other consumers
    missing: int = 0  # pending entries whose data was trimmed away before processing


class Consumer(Generic[T]):
    """One member of a consumer group reading payloads of type `payload_type` from `stream`.

    Each `poll()`: on the first call, re-deliver this consumer's own pending entries (a restart
    under the same name resumes where it stopped); every `reclaim_every_s`, XAUTOCLAIM entries
    idle for more than `claim_idle_ms` (their consumer died or hangs); then XREADGROUP new
    entries, blocking up to `block_ms`. An entry is acked once its handler returns: the entries of
    one read whose handlers returned are acked together, in one XACK after the last of them (one
    round trip a batch, not one an entry: the controller reads a step record per engine step), and
    before a `Transient` wait, so that no handled entry sits unacked while one is retried. A handler
    raising `Transient` is retried on the entry in hand (see there); any other exception leaves
    the entry pending for a later retry; after `max_deliveries` it is dead-lettered. After a Redis
    outage `run` walks this consumer's pending list again, so an entry read before the outage is
    retried when Redis is back, not only once it is claimable.

    `claim_idle_ms` must exceed the longest a read's `count` handlers run (else a live consumer's entry is
    taken over and processed twice), and the client's socket_timeout must exceed `block_ms`.
    """

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        group: str,
        consumer: str,
        payload_type: type[T],
        *,
        dead_letter_stream: str,
        claim_idle_ms: int = 60_000,
        reclaim_every_s: float = 5.0,
        block_ms: int = 1_000,
        count: int = 16,
        max_deliveries: int = 5,
    ):
        self.client, self.stream, self.group, self.consumer = client, stream, group, consumer
        self.payload_type = payload_type
        self.dead_letter_stream = dead_letter_stream
        self.claim_idle_ms, self.reclaim_every_s = claim_idle_ms, reclaim_every_s
        self.block_ms, self.count, self.max_deliveries = block_ms, count, max_deliveries
        self.stats = ConsumerStats()
        self._group_ready = False
        self._own_pending_done = False
        self._pending_cursor = "0"  # XREADGROUP with an id (not ">") reads our pending list after it
        self._claim_cursor = "0-0"
        self._last_reclaim = float("-inf")
        self._stop: threading.Event | None = None  # set by run(): ends a Transient retry loop
        self._handled: list[str] = []  # ids whose handlers returned in the batch in hand, not yet acked

    def ensure_group(self, start_id: str = "0") -> None:
        """Create the group (and the stream) if needed; "0" = the group sees existing entries."""
        try:
            self.client.xgroup_create(self.stream, self.group, id=start_id, mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True

    def poll(self, handler: Callable[[Message[T]], None]) -> int:
        """One round of reclaim + read + handle; returns the number of entries processed."""
        if not self._group_ready:
            self.ensure_group()
        if not self._own_pending_done:  # walk our own pending list once, oldest first
            entries = self._read(self._pending_cursor)
            if entries:
                self._pending_cursor = entries[-1][0]
                return self._process(entries, handler, fresh=False)
            self._own_pending_done = True
        done = 0
        if time.monotonic() - self._last_reclaim >= self.reclaim_every_s:
            done += self._process(self.reclaim(), handler, fresh=False)
        return done + self._process(self._read(">"), handler, fresh=True)

    def run(self, handler: Callable[[Message[T]], None], stop: threading.Event) -> None:
        """Poll until `stop` is set; rides out Redis outages with capped exponential backoff and
        recreates the group if a restarted (non-persistent) Redis lost it."""
        self._stop = stop
        backoff = 0.1
        while not stop.is_set():
            try:
                self.poll(handler)
                backoff = 0.1
            except (redis.ConnectionError, redis.TimeoutError) as e:
                log.warning("stream %s: redis unavailable (%s); retrying in %.1f s", self.stream, e, backoff)
                # an entry read before the outage may be pending unacked: walk our list again
                self._own_pending_done, self._pending_cursor = False, "0"
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except redis.ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                # Redis came back empty (no persistence) or the stream was deleted: start over.
                log.warning("stream %s: consumer group %s vanished; recreating it", self.stream, self.group)
                self._group_ready = False
                self._own_pending_done, self._pending_cursor = False, "0"
                self._claim_cursor = "0-0"

    def reclaim(self) -> list[tuple[str, dict | None]]:
        """XAUTOCLAIM one batch of entries idle > claim_idle_ms onto this consumer."""
        self._last_reclaim = time.monotonic()
        reply = self.client.xautoclaim(
            self.stream, self.group, self.consumer, self.claim_idle_ms, self._claim_cursor, count=self.count
        )
        cursor, entries = reply[0], reply[1]  # Redis >= 7 adds a third item: ids of deleted entries
        deleted = [_text(i) for i in reply[2]] if len(reply) > 2 else []
        self._claim_cursor = _text(cursor)
        claimed = [(_text(eid), fields) for eid, fields in entries if eid is not None]
        self.stats.reclaimed += len(claimed)
        if deleted:  # Redis >= 7 already removed these from the pending list
            self.stats.missing += len(deleted)
            log.error("stream %s: %d pending entries were trimmed before processing", self.stream, len(deleted))
        if len(claimed) < len(entries):  # Redis 6.2: trimmed entries come back as nil, still pending
            self._ack_trimmed_pending()
        return claimed

    def _ack_trimmed_pending(self, limit: int = 1000) -> None:
        """Ack (and count) entries in our pending list whose data no longer exists."""
        pending = self.client.xpending_range(
            self.stream, self.group, min="-", max="+", count=limit, consumername=self.consumer
        )
        for item in pending:
            entry_id = _text(item["message_id"])
            if not self.client.xrange(self.stream, min=entry_id, max=entry_id, count=1):
                self.client.xack(self.stream, self.group, entry_id)
                self.stats.missing += 1
                log.error("stream %s: pending entry %s was trimmed before processing", self.stream, entry_id)

    def dead_letter(self, entry_id: str, fields: dict | None, reason: str, deliveries: int = 1) -> None:
        """Record an entry on the dead-letter stream, then ack it (in that order: never lost)."""
        raw = {_text(k): _text(v) for k, v in (fields or {}).items()}
        ref = None
        if self.payload_type is ChunkRef:
            with contextlib.suppress(PayloadError):
                ref = decode(raw, ChunkRef)
        letter = DeadLetter(
            reason=reason,
            consumer=f"{self.group}/{self.consumer}",
            source_stream=self.stream,
            source_id=entry_id,
            ref=ref,
            raw={} if ref is not None else raw,
            deliveries=deliveries,
            time_unix_s=time.time(),
        )
        add(self.client, self.dead_letter_stream, letter, maxlen=DEAD_LETTER_MAXLEN)
        self.client.xack(self.stream, self.group, entry_id)
        self.stats.dead_lettered += 1
        log.warning("stream %s: dead-lettered %s: %s", self.stream, entry_id, reason)

    # -- internals

    def _read(self, start: str) -> list[tuple[str, dict | None]]:
        reply = self.client.xreadgroup(
            self.group,
            self.consumer,
            {self.stream: start},
            count=self.count,
            block=self.block_ms if start == ">" else None,
        )
        if not reply:
            return []
        entries = reply[0][1]  # RESP2 reply: [[stream, [(id, fields), ...]]]
        return [(_text(eid), fields) for eid, fields in entries]

    def _deliveries(self, entry_id: str) -> int:
        info = self.client.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
        return int(info[0]["times_delivered"]) if info else 1

    def _process(self, entries, handler, *, fresh: bool) -> int:
        try:
            return self._process_batch(entries, handler, fresh=fresh)
        finally:
            self._ack_handled()

    def _ack_handled(self) -> None:
        """Ack the entries whose handlers returned (one XACK). If Redis fails here they stay pending
        and come again: delivery is at least once."""
        if self._handled:
            ids, self._handled = self._handled, []
            self.client.xack(self.stream, self.group, *ids)
            self.stats.handled += len(ids)

    def _process_batch(self, entries, handler, *, fresh: bool) -> int:
        for entry_id, fields in entries:
            if not fields:  # pending entry whose data was trimmed (Redis 6.2 reports it this way)
                self.client.xack(self.stream, self.group, entry_id)
                self.stats.missing += 1
                log.error("stream %s: pending entry %s was trimmed before processing", self.stream, entry_id)
                continue
            deliveries = 1 if fresh else self._deliveries(entry_id)
            try:
                payload = decode(fields, self.payload_type)
            except PayloadError as e:
                self.dead_letter(entry_id, fields, f"unparseable payload: {e}", deliveries)
                continue
            if deliveries > self.max_deliveries:
                self.dead_letter(entry_id, fields, f"handler failed {deliveries - 1} times", deliveries)
                continue
            try:
                if not self._handle(handler, Message(self.stream, entry_id, payload, deliveries)):
                    return len(entries)  # stopped while retrying: this entry and the rest stay pending
            except Reject as e:
                self.dead_letter(entry_id, fields, str(e) or "rejected by handler", deliveries)
                continue
            except Exception:
                self.stats.handler_errors += 1
                log.exception("stream %s: handler failed on %s (delivery %d)", self.stream, entry_id, deliveries)
                continue
            self._handled.append(entry_id)
        return len(entries)

    def _handle(self, handler: Callable[[Message[T]], None], msg: Message[T]) -> bool:
        """Call `handler`, retrying `Transient` failures (see there) when running under `run()`;
        False if stopped first."""
        wait_s = TRANSIENT_FIRST_S
        while True:
            try:
                handler(msg)
                return True
            except Transient as e:
                if self._stop is None:  # poll() called directly, not run(): no way to stop; leave it pending
                    raise
                self.stats.transient_retries += 1
                self._ack_handled()  # the entries before this one are done: never leave them claimable
                log.warning("stream %s: %s; retrying %s in %.1f s", self.stream, str(e) or "a dependency is down",
                            msg.entry_id, wait_s)
            if self._stop.wait(wait_s):
                return False
            wait_s = min(wait_s * 2, TRANSIENT_MAX_S)
            # reset the entry's idle time without counting a delivery (JUSTID), so it is not claimable
            self.client.xclaim(self.stream, self.group, self.consumer, 0, [msg.entry_id], justid=True)


class ConsumerThread(Generic[T]):
    """Runs `consumer` in a daemon thread until `stop()`.

    The thread reads the group, hands each entry to `handler`, acks it once the handler returned,
    and reclaims entries other consumers left pending (`Consumer.poll`), looking for them at least
    as often as they become claimable (the consumer's `reclaim_every_s` is lowered to its
    `claim_idle_ms` where that is shorter). `Consumer.run` rides out Redis outages; anything else
    it raises is logged ("<name> failed") and the run restarts after 1 s, so the reader never dies.
    `stop()` ends it between entries, waiting up to `join_timeout_s`: unacked entries stay pending,
    for a restart under the same consumer name or another consumer's reclaim. The thread is named
    `name` with dashes for spaces; its failures go to `logger` (default: this module's).
    """

    def __init__(self, consumer: Consumer[T], handler: Callable[[Message[T]], None], *, name: str,
                 join_timeout_s: float = 5.0, logger: logging.Logger | None = None) -> None:
        consumer.reclaim_every_s = min(consumer.reclaim_every_s, consumer.claim_idle_ms / 1000)
        self.consumer, self.handler, self.name, self.join_timeout_s = consumer, handler, name, join_timeout_s
        self._log = logger or log
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.consumer.run(self.handler, self._stop)
            except Exception:  # never let the reader die: log, back off, go on
                self._log.exception("%s failed; restarting in 1 s", self.name)
                self._stop.wait(1.0)

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._run, name=self.name.replace(" ", "-"), daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop after the entry in hand; wait up to `timeout_s` (default `join_timeout_s`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.join_timeout_s if timeout_s is None else timeout_s)

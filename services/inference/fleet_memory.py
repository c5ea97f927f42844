"""The speculation memory across the fleet (TIDE_SPECULATION_MEMORY_FLEET).

Each worker publishes the token ids of the requests it added to its speculation memory to the
`memory` stream (tide.streams.MemoryEntry) and adds what the other workers published to its own
(LLMEngine.remember), so a request recalls what any worker of the stack served
(tide.engine.drafters.memory). Speculation stays lossless whatever the memory holds.

- Publishing never stalls a step: the engine's memory listener only queues (bounded; a full queue
  drops and counts), a thread XADDs. Requests that opted out (`no_memory`) never join a memory,
  and the engine calls its listeners only for what it added, so they are never published.
- Reading: one thread first takes the newest entries already there that its memory's budget can
  hold (a new or restarted worker warms from the fleet's recent traffic), then XREADs, blocking,
  for new ones. Its own entries and other targets' are skipped; an entry that fails its schema, its
  checksum, its seal or whose ids are out of the vocabulary is counted and dropped, never added.
- With data keys (TIDE_DATA_KEYS / TIDE_DATA_KEY_FILE) the ids are sealed like chunks are.
- Redis down: each side logs, backs off and goes on; serving never waits on it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import queue
import sys
import threading
import time
from array import array
from collections import Counter as Tally

import redis

from services.inference.metrics import FLEET_MEMORY
from services.inference.stream_reader import BACKOFF_S, follow
from tide import streams
from tide.datakeys import Keyring, Unauthentic

log = logging.getLogger(__name__)

PUBLISH_QUEUE = 1024  # finished requests waiting for the publisher (a Redis outage's backlog)
READ_BATCH = 256  # entries per XREAD
READ_BLOCK_MS = 1000  # how long an XREAD waits for new entries (and so how fast `stop` returns)
# What one published request takes in a memory: ~384 tokens (a 256-token prompt tail and the output)
# at 150-400 B a token indexed (docs/results/speculation-memory): the warm-up reads budget / this.
WARM_BYTES_PER_ENTRY = 96 << 10


def pack(ids: list[int]) -> bytes:
    """Token ids as little-endian int32 bytes."""
    a = array("i", ids)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def unpack(raw: bytes) -> list[int]:
    if len(raw) % 4:
        raise ValueError(f"{len(raw)} bytes is not a whole number of int32 ids")
    a = array("i")
    a.frombytes(raw)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


def entry(worker_id: str, target_model: str, scope: str, prompt: list[int], output: list[int],
          key_id: str, request_id: str, keyring: Keyring) -> streams.MemoryEntry:
    blob = keyring.seal(pack(prompt + output))
    return streams.MemoryEntry(worker_id=worker_id, target_model=target_model, scope=scope,
                               prompt_tokens=len(prompt), tokens=base64.b64encode(blob).decode(),
                               sha256=hashlib.sha256(blob).hexdigest(), data_key_id=keyring.current,
                               created_unix_s=round(time.time(), 3), key_id=key_id, request_id=request_id)


def open_entry(e: streams.MemoryEntry, keyring: Keyring, vocab_size: int) -> tuple[list[int], list[int]]:
    """(prompt tail, output) of an entry; ValueError (or Unauthentic) when it cannot be trusted."""
    blob = base64.b64decode(e.tokens, validate=True)
    if hashlib.sha256(blob).hexdigest() != e.sha256:
        raise ValueError("checksum mismatch")
    ids = unpack(keyring.open(blob))
    if e.prompt_tokens > len(ids) or any(not 0 <= t < vocab_size for t in ids):
        raise ValueError("ids out of range for this target")
    return ids[:e.prompt_tokens], ids[e.prompt_tokens:]


class FleetMemory:
    """Publishes this worker's memory additions and feeds it the fleet's (see the module doc).
    `engine`: an LLMEngine with a speculation memory. `stats`: counts by what happened."""

    def __init__(self, client: redis.Redis, stream: str, engine, *, worker_id: str, target_model: str,
                 keyring: Keyring | None = None) -> None:
        self.client, self.stream, self.engine = client, stream, engine
        self.worker_id, self.target_model = worker_id, target_model
        self.keyring = keyring or Keyring(())
        self.vocab_size = engine.model.cfg.vocab_size
        self.stats: Tally[str] = Tally()
        self._outbox: queue.Queue[tuple[str, list[int], list[int], str, str] | None] = queue.Queue(PUBLISH_QUEUE)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._publish_loop, name="fleet-memory-publish", daemon=True),
                         threading.Thread(target=self._read_loop, name="fleet-memory-read", daemon=True)]

    def _count(self, outcome: str) -> None:
        self.stats[outcome] += 1
        FLEET_MEMORY.labels(outcome).inc()

    def start(self) -> FleetMemory:
        self.engine.memory_listeners.append(self.offer)
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Full):
            self._outbox.put_nowait(None)  # wakes the publisher
        for t in self._threads:
            t.join(timeout_s)

    def offer(self, scope: str, prompt: list[int], output: list[int], key_id: str = "", request_id: str = "") -> None:
        """The engine's memory listener (engine thread): queue, never block."""
        try:
            self._outbox.put_nowait((scope, prompt, output, key_id, request_id))
        except queue.Full:
            self._count("publish_dropped")

    def _publish_loop(self) -> None:
        wait = BACKOFF_S[0]
        while not self._stop.is_set():
            item = self._outbox.get()
            if item is None:
                continue
            e = entry(self.worker_id, self.target_model, *item, self.keyring)
            while not self._stop.is_set():
                try:
                    streams.add(self.client, self.stream, e)
                    self._count("published")
                    wait = BACKOFF_S[0]
                    break
                except redis.RedisError as err:
                    self._count("publish_errors")
                    log.warning("fleet memory: cannot publish to %s (%s); retrying in %.1f s", self.stream, err, wait)
                    self._stop.wait(wait)
                    wait = min(2 * wait, BACKOFF_S[1])

    def _warm(self) -> str:
        """Take the newest entries the memory can hold; the id to read on from ("0": none there)."""
        n = max(1, min(self.engine.memory.budget_bytes // WARM_BYTES_PER_ENTRY, streams.MEMORY_MAXLEN))
        newest = self.client.xrevrange(self.stream, count=n)
        for entry_id, fields in reversed(newest):
            self._take(streams._text(entry_id), fields)
        self.stats["warmed"] = len(newest)
        return streams._text(newest[0][0]) if newest else "0"

    def _read_loop(self) -> None:
        follow(self.client, self.stream, start=self._warm, handle=self._take, stop=self._stop, count=READ_BATCH,
               block_ms=READ_BLOCK_MS, what="fleet memory", on_error=lambda: self._count("read_errors"))

    def _take(self, entry_id: str, fields: dict) -> None:
        try:
            e = streams.decode(fields, streams.MemoryEntry)
        except streams.PayloadError as err:
            self._count("corrupt")
            log.warning("fleet memory: entry %s dropped: %s", entry_id, err)
            return
        if e.worker_id == self.worker_id:
            self._count("own")
            return
        if e.target_model != self.target_model:
            self._count("other_target")
            return
        try:
            prompt, output = open_entry(e, self.keyring, self.vocab_size)
        except (ValueError, Unauthentic) as err:
            self._count("corrupt")
            log.warning("fleet memory: entry %s from %s dropped: %s", entry_id, e.worker_id, err)
            return
        if self.engine.remember(e.scope, prompt, output, e.key_id, e.request_id):
            self._count("added")

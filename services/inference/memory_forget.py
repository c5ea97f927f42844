"""Deletion requests reach the worker's speculation memory (the `forget` stream).

`tidectl data forget --request-id / --key-id` asks the trainer, which deletes the stored rows and
then publishes a tide.streams.ForgetNotice on `<prefix>:forget`. Each worker with a speculation
memory reads that stream and drops the matching documents from its memory in RAM (and from what
it has queued from the fleet), refusing them from then on (tide.engine.drafters.memory). It reads
from the stream's end at start: a worker that starts later holds nothing older, and what it warms
from the fleet's stream the trainer has already deleted there.

Redis down: it logs, backs off and goes on (stream_reader.follow); serving never waits on it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter as Tally

import redis

from services.inference.metrics import MEMORY_FORGET
from services.inference.stream_reader import follow
from tide import streams

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000  # how long an XREAD waits for a notice (and so how fast `stop` returns)
APPLY_TIMEOUT_S = 60.0  # a notice waits this long for the engine thread before it is counted failed


class MemoryForgetter:
    """Applies forget notices to `worker`'s speculation memory (Worker.forget_memory). `stats`:
    notices by outcome (applied, corrupt, failed) and the documents they dropped."""

    def __init__(self, client: redis.Redis, stream: str, worker) -> None:
        self.client, self.stream, self.worker = client, stream, worker
        self.stats: Tally[str] = Tally()
        self._stop = threading.Event()
        self._last: str | None = None
        self._thread = threading.Thread(target=self._loop, name="memory-forget", daemon=True)

    def _count(self, outcome: str, n: int = 1) -> None:
        self.stats[outcome] += n
        MEMORY_FORGET.labels(outcome).inc(n)

    def start(self) -> MemoryForgetter:
        with contextlib.suppress(redis.RedisError):  # unreachable: the reader asks again
            self._last = self._newest()  # before serving: no notice published from here on is missed
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _newest(self) -> str:
        """The id of the newest notice now ("0": none yet); raises RedisError."""
        newest = self.client.xrevrange(self.stream, count=1)
        return streams._text(newest[0][0]) if newest else "0"

    def _start(self) -> str:
        return self._last if self._last is not None else self._newest()

    def _loop(self) -> None:
        follow(self.client, self.stream, start=self._start, handle=self.apply, stop=self._stop, count=64,
               block_ms=READ_BLOCK_MS, what="memory forget", on_error=lambda: self._count("read_errors"))

    def apply(self, entry_id: str, fields: dict) -> int:
        """Apply one notice; the documents it dropped (0 when it could not be applied)."""
        try:
            notice = streams.decode(fields, streams.ForgetNotice)
        except streams.PayloadError as err:
            self._count("corrupt")
            log.warning("memory forget: notice %s dropped: %s", entry_id, err)
            return 0
        try:
            n = self.worker.forget_memory(key_id=notice.key_id, request_id=notice.request_id).result(APPLY_TIMEOUT_S)
        except Exception as err:  # the engine thread is stuck or stopping: say so, go on
            self._count("failed")
            log.error("memory forget: notice %s not applied: %s", entry_id, err)
            return 0
        self._count("applied")
        self._count("documents", n)
        kind, value = ("key id", notice.key_id) if notice.key_id else ("request", notice.request_id)
        log.warning("memory forget: %s %s: %d documents dropped from the speculation memory", kind, value, n)
        return n

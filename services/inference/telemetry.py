"""Step-record publisher: engine step records -> bounded buffer -> batched XADDs on the telemetry stream.

`publish` is the engine's step listener (loop thread, never blocks on the network): it appends to
an in-memory deque of at most `buffer_cap` records, dropping the oldest (counted) when full. A
background thread sends batches of up to `batch_size` records in one pipeline every `interval_s`
seconds (sooner when a batch is ready). While Redis is unreachable the records stay buffered, the
thread retries with capped exponential backoff, logs once per outage, and resumes on recovery.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

import redis

from services.inference import metrics
from tide import streams
from tide.telemetry import StepRecord

log = logging.getLogger(__name__)


@dataclass
class TelemetryStats:
    published: int = 0  # records written to the stream
    dropped: int = 0  # records dropped, oldest first, because the buffer was full
    errors: int = 0  # failed publish attempts (one per batch)


class TelemetryPublisher:
    def __init__(self, client: redis.Redis, stream: str, *, batch_size: int = 64, interval_s: float = 0.5,
                 buffer_cap: int = 10_000, max_backoff_s: float = 5.0) -> None:
        if batch_size < 1 or buffer_cap < 1 or interval_s <= 0:
            raise ValueError("batch_size and buffer_cap must be >= 1, interval_s > 0")
        self.client, self.stream = client, stream
        self.batch_size, self.interval_s, self.buffer_cap = batch_size, interval_s, buffer_cap
        self.max_backoff_s = max_backoff_s
        self.stats = TelemetryStats()
        self._buf: deque[StepRecord] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._down = False  # inside an outage (for one log line per outage)
        self._dropped_in_outage = 0

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def publish(self, record: StepRecord) -> None:
        """Step listener: buffer one record (O(1); drops the oldest when the buffer is full)."""
        with self._lock:
            if len(self._buf) >= self.buffer_cap:
                self._buf.popleft()
                self._count_drop(1)
            self._buf.append(record)
            ready = len(self._buf) >= self.batch_size
        if ready:
            self._wake.set()

    def start(self) -> TelemetryPublisher:
        self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)
        self._thread.start()
        return self

    def stop(self, flush_timeout_s: float = 2.0) -> None:
        """Stop the thread after one last attempt to publish what is buffered."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=flush_timeout_s + 5)

    def flush(self) -> int:
        """Publish buffered records in batches until empty or Redis fails; returns how many were sent."""
        sent = 0
        while True:
            with self._lock:
                batch = [self._buf.popleft() for _ in range(min(self.batch_size, len(self._buf)))]
            if not batch:
                return sent
            try:
                pipe = self.client.pipeline(transaction=False)
                maxlen = streams.default_maxlen(self.stream)
                for rec in batch:
                    pipe.xadd(self.stream, streams.encode(rec), maxlen=maxlen, approximate=True)
                pipe.execute()
            except redis.RedisError as e:
                self._requeue(batch)
                self._failed(e)
                raise
            sent += len(batch)
            self.stats.published += len(batch)
            metrics.TELEMETRY_PUBLISHED.inc(len(batch))
            if self._down:
                log.warning("telemetry: redis reachable again; publishing resumed (%d records dropped during the "
                            "outage)", self._dropped_in_outage)
                self._down, self._dropped_in_outage = False, 0
            metrics.TELEMETRY_BUFFERED.set(len(self._buf))

    # ---- internals

    def _count_drop(self, n: int) -> None:
        if self._dropped_in_outage == 0:
            log.warning("telemetry: buffer full (%d records); dropping the oldest step records", self.buffer_cap)
        self.stats.dropped += n
        self._dropped_in_outage += n
        metrics.TELEMETRY_DROPPED.inc(n)

    def _requeue(self, batch: list[StepRecord]) -> None:
        """Put a failed batch back in front; what no longer fits is the oldest, so it goes."""
        with self._lock:
            self._buf.extendleft(reversed(batch))
            over = len(self._buf) - self.buffer_cap
            for _ in range(max(0, over)):
                self._buf.popleft()
            if over > 0:
                self._count_drop(over)
            metrics.TELEMETRY_BUFFERED.set(len(self._buf))

    def _failed(self, e: Exception) -> None:
        self.stats.errors += 1
        metrics.TELEMETRY_ERRORS.inc()
        if not self._down:
            self._down = True
            log.warning("telemetry: redis unreachable (%s); buffering up to %d step records, dropping the oldest "
                        "beyond that; serving continues", e, self.buffer_cap)

    def _run(self) -> None:
        backoff = self.interval_s
        while not self._stop.is_set():
            if self._down:  # publish() keeps setting _wake during an outage: do not spin on it
                self._stop.wait(backoff)
            else:
                self._wake.wait(self.interval_s)
            self._wake.clear()
            try:
                self.flush()
                backoff = self.interval_s
            except redis.RedisError:
                backoff = min(max(backoff * 2, self.interval_s), self.max_backoff_s)
            except Exception:
                log.exception("telemetry: unexpected publish failure")
        try:
            self.flush()
        except Exception as e:
            log.warning("telemetry: %d step records not published at shutdown (%s)", len(self._buf), e)

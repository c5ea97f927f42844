"""Reads the telemetry stream (consumer group "controller") into `FleetStats`, in a thread.

Delivery is at-least-once (tide.streams.Consumer): an entry is acked after `FleetStats.observe`
returns; entries a dead controller left pending are reclaimed after `claim_idle_ms`; unparseable
entries are dead-lettered with the reason. A re-delivered step record is counted again, which only
nudges EMAs: acceptance statistics tolerate it, and exactly-once would cost a dedupe table.
"""

from __future__ import annotations

import logging
import threading

import redis

from services.controller.stats import FleetStats
from tide import streams
from tide.streams import Consumer, Message
from tide.telemetry import StepRecord

log = logging.getLogger(__name__)


class TelemetryReader:
    def __init__(self, client: redis.Redis, names: streams.StreamNames, consumer: str, stats: FleetStats,
                 claim_idle_ms: int = 30_000, block_ms: int = 500, reclaim_every_s: float = 5.0) -> None:
        self.stats = stats
        self.consumer = Consumer(client, names.telemetry, streams.CONTROLLER_GROUP, consumer, StepRecord,
                                 dead_letter_stream=names.dead_letter, claim_idle_ms=claim_idle_ms,
                                 block_ms=block_ms, reclaim_every_s=min(reclaim_every_s, claim_idle_ms / 1000),
                                 count=256)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def handle(self, msg: Message[StepRecord]) -> None:
        self.stats.observe(msg.payload)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.consumer.run(self.handle, self._stop)
            except Exception:  # never let the reader die: log, back off, go on
                log.exception("telemetry reader failed; restarting in 1 s")
                self._stop.wait(1.0)

    def start(self) -> TelemetryReader:
        self._thread = threading.Thread(target=self._run, name="telemetry-reader", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

"""Reads the telemetry stream (consumer group "controller") into `FleetStats`, in a thread.

Delivery is at-least-once (tide.streams.Consumer): an entry is acked after `FleetStats.observe`
returns; entries a dead controller left pending are reclaimed after `claim_idle_ms`; unparseable
entries are dead-lettered with the reason. A re-delivered step record is counted again, which only
nudges EMAs: acceptance statistics tolerate it, and exactly-once would cost a dedupe table.
"""

from __future__ import annotations

import logging

import redis

from services.controller.stats import FleetStats
from tide import streams
from tide.streams import Consumer, ConsumerThread, Message
from tide.telemetry import StepRecord

log = logging.getLogger(__name__)


class TelemetryReader(ConsumerThread[StepRecord]):
    """The telemetry consumer in a thread ("telemetry-reader") until `stop()` (waits up to 5 s)."""

    def __init__(self, client: redis.Redis, names: streams.StreamNames, consumer: str, stats: FleetStats,
                 claim_idle_ms: int = 30_000, block_ms: int = 500, reclaim_every_s: float = 5.0) -> None:
        self.stats = stats
        super().__init__(Consumer(client, names.telemetry, streams.CONTROLLER_GROUP, consumer, StepRecord,
                                  dead_letter_stream=names.dead_letter, claim_idle_ms=claim_idle_ms,
                                  block_ms=block_ms, reclaim_every_s=reclaim_every_s, count=256),
                         self.handle, name="telemetry reader", join_timeout_s=5.0, logger=log)

    def handle(self, msg: Message[StepRecord]) -> None:
        self.stats.observe(msg.payload)

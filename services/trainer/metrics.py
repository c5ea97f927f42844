"""Prometheus metrics of the trainer service, read from the domain objects at scrape time."""

from __future__ import annotations

from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily

from services.trainer.cycle import FAILED, PROMOTED, REGISTERED

RESULTS = (PROMOTED, REGISTERED, FAILED)


class TrainerCollector:
    def __init__(self, service) -> None:  # services.trainer.app.TrainerService
        self.service = service

    def collect(self):
        s = self.service
        chunks = CounterMetricFamily("tide_trainer_chunks", "Chunk references by fate", labels=["fate"])
        chunks.add_metric(["accepted"], s.ingest.stats.accepted)
        chunks.add_metric(["deduplicated"], s.ingest.stats.deduplicated)
        chunks.add_metric(["dead_lettered"], s.reader.consumer.stats.dead_lettered)
        chunks.add_metric(["handler_errors"], s.reader.consumer.stats.handler_errors)
        chunks.add_metric(["reclaimed"], s.reader.consumer.stats.reclaimed)
        yield chunks
        yield CounterMetricFamily("tide_trainer_accepted_tokens", "Tokens of accepted chunks",
                                  value=s.ingest.stats.accepted_tokens)
        yield CounterMetricFamily("tide_trainer_intake_retries", "Chunk intake attempts retried because the object "
                                  "store was unreachable (the chunk was kept, not dead-lettered)",
                                  value=s.reader.consumer.stats.transient_retries)
        if s.reconciler is not None:
            r = s.reconciler.stats
            orphans = CounterMetricFamily("tide_trainer_orphan_blobs", "Chunk blobs older than the grace period that "
                                          "no stream entry named, by what the reconciler did: enqueued (valid), "
                                          "dead_lettered (corrupt)", labels=["fate"])
            orphans.add_metric(["enqueued"], r.enqueued)
            orphans.add_metric(["dead_lettered"], r.dead_lettered)
            yield orphans
            yield CounterMetricFamily("tide_trainer_reconcile_passes", "Finished reconciler passes", value=r.passes)
            yield CounterMetricFamily("tide_trainer_reconcile_errors", "Reconciler passes that failed (S3 or Redis "
                                      "unreachable; the next one starts over)", value=r.errors)
        g = getattr(s, "governor", None)
        if g is not None:
            deleted = CounterMetricFamily("tide_trainer_chunks_deleted", "Chunk blobs deleted by reason: "
                                          "retention_consumed, retention_unconsumed, budget, forget", labels=["reason"])
            deleted_bytes = CounterMetricFamily("tide_trainer_chunk_bytes_deleted", "Bytes of deleted chunk blobs by "
                                                "reason", labels=["reason"])
            for reason in ("retention_consumed", "retention_unconsumed", "budget", "forget"):
                deleted.add_metric([reason], g.stats.deleted[reason])
                deleted_bytes.add_metric([reason], g.stats.deleted_bytes[reason])
            yield deleted
            yield deleted_bytes
            yield GaugeMetricFamily("tide_trainer_bucket_chunk_bytes", "Chunk blob bytes in the bucket at the last "
                                    "sweep", value=g.stats.bucket_bytes)
            yield GaugeMetricFamily("tide_trainer_bucket_budget_bytes", "TIDE_CHUNK_BUCKET_BYTES (0 = none)",
                                    value=g.policy.budget_bytes)
            yield CounterMetricFamily("tide_trainer_stream_entries_trimmed", "Chunk and dead-letter stream entries "
                                      "trimmed by retention", value=g.stats.stream_trimmed)
            yield CounterMetricFamily("tide_trainer_rows_forgotten", "Chunk rows removed by forget",
                                      value=g.stats.rows_forgotten)
        cycle = getattr(s.runner, "cycle", None)
        yield CounterMetricFamily("tide_trainer_chunks_quarantined", "Sealed chunk blobs that failed authentication "
                                  "(dead-lettered or skipped, never trained on)",
                                  value=s.ingest.stats.quarantined + int(getattr(cycle, "quarantined", 0)))
        n, tokens = s.manifest.buffered_totals()
        yield GaugeMetricFamily("tide_trainer_buffered_chunks", "Accepted chunks not trained on yet", value=n)
        yield GaugeMetricFamily("tide_trainer_buffered_tokens", "Tokens of buffered chunks", value=tokens)
        yield GaugeMetricFamily("tide_trainer_training", "1 while a training run is going",
                                value=1 if s.runner.busy else 0)
        stats = s.runner.stats
        runs = CounterMetricFamily("tide_trainer_runs", "Finished training runs by result: promoted, registered "
                                   "(not promoted), failed (nothing registered, chunks kept)", labels=["result"])
        for result in RESULTS:
            runs.add_metric([result], stats.results[result])
        yield runs
        yield CounterMetricFamily("tide_trainer_training_seconds", "Wall time of finished training runs",
                                  value=stats.seconds)
        accept = GaugeMetricFamily("tide_trainer_eval_accept_length", "Served accept length at the eval gamma on "
                                   "held-out chunks, of the last evaluated run (base: 1.0 without a draft)",
                                   labels=["draft"])
        if stats.last_candidate is not None:
            accept.add_metric(["candidate"], stats.last_candidate)
            accept.add_metric(["base"], stats.last_base or 0.0)
        yield accept


def register(service) -> TrainerCollector:
    collector = TrainerCollector(service)
    REGISTRY.register(collector)
    return collector

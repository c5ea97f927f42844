"""Prometheus metrics of the controller, read from the domain objects at scrape time (a custom
collector: the domain keeps plain counters, nothing is double-booked)."""

from __future__ import annotations

from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily


class ControllerCollector:
    def __init__(self, service) -> None:  # services.controller.app.ControllerService
        self.service = service

    def collect(self):
        c = self.service.controller
        consumer = self.service.reader.consumer.stats
        yield CounterMetricFamily("tide_controller_telemetry_records", "Step records consumed",
                                  value=c.stats.records)
        stream = CounterMetricFamily("tide_controller_telemetry_entries", "Telemetry entries by fate", labels=["fate"])
        for fate in ("handled", "dead_lettered", "handler_errors", "reclaimed", "missing"):
            stream.add_metric([fate], getattr(consumer, fate))
        yield stream
        pushes = CounterMetricFamily("tide_controller_pushes", "Decision pushes by outcome", labels=["outcome"])
        for outcome in ("applied", "already_applied", "rejected", "failed"):
            pushes.add_metric([outcome], getattr(c.fleet.pushes, outcome))
        yield pushes
        ema = GaugeMetricFamily("tide_controller_accept_length_ema", "Accept length EMA (bonus token included)",
                                labels=["target", "draft_version", "horizon"])
        rate = GaugeMetricFamily("tide_controller_acceptance_rate_ema",
                                 "Acceptance rate EMA per checked draft token (accepted / checked; the shift test)",
                                 labels=["target", "draft_version", "horizon"])
        for target in c.stats.targets():
            for d in c.stats.drafts(target):
                for horizon, length, accepted in (("short", d.short, d.rate_short), ("long", d.long, d.rate_long)):
                    ema.add_metric([target, d.draft_version, horizon], length.value)
                    rate.add_metric([target, d.draft_version, horizon], accepted.value)
        yield ema
        yield rate
        batch = GaugeMetricFamily("tide_controller_worker_mean_batch", "Mean running batch over the load window",
                                  labels=["worker_id", "target"])
        tps = GaugeMetricFamily("tide_controller_worker_tokens_per_s", "Emitted tokens/s over the load window",
                                labels=["worker_id", "target"])
        for load in c.stats.load():
            batch.add_metric([load.worker_id, load.target_model], load.mean_batch)
            tps.add_metric([load.worker_id, load.target_model], load.tokens_per_s)
        yield batch
        yield tps
        yield from self._collection_and_rollback(c)
        workers = c.fleet.workers()
        yield GaugeMetricFamily("tide_controller_workers", "Known workers", value=len(workers))
        yield GaugeMetricFamily("tide_controller_workers_reachable", "Workers that answered the last status call",
                                value=sum(w.reachable for w in workers))

    @staticmethod
    def _collection_and_rollback(c):
        enabled = GaugeMetricFamily("tide_controller_collection_enabled",
                                    "1 while the controller has collection on for the target (0: off or undecided)",
                                    labels=["target"])
        for target in c.collection.targets():
            enabled.add_metric([target], 1.0 if c.collection.state(target).enabled else 0.0)
        yield enabled
        changes = CounterMetricFamily("tide_controller_collection_changes", "Collection state changes by reason",
                                      labels=["target", "reason"])
        for (target, reason), n in sorted(c.collection.change_counts().items()):
            changes.add_metric([target, reason], n)
        yield changes
        rollbacks = CounterMetricFamily("tide_controller_rollbacks", "Automatic rollbacks of a promoted draft",
                                        labels=["target"])
        failures = CounterMetricFamily("tide_controller_rollback_failures",
                                       "Rollbacks the registry refused or did not answer", labels=["target"])
        done, failed = c.rollback.counts()
        for target, n in sorted(done.items()):
            rollbacks.add_metric([target], n)
        for target, n in sorted(failed.items()):
            failures.add_metric([target], n)
        yield rollbacks
        yield failures
        refusals = CounterMetricFamily("tide_controller_draft_refusals",
                                       "Workers' refusals of the registry's effective draft the controller acted on, "
                                       "by what it did (rolled_back, pinned, nothing_to_roll_back_to, "
                                       "registry_refused)", labels=["target", "reason", "outcome"])
        for (target, reason, outcome), n in sorted(c.refusals.counts().items()):
            refusals.add_metric([target, reason, outcome], n)
        yield refusals
        refusal_failures = CounterMetricFamily("tide_controller_draft_refusal_failures",
                                               "Registry calls about a refused draft that failed (retried)",
                                               labels=["target"])
        for target, n in sorted(c.refusals.failures().items()):
            refusal_failures.add_metric([target], n)
        yield refusal_failures


def register(service) -> ControllerCollector:
    collector = ControllerCollector(service)
    REGISTRY.register(collector)
    return collector


def unregister(collector: ControllerCollector) -> None:
    REGISTRY.unregister(collector)

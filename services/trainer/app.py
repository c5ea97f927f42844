"""Wiring: settings -> object storage (waits for it), manifest, chunk intake, reconciler of
unreferenced chunk blobs, draft registry client, training cycle and runner, automatic trigger ->
gRPC server. `build(settings)` returns a
running `TrainerService`; `__main__` adds process priority and CPUs, signals, logs and metrics.
Outcomes go to the controller (ReportTrainingOutcome) when TIDE_CONTROLLER_ADDR is set.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.trainer.auto import AutoTrigger
from services.trainer.cycle import TrainingCycle
from services.trainer.drafts import DraftRegistry
from services.trainer.governance import HOUR_S, DataGovernor, Policy
from services.trainer.ingest import ChunkIngest, ChunkReader
from services.trainer.manifest import Manifest
from services.trainer.reconcile import Reconciler
from services.trainer.runs import TrainingOutcome, TrainingRunner
from services.trainer.server import outcome_pb, serve
from services.trainer.settings import TrainerSettings
from tide import grpcutil, streams
from tide.grpcutil import GrpcServer
from tide.proto.tide.v1 import controller_pb2_grpc
from tide.service import wait_for_storage

log = logging.getLogger(__name__)


def controller_reporter(address: str, token: str | None, attempts: int = 3) -> Callable[[TrainingOutcome], None]:
    """Reports outcomes with ReportTrainingOutcome (idempotent by run id, so retries are safe)."""
    stub = controller_pb2_grpc.ControllerServiceStub(grpcutil.channel(address, token=token, actor="trainer"))

    def report(outcome: TrainingOutcome) -> None:
        for attempt in range(attempts):
            try:
                r = stub.ReportTrainingOutcome(outcome_pb(outcome), timeout=10)
                log.info("outcome of %s reported to the controller (recorded=%s)", outcome.run_id, r.recorded)
                return
            except grpc.RpcError as e:
                log.warning("reporting %s to the controller at %s failed (%s: %s), attempt %d/%d", outcome.run_id,
                            address, e.code().name, e.details(), attempt + 1, attempts)
                time.sleep(2**attempt)

    return report


class _WakeAfterIntake:
    """The stream handler: intake, then a look by the automatic trigger."""

    def __init__(self, ingest: ChunkIngest, auto: AutoTrigger) -> None:
        self.ingest, self.auto = ingest, auto

    def handle(self, msg) -> None:
        self.ingest.handle(msg)
        self.auto.wake()


@dataclass
class TrainerService:
    settings: TrainerSettings
    manifest: Manifest
    ingest: ChunkIngest
    reader: ChunkReader
    runner: TrainingRunner
    registry: DraftRegistry
    auto: AutoTrigger | None = None
    server: GrpcServer | None = None
    reconciler: Reconciler | None = None
    governor: DataGovernor | None = None

    @property
    def target(self) -> str:
        return self.server.target

    def stop(self, grace_s: float = 2.0) -> None:
        """NOT_SERVING, in-flight RPCs finish, intake stops (unacked entries stay pending). A run in
        progress is abandoned: nothing is recorded, its chunks stay buffered for the next run."""
        if self.server is not None:
            self.server.stop(grace_s)
        if self.auto is not None:
            self.auto.stop()
        if self.reconciler is not None:
            self.reconciler.stop()
        if self.governor is not None:
            self.governor.stop()
        self.reader.stop()
        self.registry.close()


def build(settings: TrainerSettings, *, storage_timeout_s: float = 60.0) -> TrainerService:
    s3 = wait_for_storage(settings.storage, storage_timeout_s, logger=log)
    manifest = Manifest(s3, settings.storage.s3_bucket, settings.prefix).load()
    keyring = settings.storage.keyring()
    names = streams.StreamNames(settings.storage.stream_prefix)
    rclient = settings.storage.redis_client(socket_connect_timeout=2.0, socket_timeout=5.0)
    policy = Policy(retention_s=settings.chunk_retention_h * HOUR_S,
                    unconsumed_retention_s=settings.chunk_unconsumed_retention_h * HOUR_S,
                    budget_bytes=settings.chunk_bucket_bytes)
    governor = DataGovernor(s3, settings.storage.s3_bucket, manifest, rclient, names, keyring, policy,
                            chunk_prefix=settings.reconcile_prefix, interval_s=settings.sweep_interval_s)
    ingest = ChunkIngest(s3, manifest, keyring, governor)
    registry = DraftRegistry(settings.registry_addr, settings.admin_token, s3, settings.storage.s3_bucket,
                             Path(settings.work_dir) / "drafts")
    report = controller_reporter(settings.controller_addr, settings.admin_token) if settings.controller_addr else None
    runner = TrainingRunner(settings, TrainingCycle(settings, s3, manifest, registry, keyring, policy), manifest,
                            report)
    auto = AutoTrigger(runner, manifest, settings.auto_check_s) if settings.auto_train else None
    reader = ChunkReader(rclient, names, settings.consumer,
                         _WakeAfterIntake(ingest, auto) if auto else ingest, claim_idle_ms=settings.claim_idle_ms)
    reconciler = Reconciler(s3, settings.storage.s3_bucket, rclient, names, manifest,
                            prefix=settings.reconcile_prefix, interval_s=settings.reconcile_interval_s,
                            grace_s=settings.reconcile_grace_s, keyring=keyring,
                            ) if settings.reconcile_interval_s > 0 else None
    service = TrainerService(settings, manifest, ingest, reader, runner, registry, auto, reconciler=reconciler,
                             governor=governor)
    governor.start()
    reader.start()
    if reconciler is not None:  # chunk blobs a dying worker left without a reference
        reconciler.start()
    if auto is not None:
        auto.start()
    service.server = serve(service, settings.listen, settings.admin_token)
    log.info("trainer serving on %s (target %s, bucket %s, prefix %s, registry %s, automatic training %s, "
             "automatic promotion %s)", service.server.target, settings.target, settings.storage.s3_bucket,
             settings.prefix, settings.registry_addr, "on" if auto else "off", "on" if settings.auto_promote else "off")
    return service

"""`python -m services.registry`: the draft registry service.

Wiring: settings from the environment -> S3 client (waits for storage, creates the bucket) ->
store -> watch hub (pointer polling) -> gRPC server (health, reflection, admin auth) + Prometheus
metrics. JSON log lines on stderr. SIGTERM/SIGINT: report NOT_SERVING, end watch streams (workers
reconnect with backoff), let in-flight calls finish within a grace period, exit 0.
The process's life is `tide.service.run_service` (a bad setting: exit 2, like every service), with
one difference: the signal handlers go in only once the service is up (a signal during start-up,
e.g. while storage is awaited, ends the process at once).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from services.registry import starter
from services.registry.server import build_server
from services.registry.settings import RegistrySettings
from services.registry.store import RegistryStore
from services.registry.watch import WatchHub
from tide.grpcutil import GrpcServer
from tide.service import run_service, wait_for_storage

log = logging.getLogger("tide.registry")


@dataclass
class RegistryService:
    server: GrpcServer
    hub: WatchHub

    def stop(self) -> None:
        """NOT_SERVING, end watch streams, let in-flight calls finish (5 s)."""
        self.server.set_serving("", False)
        self.hub.stop()
        self.server.stop(grace_s=5.0)


def build(settings: RegistrySettings) -> RegistryService:
    s3 = wait_for_storage(settings.storage, logger=log)
    store = RegistryStore(s3, settings.storage.s3_bucket, settings.root, work_dir=settings.work_dir)
    if settings.starter_drafts:  # before serving: a worker's first watch already sees the starter
        starter.seed(store, s3, settings.storage.s3_bucket, settings.root, Path(settings.starter_drafts))
    hub = WatchHub(store, settings.poll_s).start()
    server = build_server(store, hub, settings.listen, settings.admin_token, settings.max_workers)
    server.start()
    log.info(
        "registry serving",
        extra={
            "address": server.target,
            "bucket": settings.storage.s3_bucket,
            "root": settings.root,
            "metrics_port": settings.metrics_port,
        },
    )
    return RegistryService(server, hub)


def _metrics_address(settings: RegistrySettings) -> tuple[str, int]:
    return settings.listen.rsplit(":", 1)[0].strip("[]"), settings.metrics_port


def main(argv: list[str] | None = None) -> int:
    return run_service(log.name, RegistrySettings.from_env, build,
                       without_admin_token="every admin call (register, promote, pin, ...) will be refused",
                       metrics_address=_metrics_address, signals_during_build=False)


if __name__ == "__main__":
    sys.exit(main())

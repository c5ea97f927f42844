"""`python -m services.registry`: the draft registry service.

Wiring: settings from the environment -> S3 client (waits for storage, creates the bucket) ->
store -> watch hub (pointer polling) -> gRPC server (health, reflection, admin auth) + Prometheus
metrics. JSON log lines on stderr. SIGTERM/SIGINT: report NOT_SERVING, end watch streams (workers
reconnect with backoff), let in-flight calls finish within a grace period, exit 0.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

from prometheus_client import start_http_server

from services.registry.server import build_server
from services.registry.settings import RegistrySettings
from services.registry.store import RegistryStore
from services.registry.watch import WatchHub
from tide.blobs import ensure_bucket
from tide.logs import configure_logging

log = logging.getLogger("tide.registry")
def _wait_for_storage(settings: RegistrySettings, timeout_s: float = 60.0):
    s3, deadline, delay = settings.storage.s3_client(), time.monotonic() + timeout_s, 0.2
    while True:
        try:
            ensure_bucket(s3, settings.storage.s3_bucket)
            return s3
        except Exception as e:
            if time.monotonic() > deadline:
                raise
            log.warning("object storage not ready (%s); retrying", e)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def main(argv: list[str] | None = None) -> int:
    settings = RegistrySettings.from_env()
    configure_logging(settings.log_level)
    if not settings.admin_token:
        log.warning("TIDE_ADMIN_TOKEN is not set: every admin call (register, promote, pin, ...) will be refused")
    s3 = _wait_for_storage(settings)
    store = RegistryStore(s3, settings.storage.s3_bucket, settings.root, work_dir=settings.work_dir)
    hub = WatchHub(store, settings.poll_s).start()
    server = build_server(store, hub, settings.listen, settings.admin_token, settings.max_workers)
    server.start()
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr=settings.listen.rsplit(":", 1)[0].strip("[]"))
    log.info(
        "registry serving",
        extra={
            "address": server.target,
            "bucket": settings.storage.s3_bucket,
            "root": settings.root,
            "metrics_port": settings.metrics_port,
        },
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    log.info("shutting down")
    server.set_serving("", False)
    hub.stop()
    server.stop(grace_s=5.0)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m services.inference`: run one inference worker until SIGTERM/SIGINT.

Configuration: `TIDE_*` environment variables (see settings.py). Logs are JSON lines on stderr
(`TIDE_LOG_LEVEL`, default INFO); Prometheus metrics on http://<listen host>:$TIDE_METRICS_PORT/.
On a signal the worker stops taking requests (health NOT_SERVING), lets running ones finish for
`TIDE_SHUTDOWN_GRACE_S` seconds (default 10), cancels the rest and flushes telemetry and chunks.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from services.inference.app import build
from services.inference.settings import InferenceSettings
from tide.allocator import keep_freed_memory
from tide.logs import configure_logging
from tide.resources import pin_process

log = logging.getLogger("services.inference")


def main() -> int:
    configure_logging(os.environ.get("TIDE_LOG_LEVEL", "INFO"))
    try:
        settings = InferenceSettings.from_env()
        pin_process(settings.cpu_set, 0, f"TIDE_CPUS={settings.cpus!r}")  # before torch starts its threads
    except ValueError as e:
        log.error("bad configuration: %s", e)
        return 2
    keep_freed_memory()  # large CPU tensors every step: see tide.allocator
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port, addr=settings.listen_host)
        log.info("metrics on http://%s:%d/", settings.listen_host, settings.metrics_port)
    t0 = time.monotonic()
    service = build(settings)
    log.info("worker %s serving %s on %s (ready in %.1f s)", settings.worker_id, settings.target, service.target,
             time.monotonic() - t0)
    stop.wait()
    log.info("shutting down")
    service.stop(grace_s=float(os.environ.get("TIDE_SHUTDOWN_GRACE_S", "10")))
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())

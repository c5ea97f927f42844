"""`python -m services.controller`: the controller, until SIGTERM/SIGINT.

Configuration: `TIDE_*` environment variables (see settings.py). JSON log lines on stderr;
Prometheus metrics on http://<listen host>:$TIDE_CONTROLLER_METRICS_PORT/. On a signal: health
NOT_SERVING, in-flight RPCs finish (grace 2 s), the reconcile loop and the telemetry reader stop
(unacked entries stay pending for the next controller), exit 0. Exit 2 on bad configuration.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from services.controller.app import build
from services.controller.metrics import register
from services.controller.settings import ControllerSettings
from tide.logs import configure_logging

log = logging.getLogger("services.controller")


def main() -> int:
    configure_logging(os.environ.get("TIDE_LOG_LEVEL", "INFO"))
    try:
        settings = ControllerSettings.from_env()
    except ValueError as e:
        log.error("bad configuration: %s", e)
        return 2
    if not settings.admin_token:
        log.warning("TIDE_ADMIN_TOKEN is not set: admin calls are refused and workers will refuse our decisions")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        service = build(settings)
    except Exception:
        log.exception("start-up failed")
        return 1
    if settings.metrics_port:
        from prometheus_client import start_http_server

        register(service)
        start_http_server(settings.metrics_port, addr=settings.listen_host)
        log.info("metrics on http://%s:%d/", settings.listen_host, settings.metrics_port)
    stop.wait()
    log.info("shutting down")
    service.stop()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())

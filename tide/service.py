"""The life of a service process, written once: each `python -m services.<name>` calls `run_service`.

    JSON logs on stderr at $TIDE_LOG_LEVEL (default INFO)
    settings = load_settings(); before_start(settings)     a ValueError: "bad configuration", exit 2
    a warning when TIDE_ADMIN_TOKEN is not set and the service says what that costs
    SIGTERM/SIGINT set the stop event (a signal during start-up stops the service once it is up)
    metrics server, when the metrics need no service       (so they are served during start-up)
    service = build(settings)                               any exception: "start-up failed", exit 1
    register_metrics(service), metrics server               when they do
    the stop event; "shutting down"; stop(service); "stopped"; exit 0

Every log line comes from the logger `name`. Start-up helpers the services share live here too
(`wait_for_storage`). The gateway is an ASGI app whose signals and lifetime belong to uvicorn: it
does not go through `run_service`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from minio import Minio

from tide import blobs
from tide.blobs import StorageSettings
from tide.logs import configure_logging

EXIT_OK = 0
EXIT_START_FAILED = 1
EXIT_BAD_CONFIGURATION = 2

log = logging.getLogger(__name__)


class Stoppable(Protocol):
    def stop(self) -> None: ...


S = TypeVar("S")
V = TypeVar("V", bound=Stoppable)


def metrics_on_listen_host(settings: Any) -> tuple[str, int]:
    """(host, port) of the metrics server: `settings.metrics_port` (0 = none) on the host the
    service listens on (`settings.listen_host`)."""
    return settings.listen_host, settings.metrics_port


def run_service(
    name: str,
    load_settings: Callable[[], S],
    build: Callable[[S], V],
    *,
    before_start: Callable[[S], None] | None = None,
    without_admin_token: str | None = None,
    register_metrics: Callable[[V], None] | None = None,
    metrics_address: Callable[[S], tuple[str, int]] = metrics_on_listen_host,
    stop: Callable[[V], None] | None = None,
    signals_during_build: bool = True,
) -> int:
    """Run one service process until SIGTERM/SIGINT; returns the exit status (see the module doc).

    `before_start(settings)` runs before anything starts (no thread yet, so every thread inherits
    what it sets): process placement, allocator tuning; a ValueError it raises is a bad
    configuration too. `without_admin_token` says what an unset TIDE_ADMIN_TOKEN
    (`settings.admin_token`) costs the service: a warning then. `register_metrics(service)` adds
    the service's Prometheus collectors; without it the metrics are module-level and their server
    starts before `build`. `stop(service)` defaults to `service.stop()`. `signals_during_build=False`
    installs the signal handlers only once `build` returned: a signal during start-up then ends
    the process the default way instead of stopping the service once it is up.
    """
    logger = logging.getLogger(name)
    configure_logging(os.environ.get("TIDE_LOG_LEVEL", "INFO"))
    try:
        settings = load_settings()
        if before_start is not None:
            before_start(settings)
    except ValueError as e:
        logger.error("bad configuration: %s", e)
        return EXIT_BAD_CONFIGURATION
    if without_admin_token is not None and not settings.admin_token:
        logger.warning("TIDE_ADMIN_TOKEN is not set: %s", without_admin_token)
    stopping = threading.Event()
    if signals_during_build:
        _stop_on_signals(stopping)
    host, port = metrics_address(settings)
    if port and register_metrics is None:
        _serve_metrics(logger, host, port)
    try:
        service = build(settings)
    except Exception:
        logger.exception("start-up failed")
        return EXIT_START_FAILED
    if port and register_metrics is not None:
        register_metrics(service)
        _serve_metrics(logger, host, port)
    if not signals_during_build:
        _stop_on_signals(stopping)
    stopping.wait()
    logger.info("shutting down")
    if stop is not None:
        stop(service)
    else:
        service.stop()
    logger.info("stopped")
    return EXIT_OK


def _stop_on_signals(stopping: threading.Event) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopping.set())


def _serve_metrics(logger: logging.Logger, host: str, port: int) -> None:
    from prometheus_client import start_http_server

    start_http_server(port, addr=host)
    logger.info("metrics on http://%s:%d/", host, port)


def wait_for_storage(storage: StorageSettings, timeout_s: float = 60.0, *,
                     logger: logging.Logger = log) -> Minio:
    """The S3 client once the bucket exists (created if needed), retrying with backoff (0.2 s,
    doubling, at most 5 s) and a warning per try; raises the last error after `timeout_s`."""
    s3, deadline, delay = storage.s3_client(), time.monotonic() + timeout_s, 0.2
    while True:
        try:
            blobs.ensure_bucket(s3, storage.s3_bucket)
            return s3
        except Exception as e:
            if time.monotonic() > deadline:
                raise
            logger.warning("object storage not ready (%s); retrying", e)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

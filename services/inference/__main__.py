"""`python -m services.inference`: run one inference worker until SIGTERM/SIGINT.

Configuration: `TIDE_*` environment variables (see settings.py). Logs are JSON lines on stderr
(`TIDE_LOG_LEVEL`, default INFO); Prometheus metrics on http://<listen host>:$TIDE_METRICS_PORT/,
served from the start (the metrics are module-level, so they need no built service). On a signal
the worker stops taking requests (health NOT_SERVING), lets running ones finish for
`TIDE_SHUTDOWN_GRACE_S` seconds (default 10), cancels the rest and flushes telemetry and chunks.
Exit 2 on bad configuration. The process's life is `tide.service.run_service`.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from services.inference.app import InferenceService, build_on_engine_thread
from services.inference.settings import InferenceSettings
from tide.allocator import keep_freed_memory
from tide.resources import pin_process
from tide.service import run_service

log = logging.getLogger("services.inference")


def _before_start(settings: InferenceSettings) -> None:
    pin_process(settings.cpu_set, 0, f"TIDE_CPUS={settings.cpus!r}")  # before torch starts its threads
    keep_freed_memory()  # large CPU tensors every step: see tide.allocator


def _build(settings: InferenceSettings) -> InferenceService:
    t0 = time.monotonic()
    service = build_on_engine_thread(settings)  # the model loads on the thread that runs it
    log.info("worker %s serving %s on %s (ready in %.1f s)", settings.worker_id, settings.target, service.target,
             time.monotonic() - t0)
    return service


def _stop(service: InferenceService) -> None:
    service.stop(grace_s=float(os.environ.get("TIDE_SHUTDOWN_GRACE_S", "10")))


def main() -> int:
    return run_service(log.name, InferenceSettings.from_env, _build, before_start=_before_start, stop=_stop)


if __name__ == "__main__":
    sys.exit(main())

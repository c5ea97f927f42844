"""`python -m services.trainer`: the trainer service, until SIGTERM/SIGINT.

Configuration: `TIDE_*` environment variables (see settings.py). JSON log lines on stderr;
Prometheus metrics on http://<listen host>:$TIDE_TRAINER_METRICS_PORT/. Start-up waits for object
storage (the manifest lives there). On a signal: health NOT_SERVING, in-flight RPCs finish, chunk
intake stops (unacked entries stay pending and are reclaimed), exit 0. Exit 2 on bad configuration.
The training library itself runs as `python -m services.trainer.training` (also under torchrun).

Before anything else starts (so every thread inherits it): TIDE_TRAINER_NICE lowers the process's
priority by that increment and TIDE_TRAINER_CPUS pins it to those CPUs with as many torch threads,
so training does not slow inference workers sharing the machine. `tide up` runs the whole stack on
one machine and sets TIDE_TRAINER_NICE=10; on a small machine also give the trainer its own CPUs.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from services.trainer.app import build
from services.trainer.metrics import register
from services.trainer.settings import TrainerSettings
from tide.allocator import keep_freed_memory
from tide.logs import configure_logging
from tide.resources import pin_process

log = logging.getLogger("services.trainer")


def main() -> int:
    configure_logging(os.environ.get("TIDE_LOG_LEVEL", "INFO"))
    try:
        settings = TrainerSettings.from_env()
        pin_process(settings.cpu_set, settings.nice, f"TIDE_TRAINER_CPUS={settings.cpus!r}")
    except ValueError as e:
        log.error("bad configuration: %s", e)
        return 2
    keep_freed_memory()  # large CPU tensors every step: see tide.allocator
    if not settings.admin_token:
        log.warning("TIDE_ADMIN_TOKEN is not set: TriggerTraining is refused")
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

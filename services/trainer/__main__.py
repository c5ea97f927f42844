"""`python -m services.trainer`: the trainer service, until SIGTERM/SIGINT.

Configuration: `TIDE_*` environment variables (see settings.py). JSON log lines on stderr;
Prometheus metrics on http://<listen host>:$TIDE_TRAINER_METRICS_PORT/. Start-up waits for object
storage (the manifest lives there). On a signal: health NOT_SERVING, in-flight RPCs finish, chunk
intake stops (unacked entries stay pending and are reclaimed), exit 0. Exit 2 on bad configuration.
The process's life (logs, signals, metrics server, exit statuses) is `tide.service.run_service`.
The training library itself runs as `python -m services.trainer.training` (also under torchrun).

Before anything else starts (so every thread inherits it): TIDE_TRAINER_NICE lowers the process's
priority by that increment and TIDE_TRAINER_CPUS pins it to those CPUs with as many torch threads,
so training does not slow inference workers sharing the machine. `tide up` runs the whole stack on
one machine and sets TIDE_TRAINER_NICE=10; on a small machine also give the trainer its own CPUs.
"""

from __future__ import annotations

import logging
import os

from services.trainer.app import build
from services.trainer.metrics import register
from services.trainer.settings import TrainerSettings
from tide.allocator import keep_freed_memory
from tide.resources import pin_process
from tide.service import run_service


def _before_start(settings: TrainerSettings) -> None:
    pin_process(settings.cpu_set, settings.nice, f"TIDE_TRAINER_CPUS={settings.cpus!r}")  # ValueError: exit 2
    keep_freed_memory()  # large CPU tensors every step: see tide.allocator


def main() -> int:
    return run_service("services.trainer", TrainerSettings.from_env, build, before_start=_before_start,
                       without_admin_token="TriggerTraining is refused", register_metrics=register)


if __name__ == "__main__":
    code = main()
    # A run in progress when the signal came is abandoned (TrainerService.stop) and its thread is
    # still inside torch: finalising the interpreter under it aborts ("terminate called without an
    # active exception", exit -6), which whoever stopped the trainer reads as a crash. The service
    # has stopped and saved what it keeps; only the log handlers are left to flush.
    logging.shutdown()
    os._exit(code)

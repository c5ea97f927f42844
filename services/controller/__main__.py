"""`python -m services.controller`: the controller, until SIGTERM/SIGINT.

Configuration: `TIDE_*` environment variables (see settings.py). JSON log lines on stderr;
Prometheus metrics on http://<listen host>:$TIDE_CONTROLLER_METRICS_PORT/. On a signal: health
NOT_SERVING, in-flight RPCs finish (grace 2 s), the reconcile loop and the telemetry reader stop
(unacked entries stay pending for the next controller), exit 0. Exit 2 on bad configuration.
The process's life (logs, signals, metrics server, exit statuses) is `tide.service.run_service`.
"""

from __future__ import annotations

import sys

from services.controller.app import build
from services.controller.metrics import register
from services.controller.settings import ControllerSettings
from tide.service import run_service


def main() -> int:
    return run_service("services.controller", ControllerSettings.from_env, build, register_metrics=register,
                       without_admin_token="admin calls are refused and workers will refuse our decisions")


if __name__ == "__main__":
    sys.exit(main())

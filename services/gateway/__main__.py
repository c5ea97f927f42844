"""`python -m services.gateway`: the OpenAI-compatible gateway on $TIDE_GATEWAY_HOST:$TIDE_GATEWAY_PORT
(127.0.0.1:8000), routing to the workers in $TIDE_WORKERS. See settings.py for every variable.

Unlike the other services this does not go through `tide.service.run_service`: the gateway is an
ASGI app, and uvicorn owns its signals (graceful shutdown), its lifetime and its access logs. Exit 2
on bad configuration (said on stderr before logging is set up), 0 once uvicorn has stopped."""

from __future__ import annotations

import logging
import sys

import uvicorn

from services.gateway.app import create_app
from services.gateway.engine_client import GrpcEngineClient
from services.gateway.settings import GatewaySettings
from tide.logs import configure_logging

log = logging.getLogger("services.gateway")


def main() -> int:
    try:
        settings = GatewaySettings.from_env()
    except ValueError as err:
        print(f"tide gateway: bad configuration: {err}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, reroute=("uvicorn", "uvicorn.error", "uvicorn.access"))
    engine = GrpcEngineClient.from_addresses(settings.workers, settings.poll_interval_s, settings.status_timeout_s,
                                             settings.worker_wait_s)
    app = create_app(settings, engine)
    uvicorn.run(
        app, host=settings.host, port=settings.port, log_config=None, access_log=False, timeout_graceful_shutdown=10
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The FastAPI application: `create_app(settings, engine_client)`.

Wires the serving classes, the routes, OpenAI-format error handlers for everything that can go
wrong (our own errors, unknown routes and methods; MetricsMiddleware turns any unexpected exception
into a logged traceback and a bare 500 body), the metrics/access-log middleware, and the
engine client's start/close around the app's lifetime.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.engine_client import EngineClient
from services.gateway.errors import OpenAIError, http_error, invalid_request
from services.gateway.metrics import GatewayMetrics, MetricsMiddleware, endpoint_label
from services.gateway.router import router
from services.gateway.serving_chat import OpenAIServingChat
from services.gateway.serving_completion import OpenAIServingCompletion
from services.gateway.serving_models import OpenAIServingModels
from services.gateway.settings import GatewaySettings
from services.gateway.status import StatusSources
from services.gateway.tokenizer import TargetTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayState:
    """Everything a route needs, built once per app."""

    settings: GatewaySettings
    engine: EngineClient
    tokenizer: TargetTokenizer
    models: OpenAIServingModels
    chat: OpenAIServingChat
    completion: OpenAIServingCompletion
    metrics: GatewayMetrics
    status: StatusSources


def create_app(
    settings: GatewaySettings, engine_client: EngineClient, tokenizer: TargetTokenizer | None = None
) -> FastAPI:
    """The gateway app. `tokenizer` defaults to the one of `settings.target`."""
    if tokenizer is None:
        tokenizer = TargetTokenizer.load(settings.target, settings.max_model_len)
    max_len = settings.max_model_len or tokenizer.max_model_len
    models = OpenAIServingModels(settings.served_model_name or tokenizer.model_id, tokenizer.model_id, max_len)
    metrics = GatewayMetrics()
    state = GatewayState(
        settings=settings,
        engine=engine_client,
        tokenizer=tokenizer,
        models=models,
        chat=OpenAIServingChat(engine_client, models, tokenizer, settings.max_n, metrics),
        completion=OpenAIServingCompletion(engine_client, models, tokenizer, settings.max_n, metrics),
        metrics=metrics,
        status=StatusSources(
            services={"registry": settings.registry_addr, "trainer": settings.trainer_addr,
                      "controller": settings.controller_addr},
            stack_state=Path(settings.stack_state) if settings.stack_state else None),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine_client.start()
        log.info(
            "gateway started",
            extra={
                "model": models.name,
                "workers": list(settings.workers),
                "auth": settings.auth_enabled,
                "max_model_len": max_len,
            },
        )
        try:
            yield
        finally:
            await engine_client.close()

    app = FastAPI(title="TIDE gateway", summary="OpenAI-compatible API of TIDE", lifespan=lifespan)
    app.state.gateway = state
    app.include_router(router)

    def error_response(request: Request, err: OpenAIError) -> JSONResponse:
        metrics.error(endpoint_label(request.url.path), err)
        if err.status >= 500:
            log.warning("request failed", extra={"path": request.url.path, "status": err.status, "reason": err.message})
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(OpenAIError)
    async def on_openai_error(request: Request, err: OpenAIError):
        return error_response(request, err)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, err: StarletteHTTPException):
        detail = f"Invalid URL ({request.method} {request.url.path})" if err.status_code in (404, 405) else None
        return error_response(request, http_error(err.status_code, detail))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, err: RequestValidationError):
        first = (err.errors() or [{}])[0]
        param = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "path", "query")) or None
        return error_response(request, invalid_request(str(first.get("msg", "Invalid request.")), param))

    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app

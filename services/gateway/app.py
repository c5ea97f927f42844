"""The FastAPI application: `create_app(settings, engine_client)`.

Wires the serving classes, the routes, OpenAI-format error handlers for everything that can go
wrong (our own errors, unknown routes and methods; MetricsMiddleware turns any unexpected exception
into a logged traceback and a bare 500 body), the metrics/access-log middleware, and the
engine client's start/close around the app's lifetime, and CORS when TIDE_CORS_ORIGINS names origins.

The served context is the workers' real limit (`WorkerLimitedModels`), the configured one an upper
bound. /openapi.json documents the request bodies the routes parse themselves (router.BODIES), with
their bounds, the served model as the only valid `model`, and the error body of every failure.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway import dashboard
from services.gateway.engine_client import EngineClient
from services.gateway.errors import OpenAIError, http_error, invalid_request
from services.gateway.metrics import GatewayMetrics, MetricsMiddleware, endpoint_label
from services.gateway.protocol import ErrorResponse
from services.gateway.protocol_messages import AnthropicErrorResponse
from services.gateway.response_store import ResponseStore
from services.gateway.router import BODIES, router
from services.gateway.serving_chat import OpenAIServingChat
from services.gateway.serving_completion import OpenAIServingCompletion
from services.gateway.serving_messages import AnthropicServingMessages, anthropic_error_body
from services.gateway.serving_models import OpenAIServingModels
from services.gateway.serving_responses import OpenAIServingResponses
from services.gateway.serving_tokenization import OpenAIServingTokenization
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
    tokenization: OpenAIServingTokenization
    responses: OpenAIServingResponses
    messages: AnthropicServingMessages
    metrics: GatewayMetrics
    status: StatusSources
    body_limit: int  # the largest accepted request body, in bytes


class WorkerLimitedModels(OpenAIServingModels):
    """The served model, whose context (`max_model_len`) is the smallest one the healthy workers
    report, at most the configured one (which is all there is until a worker has answered)."""

    def __init__(self, name: str, root: str, max_model_len: int, engine: EngineClient,
                 aliases: tuple[str, ...] = ()) -> None:
        self.engine = engine
        super().__init__(name, root, max_model_len, aliases)

    @property
    def max_model_len(self) -> int:
        workers = self.engine.max_model_len()
        return self.configured_max_model_len if workers is None else min(workers, self.configured_max_model_len)

    @max_model_len.setter
    def max_model_len(self, value: int) -> None:
        self.configured_max_model_len = value


APP_INFO = {"title": "TIDE gateway", "summary": "OpenAI-compatible API of TIDE"}


def gateway_openapi(model_name: str | tuple[str, ...], max_n: int) -> dict:
    """The /openapi.json of a gateway serving `model_name` with at most `max_n` choices, without a gateway
    (the fuzz test loads it at collection time and checks that a running gateway serves the same)."""
    app = FastAPI(**APP_INFO)
    app.include_router(router)
    return openapi_schema(app, model_name, max_n)


def openapi_schema(app: FastAPI, model_name: str | tuple[str, ...], max_n: int) -> dict:
    """FastAPI's schema plus the request bodies the routes parse themselves (with this gateway's model
    name, or names with aliases, and largest `n`) and the error body."""
    schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})

    def ref(model, mode: str = "validation") -> dict:
        js = model.model_json_schema(ref_template="#/components/schemas/{model}", mode=mode)
        components.update(js.pop("$defs", {}))
        components[model.__name__] = js
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    openai_error = {"description": "An OpenAI error",
                    "content": {"application/json": {"schema": ref(ErrorResponse)}}}
    anthropic_error = {"description": "An Anthropic error",
                       "content": {"application/json": {"schema": ref(AnthropicErrorResponse)}}}

    def error_of(path: str) -> dict:  # every failure has its API's body (FastAPI's 422 never happens)
        return anthropic_error if path.startswith("/v1/messages") else openai_error

    for path, operations in schema["paths"].items():
        for operation in operations.values():
            operation["responses"].pop("422", None)
            operation["responses"]["default"] = error_of(path)
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, (request_model, response_model) in BODIES.items():
        operation = schema["paths"][path]["post"]
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(request_model)}}}
        properties = components[request_model.__name__]["properties"]
        properties["model"]["enum"] = [model_name] if isinstance(model_name, str) else list(model_name)
        if "n" in properties:
            next(p for p in properties["n"]["anyOf"] if p.get("type") == "integer")["maximum"] = max_n
        ok = {"description": "The answer", "content": {"application/json": {"schema": ref(response_model,
                                                                                          "serialization")}}}
        if "stream" in properties:  # the completion endpoints
            ok["description"] = "The completion, or with `stream: true` its server-sent events"
            ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
        error = error_of(path)
        operation["responses"] = {
            "200": ok,
            **{status: error for status in ("400", "401", "404", "413", "502", "503")},
            "default": error,
        }
    return schema


def create_app(
    settings: GatewaySettings, engine_client: EngineClient, tokenizer: TargetTokenizer | None = None
) -> FastAPI:
    """The gateway app. `tokenizer` defaults to the one of `settings.target`."""
    if tokenizer is None:
        tokenizer = TargetTokenizer.load(settings.target, settings.max_model_len)
    max_len = settings.max_model_len or tokenizer.max_model_len  # the upper bound of the served context
    name = settings.served_model_name or tokenizer.model_id
    aliases = tuple(sorted(settings.model_aliases))
    models = WorkerLimitedModels(name, tokenizer.model_id, max_len, engine_client, aliases)
    metrics = GatewayMetrics()
    serving = dict(metrics=metrics, tokenize_timeout_s=settings.tokenize_timeout_s)

    def chat_for(endpoint: str) -> OpenAIServingChat:  # (counted in the metrics under `endpoint`)
        return OpenAIServingChat(engine_client, models, tokenizer, settings.max_n, endpoint=endpoint, **serving)

    store = ResponseStore(settings.responses_store_mb << 20, settings.responses_ttl_s)
    state = GatewayState(
        settings=settings,
        engine=engine_client,
        tokenizer=tokenizer,
        models=models,
        chat=chat_for("/v1/chat/completions"),
        completion=OpenAIServingCompletion(engine_client, models, tokenizer, settings.max_n, **serving),
        tokenization=OpenAIServingTokenization(models, tokenizer, settings.tokenize_timeout_s),
        responses=OpenAIServingResponses(chat_for("/v1/responses"), store),
        messages=AnthropicServingMessages(chat_for("/v1/messages")),
        metrics=metrics,
        status=StatusSources(
            services={"registry": settings.registry_addr, "trainer": settings.trainer_addr,
                      "controller": settings.controller_addr},
            stack_state=Path(settings.stack_state) if settings.stack_state else None),
        body_limit=settings.body_limit(max_len),
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
                "max_token_bytes": tokenizer.max_token_bytes,
                "max_body_bytes": state.body_limit,
            },
        )
        try:
            yield
        finally:
            await engine_client.close()

    app = FastAPI(**APP_INFO, lifespan=lifespan)
    app.state.gateway = state
    app.include_router(router)
    app.include_router(dashboard.router)  # GET /dashboard, /v1/status/history and the status sampler

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_schema(app, models.names if models.aliases else models.name, settings.max_n)
        return app.openapi_schema

    app.openapi = openapi

    def error_response(request: Request, err: OpenAIError) -> JSONResponse:
        metrics.error(endpoint_label(request.url.path), err)
        if err.status >= 500:
            log.warning("request failed", extra={"path": request.url.path, "status": err.status, "reason": err.message})
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        anthropic = request.url.path.startswith("/v1/messages")  # Anthropic's clients read Anthropic's shape
        body = anthropic_error_body(err) if anthropic else err.body()
        return JSONResponse(body, status_code=err.status, headers=headers)

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
    if settings.cors_origins:  # outermost: a preflight is answered before auth, metrics or routing
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            max_age=600,
        )
    return app

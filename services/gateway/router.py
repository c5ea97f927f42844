"""HTTP routes: thin wrappers that parse, authenticate and hand over to the serving classes.

Bodies are parsed here rather than by FastAPI so that every failure has OpenAI's shape and a
precise message: too large (413, from the Content-Length alone when it says so, else as the body
arrives), not JSON, too deep, not valid Unicode or not an object (400; protocol.decode_json_body),
schema errors (400 naming the parameter). A body larger than INLINE_BODY_BYTES is decoded and
validated on a worker thread, so a big one does not hold the event loop. Non-streaming handlers
race the client's disconnect: when the client goes away the handler is cancelled, which cancels
its generations upstream (streams get the same from Starlette, which cancels the response
iterator on disconnect).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import asdict
from typing import Literal, TypeVar

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from services.gateway.errors import (
    OpenAIError,
    from_validation_error,
    invalid_api_key,
    service_unavailable,
)
from services.gateway.governance import TRAINING_HEADER, Eligibility, decide
from services.gateway.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    decode_json_body,
)
from services.gateway.protocol_messages import CountTokensRequest, CountTokensResponse, MessageResponse, MessagesRequest
from services.gateway.protocol_responses import ResponseObject, ResponsesRequest
from services.gateway.serving_engine import build_version
from services.gateway.status import stack_status, supervisor_view

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger(__name__)
INLINE_BODY_BYTES = 64 * 1024  # larger bodies are decoded on a worker thread
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first" (logs and metrics only)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


def gateway(request: Request):
    """The app's `GatewayState` (see app.py)."""
    return request.app.state.gateway


async def require_api_key(request: Request) -> None:
    """`Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's) must name a
    configured key (no keys configured = open)."""
    settings = gateway(request).settings
    keys = settings.api_keys | settings.api_keys_no_train
    if not keys:
        return
    header = request.headers.get("authorization", "")
    token = request_key(request)
    if not token:
        raise invalid_api_key(provided=bool(header))
    if not any(hmac.compare_digest(token.encode(), key.encode()) for key in keys):
        raise invalid_api_key(provided=True)


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"The request body is larger than {limit} bytes.", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most `limit` bytes: refused from its Content-Length before reading when that says more."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise too_large(limit)
    return bytes(body)


def decode_body(raw: bytes, model: type[M]) -> M:
    data = decode_json_body(raw)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise from_validation_error(err) from None


async def parse_body(request: Request, model: type[M]) -> M:
    raw = await read_body(request, gateway(request).body_limit)
    if len(raw) <= INLINE_BODY_BYTES:
        return decode_body(raw, model)
    return await asyncio.to_thread(decode_body, raw, model)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, coro):
    """Run `coro`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # the client left, or this handler itself was cancelled: stop the work
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    try:
        await task  # let its cleanup (the upstream cancel) run
    except (asyncio.CancelledError, Exception) as err:
        log.debug("request cancelled after the client left", extra={"outcome": type(err).__name__})
    raise ClientDisconnected


def respond(result, caller: Eligibility | None = None) -> Response:
    """The JSON body or the SSE stream; `caller`'s training decision in the X-TIDE-Training header."""
    headers = {TRAINING_HEADER: caller.header()} if caller is not None else {}
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump(), headers=headers)
    return StreamingResponse(result, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})


def request_key(request: Request) -> str:
    """The API key the request was sent with: its Bearer token, else its x-api-key ("" for none)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ""
    return token or request.headers.get("x-api-key", "").strip()


def caller_of(request: Request, body) -> Eligibility:
    """Whether `body` (a chat or completion request) may be trained on (services/gateway/governance.py);
    counted for /v1/status (`opt_out`)."""
    state = gateway(request)
    caller = decide(state.settings, body, request_key(request))
    state.status.training_decisions[caller.reason or "eligible"] += 1
    return caller


def deciding(request: Request):
    """`caller_of` for the APIs served as chat requests: decided on the chat request each becomes."""
    return lambda chat: caller_of(request, chat)


router = APIRouter()
# The bodies the POST routes parse themselves (parse_body), for /openapi.json: path -> (request, response).
BODIES = {
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse),
    "/v1/completions": (CompletionRequest, CompletionResponse),
    "/v1/responses": (ResponsesRequest, ResponseObject),
    "/v1/messages": (MessagesRequest, MessageResponse),
    "/v1/messages/count_tokens": (CountTokensRequest, CountTokensResponse),
    "/tokenize": (TokenizeRequest, TokenizeResponse),
    "/detokenize": (DetokenizeRequest, DetokenizeResponse),
}


@router.post("/v1/chat/completions", dependencies=[Depends(require_api_key)])
async def create_chat_completion(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    caller = caller_of(request, body)
    try:
        return respond(await until_disconnect(request, gateway(request).chat.create_chat_completion(body, caller)),
                       caller)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)


@router.post("/v1/completions", dependencies=[Depends(require_api_key)])
async def create_completion(request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    caller = caller_of(request, body)
    try:
        return respond(await until_disconnect(request, gateway(request).completion.create_completion(body, caller)),
                       caller)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)


@router.post("/v1/responses", dependencies=[Depends(require_api_key)])
async def create_response(request: Request) -> Response:
    """OpenAI's Responses API (serving_responses)."""
    body = await parse_body(request, ResponsesRequest)
    try:
        return respond(*await until_disconnect(request, gateway(request).responses.create(body, deciding(request))))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)


@router.get("/v1/responses/{response_id}", dependencies=[Depends(require_api_key)])
async def retrieve_response(request: Request, response_id: str) -> Response:
    """A stored response (`store` was true, and it has not expired or been evicted)."""
    return JSONResponse(gateway(request).responses.retrieve(response_id))


@router.get("/v1/responses/{response_id}/input_items", dependencies=[Depends(require_api_key)])
async def list_input_items(request: Request, response_id: str, limit: int = Query(20, ge=1, le=100),
                           order: Literal["asc", "desc"] = "desc", after: str | None = None) -> Response:
    """The input items of a stored response, newest first unless `order=asc` (OpenAI's list page)."""
    return JSONResponse(gateway(request).responses.input_items(response_id, limit, order, after))


@router.delete("/v1/responses/{response_id}", dependencies=[Depends(require_api_key)])
async def delete_response(request: Request, response_id: str) -> Response:
    return JSONResponse(gateway(request).responses.delete(response_id).model_dump())


@router.post("/v1/messages", dependencies=[Depends(require_api_key)])
async def create_message(request: Request) -> Response:
    """Anthropic's Messages API (serving_messages); its errors have Anthropic's shape (see app.py)."""
    body = await parse_body(request, MessagesRequest)
    try:
        return respond(*await until_disconnect(request, gateway(request).messages.create(body, deciding(request))))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)


@router.post("/v1/messages/count_tokens", dependencies=[Depends(require_api_key)])
async def count_message_tokens(request: Request) -> Response:
    body = await parse_body(request, CountTokensRequest)
    return JSONResponse((await gateway(request).messages.count_tokens(body)).model_dump())


@router.post("/tokenize", dependencies=[Depends(require_api_key)])
async def tokenize(request: Request) -> Response:
    """vLLM's: a prompt's or a chat's token ids as the completion endpoints would feed them."""
    body = await parse_body(request, TokenizeRequest)
    return JSONResponse((await gateway(request).tokenization.tokenize(body)).model_dump())


@router.post("/detokenize", dependencies=[Depends(require_api_key)])
async def detokenize(request: Request) -> Response:
    """vLLM's: the text of token ids."""
    body = await parse_body(request, DetokenizeRequest)
    return JSONResponse((await gateway(request).tokenization.detokenize(body)).model_dump())


@router.get("/version")
async def version() -> Response:
    """vLLM's: the serving software's version (TIDE's build)."""
    return JSONResponse(VersionResponse(version=build_version()).model_dump())


@router.get("/v1/models", dependencies=[Depends(require_api_key)])
async def list_models(request: Request) -> Response:
    return JSONResponse(gateway(request).models.list_models().model_dump())


@router.get("/v1/models/{model:path}", dependencies=[Depends(require_api_key)])
async def retrieve_model(request: Request, model: str) -> Response:
    return JSONResponse(gateway(request).models.retrieve(model).model_dump())


@router.get("/health")
async def health() -> Response:
    """Liveness: the gateway process answers."""
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> Response:
    """Readiness: 200 once at least one worker answered its last status poll, else 503. Under
    `tide up`, `degraded` names the processes not ready (being restarted), serving or not."""
    state = gateway(request)
    if not state.engine.is_ready():
        raise service_unavailable("No healthy inference worker is available.")
    workers = [asdict(w) for w in state.engine.workers()]
    down = sorted(n for n, s in supervisor_view(state.status.stack_state).items() if s.get("state") != "ready")
    return JSONResponse({"status": "degraded" if down else "ready", "model": state.models.name, "workers": workers,
                         "degraded": down})


@router.get("/v1/status")
async def status(request: Request) -> Response:
    """Every part of the stack: health, supervisor state and restarts (services.gateway.status).
    200 whether or not the stack is degraded: the document says which parts are not ready."""
    state = gateway(request)
    return JSONResponse(await stack_status(state.status, state.engine))


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = gateway(request)
    return Response(state.metrics.render(state.engine.workers()), media_type=CONTENT_TYPE_LATEST)

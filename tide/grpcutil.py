"""gRPC plumbing every TIDE service shares: server builder, admin auth, client channels.

Server side, `GrpcServer` gives each service the same behaviour:
- binds 127.0.0.1 unless told otherwise (compose passes 0.0.0.0 explicitly);
- gRPC health checking (`grpc.health.v1.Health`: "" and each added service, SERVING once started,
  NOT_SERVING during shutdown) and server reflection (grpcurl / grpc_cli work without .proto files);
- bearer-token auth for admin methods. Which methods are admin is declared in the API itself,
  with the `(tide.v1.admin) = true` method option (protos/tide/v1/common.proto), so a new admin RPC
  is protected without touching any server. A call without a valid `authorization: Bearer <token>`
  metadata entry fails with UNAUTHENTICATED and a message saying what is missing; a server with
  no token configured refuses all admin calls (secure default), other methods need no token.

Client side, `channel()` / `aio_channel()` open an insecure channel (loopback or a private compose
network) that adds the bearer token, and optionally an actor name, to every call's metadata.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tide.proto.tide.v1 import common_pb2

ADMIN_TOKEN_ENV = "TIDE_ADMIN_TOKEN"
AUTH_HEADER = "authorization"  # gRPC metadata keys are lowercase
ACTOR_HEADER = "x-tide-actor"  # who is calling (recorded in audit trails such as pointer history)
DEFAULT_HOST = "127.0.0.1"
# Draft checkpoints travel through object storage, not gRPC; 64 MiB leaves room for large
# status/state messages without inviting blobs over RPC.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
KEEPALIVE_MS = 30_000  # clients ping a connection with open calls this often (and servers their clients)


def _channel_options() -> list[tuple[str, int]]:
    # Keep long-lived streams (Generate, WatchTarget) alive through idle periods, and notice a dead
    # peer within keepalive + 10 s.
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]


def _server_options() -> list[tuple[str, int]]:
    # By default a gRPC server accepts a ping on a connection it sends no data on at most every
    # 5 minutes, and answers the third early one with GOAWAY "too_many_pings", which ends every
    # stream on the connection: a worker's idle WatchTarget stream to the registry was cut that way
    # 3 minutes into a bench run. Accept our own clients' pings (at half their interval: timer jitter).
    return [*_channel_options(), ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2)]


def admin_token_from_env() -> str | None:
    """The admin bearer token from `$TIDE_ADMIN_TOKEN` (None when unset or empty)."""
    return os.environ.get(ADMIN_TOKEN_ENV) or None


def service_descriptor(service: ServiceDescriptor | str) -> ServiceDescriptor:
    """A service descriptor, or look one up by full name ("tide.v1.InferenceService").

    Lookup by name needs the generated `*_pb2` module imported (importing `*_pb2_grpc` does it).
    """
    if isinstance(service, ServiceDescriptor):
        return service
    return descriptor_pool.Default().FindServiceByName(service)


def admin_methods(service: ServiceDescriptor | str) -> frozenset[str]:
    """Full method paths ("/tide.v1.RegistryService/Promote") marked `(tide.v1.admin) = true`."""
    desc = service_descriptor(service)
    return frozenset(f"/{desc.full_name}/{m.name}" for m in desc.methods if m.GetOptions().Extensions[common_pb2.admin])


def check_bearer(metadata: Iterable[tuple[str, Any]] | None, token: str | None, method: str) -> str | None:
    """None if `metadata` carries the right bearer token, else the reason for UNAUTHENTICATED."""
    if not token:
        return f"{method} is an admin method and this server has no admin token (set {ADMIN_TOKEN_ENV})"
    values = [v for k, v in (metadata or ()) if k == AUTH_HEADER]
    if not values:
        return f"{method} is an admin method: send metadata '{AUTH_HEADER}: Bearer <token>'"
    scheme, _, presented = str(values[0]).partition(" ")
    if scheme.lower() != "bearer" or not presented:
        return f"malformed {AUTH_HEADER} metadata for {method}: expected 'Bearer <token>'"
    if not hmac.compare_digest(presented.strip().encode(), token.encode()):
        return f"invalid bearer token for {method}"
    return None


def actor_of(context: grpc.ServicerContext, default: str = "anonymous") -> str:
    """The caller's self-declared actor name (`x-tide-actor` metadata), for audit records."""
    for key, value in context.invocation_metadata() or ():
        if key == ACTOR_HEADER and value:
            return str(value)[:200]
    return default


def _denying_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape (unary/stream) as `handler` that aborts with UNAUTHENTICATED."""

    def deny(request_or_iterator, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)


class BearerAuthInterceptor(grpc.ServerInterceptor):
    """Requires the bearer token for methods in `protected` (full paths); others pass through."""

    def __init__(self, token: str | None, protected: Iterable[str] = ()):
        self.token = token
        self.protected: set[str] = set(protected)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self.protected:
            return handler
        reason = check_bearer(handler_call_details.invocation_metadata, self.token, method)
        return handler if reason is None else _denying_handler(handler, reason)


class GrpcServer:
    """A threaded gRPC server with health, reflection and admin auth. Typical use::

        server = GrpcServer(admin_token=admin_token_from_env())
        server.add_service(inference_pb2_grpc.add_InferenceServiceServicer_to_server, servicer,
                           "tide.v1.InferenceService")
        port = server.start()          # or `with server: ...`
        ...
        server.stop(grace_s=5)

    `address` is "host:port"; port 0 picks a free one (read it from `start()` or `.port`).
    `max_workers` bounds concurrent RPCs: each open server stream holds one thread.
    """

    def __init__(
        self,
        address: str = f"{DEFAULT_HOST}:0",
        *,
        admin_token: str | None = None,
        max_workers: int = 32,
        extra_protected: Iterable[str] = (),
        interceptors: Sequence[grpc.ServerInterceptor] = (),
    ):
        from concurrent.futures import ThreadPoolExecutor

        self.address = address
        self.auth = BearerAuthInterceptor(admin_token, extra_protected)
        self.server = grpc.server(
            ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
            interceptors=[self.auth, *interceptors],
            options=_server_options(),
        )
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names: list[str] = []
        self.port: int | None = None

    def add_service(
        self,
        add_fn: Callable[[Any, grpc.Server], None],
        servicer: Any,
        service: ServiceDescriptor | str,
    ) -> GrpcServer:
        """Register `servicer` with its generated `add_*Servicer_to_server` function; its admin
        methods become protected. Call before `start()`."""
        if self.port is not None:
            raise RuntimeError("add_service() after start()")
        desc = service_descriptor(service)
        add_fn(servicer, self.server)
        self.auth.protected |= admin_methods(desc)
        self.service_names.append(desc.full_name)
        return self

    def start(self) -> int:
        """Bind, start serving, mark every service SERVING; returns the bound port."""
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        port = self.server.add_insecure_port(self.address)
        if port == 0:
            raise RuntimeError(f"could not bind gRPC server to {self.address}")
        self.port = port
        self.server.start()
        for name in ("", *self.service_names):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return port

    @property
    def target(self) -> str:
        """What a client dials: "host:port" with the bound port."""
        host = self.address.rsplit(":", 1)[0]
        return f"{DEFAULT_HOST if host in ('0.0.0.0', '[::]', '') else host}:{self.port}"

    def set_serving(self, service: str, serving: bool) -> None:
        """Report a service (or "" for the whole server) as (not) serving, e.g. while draining."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set(service, status)

    def stop(self, grace_s: float | None = 2.0) -> None:
        """Mark everything NOT_SERVING, refuse new RPCs, give running ones `grace_s` seconds."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self.server.wait_for_termination(timeout_s)

    def __enter__(self) -> GrpcServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------------------------ clients


def call_metadata(token: str | None = None, actor: str | None = None) -> tuple[tuple[str, str], ...]:
    """Metadata to send with a call: the bearer token and/or actor, when given."""
    md: list[tuple[str, str]] = []
    if token:
        md.append((AUTH_HEADER, f"Bearer {token}"))
    if actor:
        md.append((ACTOR_HEADER, actor))
    return tuple(md)


class _Details(grpc.ClientCallDetails):
    """`base` with `extra` appended to its metadata (call details are immutable)."""

    def __init__(self, base, extra):
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = [*(base.metadata or ()), *extra]
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


class _MetadataInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self.metadata = metadata

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_Details(details, self.metadata), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(_Details(details, self.metadata), request_iterator)

    intercept_stream_stream = intercept_stream_unary


def channel(target: str, *, token: str | None = None, actor: str | None = None) -> grpc.Channel:
    """An insecure channel to `target` ("host:port") sending the token/actor on every call."""
    ch = grpc.insecure_channel(target, options=_channel_options())
    md = call_metadata(token, actor)
    return grpc.intercept_channel(ch, _MetadataInterceptor(md)) if md else ch


def wait_ready(ch: grpc.Channel, timeout_s: float = 10.0) -> None:
    """Block until the channel connects; raises grpc.FutureTimeoutError after `timeout_s`."""
    grpc.channel_ready_future(ch).result(timeout=timeout_s)


class _AioMetadataInterceptor(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self.metadata = metadata

    def _details(self, details):
        md = grpc.aio.Metadata(*(details.metadata or ()), *self.metadata)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, md, details.credentials, details.wait_for_ready
        )

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def aio_channel(target: str, *, token: str | None = None, actor: str | None = None) -> grpc.aio.Channel:
    """asyncio variant of `channel()` (for the FastAPI gateway). Create it inside the event loop."""
    md = call_metadata(token, actor)
    interceptors = [_AioMetadataInterceptor(md)] if md else None
    return grpc.aio.insecure_channel(target, options=_channel_options(), interceptors=interceptors)

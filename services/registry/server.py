"""`tide.v1.RegistryService` over the domain store: protobuf <-> domain, errors -> status codes.

Status codes: a malformed request or checkpoint, a checksum mismatch or a version of another
target -> INVALID_ARGUMENT; an unknown version -> NOT_FOUND; rollback with nothing to roll back to,
or a stale `expected_current` -> FAILED_PRECONDITION; a pointer write that kept losing races ->
ABORTED (retry); object storage unreachable -> UNAVAILABLE; anything else -> INTERNAL (details
only in the log). Admin methods (declared in the proto) need the bearer token: `tide.grpcutil`
rejects calls without it with UNAUTHENTICATED before they reach this code.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time

import grpc
import urllib3.exceptions
from minio.error import MinioException
from prometheus_client import Counter, Gauge, Histogram

from services.registry import model as m
from services.registry.model import Artifact, DraftManifest, FileEntry, PointerState
from services.registry.store import RegistryStore
from services.registry.watch import WatchHub
from tide import grpcutil
from tide.blobs import PointerConflict
from tide.proto.tide.v1 import common_pb2, registry_pb2
from tide.proto.tide.v1 import registry_pb2_grpc as registry_grpc

SERVICE = "tide.v1.RegistryService"
log = logging.getLogger("tide.registry.server")

RPCS = Counter("tide_registry_rpcs", "Registry RPCs by method and status code", ["method", "code"])
RPC_SECONDS = Histogram("tide_registry_rpc_seconds", "Registry unary RPC latency", ["method"])
WATCHERS = Gauge("tide_registry_watch_streams", "Open WatchTarget streams")
POINTER_CHANGES = Counter("tide_registry_pointer_changes", "Pointer changes made through this server", ["action"])

_CODES = [
    (m.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (m.NotFound, grpc.StatusCode.NOT_FOUND),
    (m.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (PointerConflict, grpc.StatusCode.ABORTED),
    ((MinioException, urllib3.exceptions.HTTPError, ConnectionError), grpc.StatusCode.UNAVAILABLE),
]
_ACTIONS = {
    "promote": registry_pb2.POINTER_ACTION_PROMOTE,
    "pin": registry_pb2.POINTER_ACTION_PIN,
    "unpin": registry_pb2.POINTER_ACTION_UNPIN,
    "rollback": registry_pb2.POINTER_ACTION_ROLLBACK,
}


def _status(e: Exception) -> tuple[grpc.StatusCode, str]:
    for types, code in _CODES:
        if isinstance(e, types):
            if code is grpc.StatusCode.UNAVAILABLE:
                return code, f"object storage unavailable: {type(e).__name__}: {e}"
            return code, str(e)
    log.exception("internal error")
    return grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__}); see the registry log"


# Every string a request carries (names, versions, reasons, file names) is bounded before any code
# looks at it: names are at most 128 characters (model.check_target) and versions a few more, so
# 4 KiB only lets free text (reasons) through and refuses megabyte fields before they are logged.
MAX_STRING_CHARS = 4096


def _check_sizes(message, path: str = "") -> None:
    """InvalidArgument naming the first string field of `message` (nested, repeated, map keys and
    values) over the bound."""
    for field, value in message.ListFields():
        name = f"{path}{field.name}"
        if not field.is_repeated:
            items = [value]
        elif hasattr(value, "items"):  # map<...>: keys and values
            items = [x for kv in value.items() for x in kv]
        else:
            items = list(value)
        for v in items:
            if isinstance(v, str) and len(v) > MAX_STRING_CHARS:
                raise m.InvalidArgument(f"{name} is {len(v)} characters; at most {MAX_STRING_CHARS}")
            if hasattr(v, "ListFields"):
                _check_sizes(v, f"{name}.")


def _rpc(fn):
    """Map domain errors to status codes and record metrics, for unary and server-streaming methods;
    requests with oversized strings are refused first (INVALID_ARGUMENT)."""
    name = fn.__name__
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def stream(self, request, context):
            code = grpc.StatusCode.OK
            try:
                _check_sizes(request)
                yield from fn(self, request, context)
            except Exception as e:
                code, message = _status(e)
            finally:
                RPCS.labels(name, code.name).inc()
            if code is not grpc.StatusCode.OK:
                context.abort(code, message)

        return stream

    @functools.wraps(fn)
    def unary(self, request, context):
        start, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            _check_sizes(request)
            return fn(self, request, context)
        except Exception as e:
            code, message = _status(e)
        finally:
            RPCS.labels(name, code.name).inc()
            RPC_SECONDS.labels(name).observe(time.perf_counter() - start)
        context.abort(code, message)

    return unary


# ---------------------------------------------------------------------------- conversions


def artifact_to_pb(a: Artifact) -> common_pb2.DraftArtifact:
    files = [common_pb2.FileRef(name=f.name, sha256=f.sha256, size_bytes=f.size_bytes) for f in a.files]
    return common_pb2.DraftArtifact(bucket=a.bucket, prefix=a.prefix, files=files)


def artifact_from_pb(a: common_pb2.DraftArtifact) -> Artifact:
    files = tuple(FileEntry(f.name, f.sha256.lower(), f.size_bytes) for f in a.files)
    return Artifact(a.bucket, a.prefix.rstrip("/"), files)


def draft_to_pb(d: DraftManifest) -> registry_pb2.DraftVersion:
    return registry_pb2.DraftVersion(
        version=d.version,
        target_model=d.target_model,
        artifact=artifact_to_pb(d.artifact),
        eval_metrics=d.eval_metrics,
        provenance_json=d.provenance_json,
        parent_version=d.parent_version,
        drafter=d.drafter,
        created_unix_s=d.created_unix_s,
    )


def pointer_to_pb(s: PointerState) -> registry_pb2.PointerState:
    history = [
        registry_pb2.PointerEvent(
            action=_ACTIONS.get(e.action, 0),
            from_version=e.from_version,
            to_version=e.to_version,
            reason=e.reason,
            actor=e.actor,
            time_unix_s=e.time_unix_s,
        )
        for e in s.history
    ]
    return registry_pb2.PointerState(
        target_model=s.target_model,
        current=s.current,
        pinned=s.pinned,
        effective=s.effective,
        previous=s.previous,
        history=history,
        generation=s.generation,
    )


# -------------------------------------------------------------------------------- service


def _actor(context: grpc.ServicerContext) -> str:
    """Who made an admin call, for the pointer history (the x-tide-actor metadata, else "admin")."""
    return grpcutil.actor_of(context, "admin")


class RegistryServicer(registry_grpc.RegistryServiceServicer):
    """Stateless translation layer; all state lives in the store (S3)."""

    def __init__(self, store: RegistryStore, hub: WatchHub, watch_tick_s: float = 1.0):
        self.store, self.hub, self.watch_tick_s = store, hub, watch_tick_s

    @_rpc
    def RegisterDraft(self, request, context):
        d = self.store.register(
            request.target_model,
            artifact_from_pb(request.artifact),
            eval_metrics=dict(request.eval_metrics),
            provenance_json=request.provenance_json,
            parent_version=request.parent_version,
            drafter=request.drafter,
        )
        return draft_to_pb(d)

    @_rpc
    def ListDrafts(self, request, context):
        drafts = [draft_to_pb(d) for d in self.store.list(request.target_model)]
        pointer = pointer_to_pb(self.store.pointer(request.target_model)) if request.target_model else None
        return registry_pb2.ListDraftsResponse(drafts=drafts, pointer=pointer)

    @_rpc
    def GetDraft(self, request, context):
        return draft_to_pb(self.store.get(request.version))

    @_rpc
    def GetPointer(self, request, context):
        return pointer_to_pb(self.store.pointer(request.target_model))

    def _changed(self, state: PointerState) -> registry_pb2.PointerState:
        if state.history:
            POINTER_CHANGES.labels(state.history[0].action).inc()
        return pointer_to_pb(state)

    @_rpc
    def Promote(self, request, context):
        expected = request.expected_current if request.HasField("expected_current") else None
        return self._changed(
            self.store.promote(request.target_model, request.version, request.reason, _actor(context), expected)
        )

    @_rpc
    def Pin(self, request, context):
        return self._changed(self.store.pin(request.target_model, request.version, request.reason, _actor(context)))

    @_rpc
    def Unpin(self, request, context):
        return self._changed(self.store.unpin(request.target_model, request.reason, _actor(context)))

    @_rpc
    def Rollback(self, request, context):
        expected = request.expected_current if request.HasField("expected_current") else None
        return self._changed(
            self.store.rollback(request.target_model, request.reason, _actor(context), request.to_version, expected)
        )

    def _assignment(self, s: PointerState) -> registry_pb2.TargetAssignment:
        msg = registry_pb2.TargetAssignment(
            target_model=s.target_model, version=s.effective, pinned=bool(s.pinned), generation=s.generation
        )
        if s.effective:
            msg.artifact.CopyFrom(artifact_to_pb(self.store.get(s.effective).artifact))
        return msg

    @_rpc
    def WatchTarget(self, request, context):
        target = m.check_target(request.target_model)
        WATCHERS.inc()
        try:
            with self.hub.subscribe(target) as state:
                yield self._assignment(state)
                sent, generation = (state.effective, bool(state.pinned)), state.generation
                while context.is_active() and not self.hub.stopped:
                    new = self.hub.wait(target, generation, self.watch_tick_s)
                    if new is None:
                        continue
                    generation = new.generation
                    if (new.effective, bool(new.pinned)) != sent:
                        sent = (new.effective, bool(new.pinned))
                        yield self._assignment(new)
        finally:
            WATCHERS.dec()


def build_server(
    store: RegistryStore, hub: WatchHub, address: str, admin_token: str | None, max_workers: int = 64
) -> grpcutil.GrpcServer:
    """The gRPC server (health, reflection, admin auth) with the registry service added; not started."""
    server = grpcutil.GrpcServer(address, admin_token=admin_token, max_workers=max_workers)
    server.add_service(registry_grpc.add_RegistryServiceServicer_to_server, RegistryServicer(store, hub), SERVICE)
    return server

"""tide.grpcutil against a real gRPC server on a real loopback socket."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tide import grpcutil
from tide.proto.tide.v1 import inference_pb2 as pb
from tide.proto.tide.v1 import inference_pb2_grpc as pb_grpc
from tide.proto.tide.v1 import registry_pb2_grpc  # noqa: F401  (registers RegistryService)

TOKEN = "t0ken-for-tests"
SERVICE = "tide.v1.InferenceService"


class FakeWorker(pb_grpc.InferenceServiceServicer):
    """Just enough of a worker to exercise unary, server-streaming and admin calls."""

    def __init__(self):
        self.actors: list[str] = []

    def GetStatus(self, request, context):
        return pb.WorkerStatus(worker_id="w1", max_batch_size=8)

    def Generate(self, request, context):
        for tok in (5, 6):
            yield pb.GenerateResponse(request_id=request.request_id, chunk=pb.TokenChunk(token_ids=[tok]))
        final = pb.GenerateFinal(finish_reason=pb.FINISH_REASON_LENGTH, completion_tokens=2)
        yield pb.GenerateResponse(request_id=request.request_id, final=final)

    def ApplyDecision(self, request, context):
        self.actors.append(grpcutil.actor_of(context))
        return pb.ApplyDecisionResponse(outcome=pb.ApplyDecisionResponse.OUTCOME_APPLIED)


def _serve(token: str | None, **kwargs) -> tuple[grpcutil.GrpcServer, FakeWorker]:
    worker = FakeWorker()
    server = grpcutil.GrpcServer(admin_token=token, **kwargs)
    server.add_service(pb_grpc.add_InferenceServiceServicer_to_server, worker, SERVICE)
    server.start()
    return server, worker


@pytest.fixture
def served():
    server, worker = _serve(TOKEN)
    yield server, worker
    server.stop(grace_s=0)


def test_admin_methods_come_from_the_proto_option():
    assert grpcutil.admin_methods(SERVICE) == {"/tide.v1.InferenceService/ApplyDecision"}
    assert grpcutil.admin_methods("tide.v1.RegistryService") == {
        f"/tide.v1.RegistryService/{m}" for m in ("RegisterDraft", "Promote", "Pin", "Unpin", "Rollback")
    }


def test_binds_loopback_by_default(served):
    server, _ = served
    assert server.target == f"127.0.0.1:{server.port}"
    # Nothing answers on a non-loopback address of this host for that port.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))  # no packet sent; picks the outbound interface
        lan_ip = s.getsockname()[0]
    if lan_ip.startswith("127."):
        pytest.skip("no non-loopback interface on this machine")
    with socket.socket() as s:
        s.settimeout(0.5)
        assert s.connect_ex((lan_ip, server.port)) != 0


def test_non_admin_calls_need_no_token(served):
    server, _ = served
    stub = pb_grpc.InferenceServiceStub(grpcutil.channel(server.target))
    assert stub.GetStatus(pb.GetWorkerStatusRequest(), timeout=5).worker_id == "w1"
    responses = list(stub.Generate(pb.GenerateRequest(request_id="r1"), timeout=5))
    assert [r.WhichOneof("payload") for r in responses] == ["chunk", "chunk", "final"]
    assert {r.request_id for r in responses} == {"r1"}


@pytest.mark.parametrize(
    ("token", "expected"),
    [(None, "send metadata 'authorization: Bearer <token>'"), ("wrong", "invalid bearer token")],
)
def test_admin_call_without_valid_token_is_unauthenticated(served, token, expected):
    server, worker = served
    stub = pb_grpc.InferenceServiceStub(grpcutil.channel(server.target, token=token))
    with pytest.raises(grpc.RpcError) as err:
        stub.ApplyDecision(pb.Decision(decision_id="d1"), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert expected in err.value.details()
    assert "ApplyDecision" in err.value.details()
    assert worker.actors == []  # the servicer never ran


def test_admin_call_with_token_succeeds_and_carries_actor(served):
    server, worker = served
    stub = pb_grpc.InferenceServiceStub(grpcutil.channel(server.target, token=TOKEN, actor="controller"))
    reply = stub.ApplyDecision(pb.Decision(decision_id="d1"), timeout=5)
    assert reply.outcome == pb.ApplyDecisionResponse.OUTCOME_APPLIED
    assert worker.actors == ["controller"]


def test_server_without_token_refuses_admin_calls():
    server, _ = _serve(None)
    try:
        stub = pb_grpc.InferenceServiceStub(grpcutil.channel(server.target, token="anything"))
        with pytest.raises(grpc.RpcError) as err:
            stub.ApplyDecision(pb.Decision(decision_id="d1"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert grpcutil.ADMIN_TOKEN_ENV in err.value.details()
    finally:
        server.stop(grace_s=0)


def test_protected_streaming_method_is_denied_with_the_right_shape():
    server, _ = _serve(TOKEN, extra_protected={"/tide.v1.InferenceService/Generate"})
    try:
        anonymous = pb_grpc.InferenceServiceStub(grpcutil.channel(server.target))
        with pytest.raises(grpc.RpcError) as err:
            list(anonymous.Generate(pb.GenerateRequest(request_id="r"), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        admin = pb_grpc.InferenceServiceStub(grpcutil.channel(server.target, token=TOKEN))
        assert len(list(admin.Generate(pb.GenerateRequest(request_id="r"), timeout=5))) == 3
    finally:
        server.stop(grace_s=0)


def test_health_checking_follows_lifecycle(served):
    server, _ = served
    health = health_pb2_grpc.HealthStub(grpcutil.channel(server.target))
    for name in ("", SERVICE):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    server.set_serving(SERVICE, False)
    reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as err:
        health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_services(served):
    server, _ = served
    stub = reflection_pb2_grpc.ServerReflectionStub(grpcutil.channel(server.target))
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in next(replies).list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_aio_channel_sends_token(served):
    server, worker = served

    async def call():
        async with grpcutil.aio_channel(server.target, token=TOKEN, actor="gateway") as ch:
            stub = pb_grpc.InferenceServiceStub(ch)
            reply = await stub.ApplyDecision(pb.Decision(decision_id="d2"), timeout=5)
            chunks = [r async for r in stub.Generate(pb.GenerateRequest(request_id="a"), timeout=5)]
            return reply, chunks

    reply, chunks = asyncio.run(call())
    assert reply.outcome == pb.ApplyDecisionResponse.OUTCOME_APPLIED
    assert len(chunks) == 3
    assert worker.actors == ["gateway"]


def test_check_bearer_rejects_malformed_header():
    assert "malformed" in grpcutil.check_bearer([("authorization", "Basic abc")], TOKEN, "/m")
    assert grpcutil.check_bearer([("authorization", f"Bearer {TOKEN}")], TOKEN, "/m") is None


def test_idle_stream_outlives_the_clients_keepalive_pings(monkeypatch):
    """A long-lived stream that carries no data (a worker's WatchTarget to the registry; Health/Watch
    here) must not be cut because its client pings: gRPC's default server answers the third ping
    within 5 minutes on a connection it sends no data on with GOAWAY "too_many_pings", and the stream
    ends UNAVAILABLE. The pings are sped up 60x (500 ms), and the client is told to keep pinging
    without data (gRPC clients stop after two unless they send data in between, as a worker does)."""
    monkeypatch.setattr(grpcutil, "KEEPALIVE_MS", 500)
    server = grpcutil.GrpcServer()
    server.start()
    options = [*grpcutil._channel_options(), ("grpc.http2.max_pings_without_data", 0)]
    try:
        with grpc.insecure_channel(server.target, options=options) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=4.0)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as err:
                next(watch)  # nothing more is sent: the stream idles until its deadline
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
    finally:
        server.stop(grace_s=0)

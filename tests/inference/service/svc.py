"""Helpers for the inference-service tests (import as `inference.service.svc`)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from support import services

from services.inference.app import InferenceService
from tide import streams
from tide.blobs import StorageSettings
from tide.grpcutil import channel
from tide.proto.tide.v1 import inference_pb2, inference_pb2_grpc
from tide.servers import free_port
from tide.telemetry import StepRecord

ADMIN_TOKEN = "test-admin-token"
VOCAB = 96  # tests/support/engine.save_tiny_target's default


def storage(redis_url: str, s3_endpoint: str, access_key: str, secret_key: str, bucket: str, prefix: str):
    return StorageSettings(s3_endpoint=s3_endpoint, s3_access_key=access_key, s3_secret_key=secret_key,
                           s3_bucket=bucket, redis_url=redis_url, stream_prefix=prefix)


def closed_port_url() -> str:
    """A loopback address nothing listens on (a dependency that is down)."""
    return f"127.0.0.1:{free_port()}"


def stub(svc: InferenceService, token: str | None = None) -> inference_pb2_grpc.InferenceServiceStub:
    return inference_pb2_grpc.InferenceServiceStub(channel(svc.target, token=token))


def request(rid: str, prompt: list[int], max_tokens: int = 24, **kw) -> inference_pb2.GenerateRequest:
    sampling = inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=kw.pop("temperature", 0.0),
                                            ignore_eos=kw.pop("ignore_eos", True),
                                            stop_token_ids=kw.pop("stop_token_ids", []))
    return inference_pb2.GenerateRequest(request_id=rid, prompt_token_ids=inference_pb2.TokenIds(ids=prompt),
                                         sampling=sampling, **kw)


def run_stream(client, req) -> tuple[list[int], list, inference_pb2.GenerateResponse]:
    """(all token ids, the chunk messages, the last message) of one Generate stream."""
    chunks, last = [], None
    for msg in client.Generate(req, timeout=60):
        last = msg
        if msg.HasField("chunk"):
            chunks.append(msg.chunk)
    return [t for c in chunks for t in c.token_ids], chunks, last


def step_records(redis_client, prefix: str) -> list[StepRecord]:
    names = streams.StreamNames(prefix)
    return [streams.decode(f, StepRecord) for _, f in redis_client.xrange(names.telemetry)]


def wait_for(predicate: Callable[[], object], timeout_s: float = 10.0, what: str = "condition"):
    return services.wait_for(predicate, timeout_s, what, every_s=0.02)


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value

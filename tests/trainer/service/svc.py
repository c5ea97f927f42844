"""Helpers of the trainer-service tests (import as `trainer.service.svc`): chunk blobs of a tiny
target, stored in S3 and announced on the chunk stream the way an inference worker does it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
from safetensors.torch import save
from support import services

from tide import blobs, streams
from tide.chunks import ChunkBuilder, encode_chunk
from tide.streams import ChunkRef

ADMIN_TOKEN = "test-admin-token"
HIDDEN, VOCAB = 64, 96  # tests/support/engine.save_tiny_target's defaults


def chunk_blob(target_model: str, chunk_id: str, n_tokens: int = 64, seed: int = 0, segments: int = 2) -> bytes:
    """A valid chunk: `segments` sequences of random tokens with random (finite) states."""
    g = torch.Generator().manual_seed(seed)
    b = ChunkBuilder(n_tokens, HIDDEN, target_model, worker_id="test-worker")
    per = n_tokens // segments
    for s in range(segments):
        n = per if s < segments - 1 else n_tokens - per * (segments - 1)
        b.append(s, torch.randint(0, VOCAB, (n,), generator=g), torch.arange(n),
                 torch.randn(n, 3 * HIDDEN, generator=g).bfloat16(), torch.randn(n, HIDDEN, generator=g).bfloat16())
    return encode_chunk(b.flush(workload="test", chunk_id=chunk_id))


def renamed(blob: bytes, chunk_id: str) -> bytes:
    """The same chunk under another id (fresh data for the manifest, same content)."""
    from tide.chunks import decode_chunk

    c = decode_chunk(blob)
    return encode_chunk(dataclasses.replace(c, meta=dataclasses.replace(c.meta, chunk_id=chunk_id)))


def bad_shape_blob(target_model: str, chunk_id: str) -> bytes:
    """A well-formed safetensors blob whose aux width is not 3 x final's (bypasses encode_chunk's checks)."""
    from tide.chunks import decode_chunk

    c = decode_chunk(chunk_blob(target_model, chunk_id, n_tokens=16))
    tensors = {**c.tensors(), "aux": c.aux[:, : 2 * HIDDEN].contiguous()}
    return save(tensors, metadata={"format": "pt", **c.meta.to_header()})


def publish(redis_client, s3_client, bucket: str, prefix: str, target_model: str, chunk_id: str, blob: bytes,
            sha256: str | None = None, num_tokens: int | None = None, store: bool = True) -> ChunkRef:
    """Store the blob (unless not `store`: a reference to nothing) and announce it; `sha256` and
    `num_tokens` override what the reference claims."""
    key = f"chunks/{chunk_id}.safetensors"
    info = blobs.put_bytes(s3_client, bucket, key, blob) if store else blobs.BlobInfo(
        bucket, key, len(blob), blobs.sha256_hex(blob), "")
    from tide.chunks import ChunkInvalid, decode_chunk

    try:
        tokens = decode_chunk(blob).num_tokens
    except ChunkInvalid:
        tokens = 16
    ref = ChunkRef(chunk_id=chunk_id, bucket=bucket, key=key, size_bytes=info.size_bytes,
                   sha256=sha256 or info.sha256, num_tokens=tokens if num_tokens is None else num_tokens,
                   target_model=target_model, draft_version="", workload="test", worker_id="test-worker",
                   created_unix_s=time.time())
    streams.add(redis_client, streams.StreamNames(prefix).chunks, ref)
    return ref


def trainer_stub(svc, token: str | None = ADMIN_TOKEN):
    from tide.grpcutil import channel
    from tide.proto.tide.v1 import trainer_pb2_grpc

    return trainer_pb2_grpc.TrainerServiceStub(channel(svc.target, token=token))


def status(svc):
    from tide.proto.tide.v1 import trainer_pb2

    return trainer_stub(svc).GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=5)


def trigger(svc, **kw):
    from tide.proto.tide.v1 import trainer_pb2

    return trainer_stub(svc).TriggerTraining(trainer_pb2.TriggerTrainingRequest(**kw), timeout=30)


def metric(svc, name: str, **labels) -> float | None:
    """A sample of the trainer's Prometheus collector (what /metrics serves)."""
    from services.trainer.metrics import TrainerCollector

    for family in TrainerCollector(svc).collect():
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


def wait_for(predicate: Callable[[], object], timeout_s: float = 20.0, what: str = "condition"):
    return services.wait_for(predicate, timeout_s, what)

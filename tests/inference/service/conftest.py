"""Fixtures for the inference service: a real gRPC server on loopback around the tiny target, with
real Redis and S3 (tests/conftest.py). Helpers live in svc.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from inference.service.svc import ADMIN_TOKEN, storage

from services.inference.app import InferenceService, build
from services.inference.settings import InferenceSettings
from tide.blobs import StorageSettings


@pytest.fixture
def real_storage(redis_server, s3_server, s3_bucket, unique_prefix) -> StorageSettings:
    return storage(redis_server.url, s3_server.endpoint, s3_server.access_key, s3_server.secret_key, s3_bucket,
                   unique_prefix)


@pytest.fixture
def make_service(tiny_model, real_storage, tmp_path) -> Callable[..., InferenceService]:
    """Factory: `make_service(max_batch=2, collection=True, storage=...)` -> a started service
    (stopped at teardown). Defaults: greedy-friendly ngram drafter, static γ = 3, a chunk spool of
    the test's own (tmp_path/spool-<n>: never one another test's worker left chunks in)."""
    started: list[InferenceService] = []

    def make(**overrides) -> InferenceService:
        kw = dict(target="tiny", dtype="fp32", max_batch=4, max_seq_len=256, max_tokens_per_step=64, max_queue=8,
                  listen="127.0.0.1:0", metrics_port=0, worker_id="test-worker", telemetry_interval_s=0.05,
                  telemetry_batch=8, flush_interval_s=0.3, chunk_tokens=64, admin_token=ADMIN_TOKEN,
                  storage=real_storage, chunk_spool_dir=str(tmp_path / f"spool-{len(started)}"),
                  policy="static", policy_params={"gamma": 3})  # the default, adaptive, profiles at start
        kw.update(overrides)
        svc = build(InferenceSettings(**kw), model=tiny_model, tokenizer=None, model_id="tiny-llama-0")
        started.append(svc)
        return svc

    yield make
    for svc in started:
        svc.stop(grace_s=0.5)


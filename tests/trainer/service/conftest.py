"""Fixtures of the trainer-service tests: a tiny target on disk and a factory of started services
(real gRPC, real Redis and S3 from tests/conftest.py), each stopped at teardown."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engine import save_tiny_target
from trainer.service.svc import ADMIN_TOKEN

from services.trainer.app import build
from services.trainer.settings import TrainerSettings
from tide.blobs import StorageSettings


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trainer-target")
    save_tiny_target(path)
    return path


@pytest.fixture
def trainer_storage(redis_server, s3_server, s3_bucket, unique_prefix) -> StorageSettings:
    return StorageSettings(s3_endpoint=s3_server.endpoint, s3_access_key=s3_server.access_key,
                           s3_secret_key=s3_server.secret_key, s3_bucket=s3_bucket, redis_url=redis_server.url,
                           stream_prefix=unique_prefix)


@pytest.fixture
def make_trainer(tiny_dir, trainer_storage, tmp_path):
    started = []

    def make(**kw):
        base = dict(listen="127.0.0.1:0", metrics_port=0, target=str(tiny_dir), device="cpu", consumer="t-test",
                    work_dir=str(tmp_path / "work"), min_tokens=1000, steps=3, batch_rows=2, max_len=64,
                    eval_fraction=0.25, admin_token=ADMIN_TOKEN, storage=trainer_storage)
        svc = build(TrainerSettings(**{**base, **kw}), storage_timeout_s=10)
        started.append(svc)
        return svc

    yield make
    for svc in started:
        svc.runner.wait(60)
        svc.stop(grace_s=0.2)

"""Fixtures of the trainer-service tests: tiny targets on disk, a real draft registry and a factory
of started services (real gRPC, real Redis and S3 from tests/conftest.py), each stopped at teardown.

`copy_dir` is tests/trainer's copy target (greedy continuations repeat the last prompt token) under
the name its chunks carry ("tiny-llama"), so a few optimizer steps learn a draft that clearly beats
no draft; `copy_chunks` (tests/trainer/conftest.py) are 5 chunks of 256 tokens generated from it."""

from __future__ import annotations

from pathlib import Path

import pytest
from registry.harness import start_registry
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


@pytest.fixture(scope="session")
def copy_dir(copy_target, tmp_path_factory) -> Path:
    link = tmp_path_factory.mktemp("trainer-copy") / copy_target.model_id
    link.symlink_to(copy_target.path, target_is_directory=True)
    return link


@pytest.fixture
def draft_registry(s3_client, s3_bucket):
    """A real registry (same S3 server and bucket as the trainer), admin token = the trainer's."""
    reg = start_registry(s3_client, s3_bucket, token=ADMIN_TOKEN)
    yield reg
    reg.stop()


@pytest.fixture
def trainer_storage(redis_server, s3_server, s3_bucket, unique_prefix) -> StorageSettings:
    return StorageSettings(s3_endpoint=s3_server.endpoint, s3_access_key=s3_server.access_key,
                           s3_secret_key=s3_server.secret_key, s3_bucket=s3_bucket, redis_url=redis_server.url,
                           stream_prefix=unique_prefix)


@pytest.fixture
def make_trainer(tiny_dir, trainer_storage, tmp_path):
    started = []

    def make(**kw):
        # registry_addr: port 1 (privileged, nothing listens) unless a test passes a real registry
        base = dict(listen="127.0.0.1:0", metrics_port=0, target=str(tiny_dir), device="cpu", consumer="t-test",
                    work_dir=str(tmp_path / "work"), min_tokens=1000, steps=3, batch_rows=2, max_len=64,
                    eval_fraction=0.25, admin_token=ADMIN_TOKEN, storage=trainer_storage, auto_train=False,
                    registry_addr="127.0.0.1:1")
        svc = build(TrainerSettings(**{**base, **kw}), storage_timeout_s=10)
        started.append(svc)
        return svc

    yield make
    for svc in started:
        svc.runner.wait(60)
        svc.stop(grace_s=0.2)


@pytest.fixture(autouse=True)
def _own_profile_cache(tmp_path, monkeypatch):
    """Promotion reads the newest latency profile cached on this machine for the target; a tiny
    model's profile another test cached (on a slow CPU: drafting does not pay) must not decide here."""
    monkeypatch.setenv("TIDE_PROFILE_CACHE_DIR", str(tmp_path / "profiles"))

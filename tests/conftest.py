"""Shared fixtures: real Redis and S3-compatible servers, and per-test clients.

- `redis_server` / `s3_server` (session): a `tide.servers.RedisEndpoint` / `S3Endpoint` for a
  server started once per test session. With a Docker engine they are testcontainers (Redis,
  MinIO); without one, local processes (`tide.servers.RedisServer` / `S3Server`). Force one with
  `TIDE_TEST_SERVERS=local` or `=docker` (default `auto`).
- `unique_prefix` (function): a name unique to this test, valid as a Redis key prefix and an S3
  bucket name, e.g. `t-test-reclaim-3f9a2c1d`.
- `redis_client` (function): `redis.Redis` (bytes responses); keys starting with
  `unique_prefix` are deleted after the test.
- `s3_client` (function): a `minio.Minio` client; `s3_bucket` (function): a fresh bucket named
  `unique_prefix`, emptied and removed after the test.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator

import pytest

from tide.servers import RedisEndpoint, RedisServer, S3Endpoint, S3Server

# Must support conditional PUT (If-Match / If-None-Match), which tide.blobs relies on.
MINIO_IMAGE = os.environ.get("TIDE_TEST_MINIO_IMAGE", "minio/minio:RELEASE.2025-04-22T22-12-26Z")
REDIS_IMAGE = os.environ.get("TIDE_TEST_REDIS_IMAGE", "redis:7.2-alpine")


def _use_docker() -> bool:
    mode = os.environ.get("TIDE_TEST_SERVERS", "auto")
    if mode not in ("auto", "local", "docker"):
        raise pytest.UsageError(f"TIDE_TEST_SERVERS must be auto, local or docker, not {mode!r}")
    if mode != "auto":
        return mode == "docker"
    try:
        import docker

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisEndpoint]:
    if _use_docker():
        from testcontainers.community.redis import RedisContainer

        with RedisContainer(REDIS_IMAGE) as c:
            yield RedisEndpoint(c.get_container_host_ip(), int(c.get_exposed_port(c.port)))
        return
    with RedisServer(workdir=tmp_path_factory.mktemp("redis")) as server:
        yield server.endpoint


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    if _use_docker():
        from testcontainers.community.minio import MinioContainer

        with MinioContainer(MINIO_IMAGE) as c:
            cfg = c.get_config()
            yield S3Endpoint(cfg["endpoint"], cfg["access_key"], cfg["secret_key"])
        return
    # The data is thrown away: do not wait for a graceful shutdown.
    with S3Server(workdir=tmp_path_factory.mktemp("s3"), stop_timeout_s=1.0) as server:
        yield server.endpoint


@pytest.fixture
def unique_prefix(request: pytest.FixtureRequest) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    return f"t-{slug}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def redis_client(redis_server: RedisEndpoint, unique_prefix: str):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    yield client
    for key in client.scan_iter(match=f"{unique_prefix}*", count=500):
        client.delete(key)
    client.close()


@pytest.fixture
def s3_client(s3_server: S3Endpoint):
    return s3_server.client()


@pytest.fixture
def s3_bucket(s3_client, unique_prefix: str) -> Iterator[str]:
    s3_client.make_bucket(unique_prefix)
    yield unique_prefix
    for obj in s3_client.list_objects(unique_prefix, recursive=True):
        s3_client.remove_object(unique_prefix, obj.object_name)
    s3_client.remove_bucket(unique_prefix)

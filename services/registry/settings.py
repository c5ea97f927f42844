"""Registry settings: built once from the environment (`TIDE_*`), frozen, passed explicitly.

TIDE_REGISTRY_LISTEN      host:port to serve gRPC on (default 127.0.0.1:50055; compose: 0.0.0.0:50055)
TIDE_ADMIN_TOKEN          bearer token admin calls must carry (unset: every admin call is refused)
TIDE_REGISTRY_ROOT        key prefix of the registry's objects in the bucket (default "registry")
TIDE_REGISTRY_POLL_S      pointer poll interval for watch streams, seconds (default 0.25)
TIDE_REGISTRY_METRICS_PORT  Prometheus /metrics port on the listen host (default 9405; 0 = off)
TIDE_REGISTRY_MAX_WORKERS concurrent RPCs, each open watch stream holds one (default 64)
TIDE_REGISTRY_WORK_DIR    where checkpoints are downloaded for validation (default: system temp)
TIDE_LOG_LEVEL            log level (default INFO)
TIDE_S3_* / TIDE_S3_BUCKET  object storage, see `tide.blobs.StorageSettings`
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from tide.blobs import StorageSettings
from tide.grpcutil import ADMIN_TOKEN_ENV
from tide.registry_client import DEFAULT_REGISTRY_ADDR, DEFAULT_ROOT


@dataclass(frozen=True)
class RegistrySettings:
    listen: str = DEFAULT_REGISTRY_ADDR
    admin_token: str | None = field(default=None, repr=False)
    storage: StorageSettings = field(default_factory=StorageSettings)
    root: str = DEFAULT_ROOT
    poll_s: float = 0.25
    metrics_port: int = 9405
    max_workers: int = 64
    work_dir: str | None = None
    log_level: str = "INFO"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RegistrySettings:
        env = os.environ if env is None else env
        settings = cls(
            listen=env.get("TIDE_REGISTRY_LISTEN", cls.listen),
            admin_token=env.get(ADMIN_TOKEN_ENV) or None,
            storage=StorageSettings.from_env(env),
            root=env.get("TIDE_REGISTRY_ROOT", cls.root).strip("/") or cls.root,
            poll_s=float(env.get("TIDE_REGISTRY_POLL_S", cls.poll_s)),
            metrics_port=int(env.get("TIDE_REGISTRY_METRICS_PORT", cls.metrics_port)),
            max_workers=int(env.get("TIDE_REGISTRY_MAX_WORKERS", cls.max_workers)),
            work_dir=env.get("TIDE_REGISTRY_WORK_DIR") or None,
            log_level=env.get("TIDE_LOG_LEVEL", cls.log_level).upper(),
        )
        if settings.poll_s <= 0 or settings.max_workers < 2:
            raise ValueError("TIDE_REGISTRY_POLL_S must be > 0 and TIDE_REGISTRY_MAX_WORKERS >= 2")
        return settings

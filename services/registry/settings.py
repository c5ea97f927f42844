"""Registry settings: built once from the environment (`TIDE_*`), frozen, passed explicitly.

Every variable (all optional), its type, default and meaning is a field of `RegistrySettings`; the
table in docs/configuration.md is generated from it (tools/gen_config_docs.py). Besides its own
`TIDE_REGISTRY_*` variables the registry reads TIDE_ADMIN_TOKEN, TIDE_LOG_LEVEL and the object
storage variables (`tide.blobs.StorageSettings`: TIDE_S3_*).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field
from pydantic_settings import SettingsConfigDict

import tide
from tide.blobs import StorageSettings
from tide.grpcutil import ADMIN_TOKEN_ENV
from tide.registry_client import DEFAULT_REGISTRY_ADDR, DEFAULT_ROOT
from tide.settings import (
    Doc,
    LogLevel,
    Port,
    Seconds,
    Secret,
    TideSettings,
    at_least,
    log_level_field,
    shown_default,
)

SHIPPED_STARTERS = Path(tide.__file__).parent / "starter_drafts"  # the repository's starter drafts
Root = Annotated[str, AfterValidator(lambda v: v.strip("/") or DEFAULT_ROOT), Doc("S3 key prefix")]


class RegistrySettings(TideSettings):
    """Everything the draft registry is configured with."""

    model_config = SettingsConfigDict(env_prefix="TIDE_REGISTRY_")

    listen: str = Field(DEFAULT_REGISTRY_ADDR, description="host:port to serve gRPC on (compose: 0.0.0.0:50055)")
    admin_token: Secret = Field(None, validation_alias=ADMIN_TOKEN_ENV,
                                description="bearer token admin calls must carry (unset: every admin call is refused)")
    storage: StorageSettings = Field(default_factory=StorageSettings, description="S3 (drafts, pointers)")
    root: Root = Field(DEFAULT_ROOT, description="key prefix of the registry's objects in the bucket")
    # Changes made through this registry reach its watch streams at once; the poll only picks up
    # those another replica (or a tool) wrote. Each poll is an S3 GET: idle, this process and
    # `weed mini` used 29 ms of CPU a second at 0.25 s and 15 at 1 s (Zen 3, engine-step README 2h).
    poll_s: Seconds = Field(1.0, description="pointer poll interval for watch streams, seconds (changes made "
                                             "through this registry are streamed at once)")
    metrics_port: Port = Field(9405, description="Prometheus /metrics port on the listen host; 0 = off")
    max_workers: Annotated[int, at_least(2)] = Field(64, description="concurrent RPCs; each open watch stream "
                                                     "holds one")
    work_dir: str | None = Field(None, json_schema_extra=shown_default("the system temp directory"),
                                 description="where checkpoints are downloaded for validation")
    starter_drafts: str = Field(
        default_factory=lambda: str(SHIPPED_STARTERS), json_schema_extra=shown_default("`tide/starter_drafts`"),
        description="directory of starter drafts (services/registry/starter.py): each is registered and promoted "
        "at start for its target if that target has no version yet; empty = none")
    log_level: LogLevel = log_level_field()

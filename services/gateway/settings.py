"""Gateway settings: one frozen object, built once from `TIDE_*` environment variables.

| variable                    | default             | meaning                                                   |
|-----------------------------|---------------------|-----------------------------------------------------------|
| TIDE_GATEWAY_HOST           | 127.0.0.1           | HTTP bind address (compose passes 0.0.0.0 explicitly)     |
| TIDE_GATEWAY_PORT           | 8000                | HTTP port                                                 |
| TIDE_WORKERS                | 127.0.0.1:50051     | comma list of inference workers, host:port                |
| TIDE_API_KEYS               | (none)              | comma list of accepted API keys; empty = no auth          |
| TIDE_TARGET                 | ref                 | target for the tokenizer / chat template (see tide.target)|
| TIDE_SERVED_MODEL_NAME      | the target's id     | model name clients send and /v1/models lists              |
| TIDE_MAX_MODEL_LEN          | see below           | prompt + completion token limit enforced by the gateway   |
| TIDE_GATEWAY_MAX_N          | 16                  | largest `n` (choices per request)                         |
| TIDE_GATEWAY_POLL_S         | 1.0                 | worker GetStatus polling period                           |
| TIDE_GATEWAY_STATUS_TIMEOUT_S | 5.0               | GetStatus deadline (a busy CPU worker answers slowly)     |
| TIDE_GATEWAY_MAX_BODY_BYTES | 16777216            | largest accepted request body                             |
| TIDE_LOG_LEVEL              | INFO                | log level of the JSON logs                                |

TIDE_MAX_MODEL_LEN defaults to TIDE_MAX_SEQ_LEN (the workers' per-sequence limit, so one variable in
a deployment configures both) and else to the target's max_position_embeddings. Requests without
max_tokens are sent with max_tokens = 0 ("up to the context"), which each worker resolves against
its own window, so a gateway limit larger than a worker's never turns a default request into an
error; an explicit max_tokens beyond a worker's window gets the worker's context_length_exceeded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_WORKER = "127.0.0.1:50051"


def _split(value: str | None) -> tuple[str, ...]:
    return tuple(part.strip() for part in (value or "").split(",") if part.strip())


def _check_address(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker address must be host:port, got {address!r}")
    return address


@dataclass(frozen=True)
class GatewaySettings:
    """Everything the gateway is configured with; passed explicitly, never mutated."""

    host: str = "127.0.0.1"
    port: int = 8000
    workers: tuple[str, ...] = (DEFAULT_WORKER,)
    api_keys: frozenset[str] = field(default_factory=frozenset)
    target: str = "ref"
    served_model_name: str | None = None  # None = the target's model id
    max_model_len: int | None = None  # None = the target's max_position_embeddings
    max_n: int = 16
    poll_interval_s: float = 1.0
    status_timeout_s: float = 5.0
    max_body_bytes: int = 16 * 1024 * 1024
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("at least one worker address is needed (TIDE_WORKERS)")
        for address in self.workers:
            _check_address(address)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.poll_interval_s <= 0 or self.status_timeout_s <= 0:
            raise ValueError("poll_interval_s and status_timeout_s must be > 0")

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GatewaySettings:
        """Build the settings from the environment (or `env`); raises ValueError on bad values."""
        env = os.environ if env is None else env

        def get(name: str, default: str) -> str:
            return env.get(name) or default

        max_len = env.get("TIDE_MAX_MODEL_LEN") or env.get("TIDE_MAX_SEQ_LEN")
        return cls(
            host=get("TIDE_GATEWAY_HOST", "127.0.0.1"),
            port=int(get("TIDE_GATEWAY_PORT", "8000")),
            workers=_split(get("TIDE_WORKERS", DEFAULT_WORKER)),
            api_keys=frozenset(_split(env.get("TIDE_API_KEYS"))),
            target=get("TIDE_TARGET", "ref"),
            served_model_name=env.get("TIDE_SERVED_MODEL_NAME") or None,
            max_model_len=int(max_len) if max_len else None,
            max_n=int(get("TIDE_GATEWAY_MAX_N", "16")),
            poll_interval_s=float(get("TIDE_GATEWAY_POLL_S", "1.0")),
            status_timeout_s=float(get("TIDE_GATEWAY_STATUS_TIMEOUT_S", "5.0")),
            max_body_bytes=int(get("TIDE_GATEWAY_MAX_BODY_BYTES", str(16 * 1024 * 1024))),
            log_level=get("TIDE_LOG_LEVEL", "INFO").upper(),
        )

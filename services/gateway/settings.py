"""Gateway settings: one frozen object, built once from `TIDE_*` environment variables.

Every variable (all optional), its type, default and meaning is a field of `GatewaySettings`; the
table in docs/configuration.md is generated from it (tools/gen_config_docs.py).

The context the gateway serves (what /v1/models reports and what prompts are checked against) is the
workers' real limit: the smallest one the healthy workers report in their status
(WorkerStatus.max_model_len). TIDE_MAX_MODEL_LEN is only an upper bound on it; it defaults to
TIDE_MAX_SEQ_LEN (the workers' per-sequence limit, so one variable in a deployment configures both)
and else to the target's max_position_embeddings, which is also what is used until a worker has
answered. Requests without max_tokens are sent with max_tokens = 0 ("up to the context"), which
each worker resolves against its own window.

TIDE_GATEWAY_MAX_BODY_BYTES defaults to 1 KiB per token of that configured context, at least 1 MiB
(4 MiB for 4096 tokens): enough for any request that fits, a prompt of 64 token-id lists included.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, AliasChoices, BeforeValidator, Field
from pydantic_settings import SettingsConfigDict

from tide.settings import (
    TARGET_ENV,
    AddressList,
    Count,
    Doc,
    Flag,
    LogLevel,
    NameSet,
    NonNegative,
    OptionalAddress,
    Port,
    Seconds,
    TideSettings,
    check,
    log_level_field,
    shown_default,
    split_list,
)

DEFAULT_WORKER = "127.0.0.1:50051"
_ORIGIN = re.compile(r"\*|https?://[^/\s]+")


def _origins(value: tuple[str, ...]) -> tuple[str, ...]:
    bad = [o for o in value if not _ORIGIN.fullmatch(o)]
    if bad:
        raise ValueError(f"expected '*' or origins like https://app.example.com[:port], got {bad[0]!r}")
    return value


def _exclusions(value: frozenset[str]) -> frozenset[str]:
    from services.gateway.governance import EXCLUSIONS

    bad = sorted(value - set(EXCLUSIONS))
    if bad:
        raise ValueError(f"expected any of {', '.join(EXCLUSIONS)}, got {bad[0]!r}")
    return value


Exclusions = Annotated[frozenset[str], BeforeValidator(split_list), AfterValidator(_exclusions),
                       Doc("comma list of logprobs, tools, tool_results, response_format")]

Origins = Annotated[tuple[str, ...], BeforeValidator(split_list), AfterValidator(_origins),
                    Doc("comma list of origins, or *")]


class GatewaySettings(TideSettings):
    """Everything the gateway is configured with; passed explicitly, never mutated."""

    model_config = SettingsConfigDict(env_prefix="TIDE_GATEWAY_")

    host: str = Field("127.0.0.1", description="HTTP bind address (compose passes 0.0.0.0 explicitly)")
    port: Port = Field(8000, description="HTTP port")
    workers: Annotated[AddressList, check(bool, "non-empty")] = Field(
        (DEFAULT_WORKER,), validation_alias="TIDE_WORKERS", description="inference workers")
    api_keys: NameSet = Field(frozenset(), validation_alias="TIDE_API_KEYS",
                              description="accepted API keys; empty (and no TIDE_API_KEYS_NO_TRAIN) = no auth")
    api_keys_no_train: NameSet = Field(frozenset(), validation_alias="TIDE_API_KEYS_NO_TRAIN",
                                       description="more accepted API keys whose requests are never trained on "
                                       "(never captured; docs/data-handling.md)")
    train_on_traffic: Flag = Field(True, validation_alias="TIDE_TRAIN_ON_TRAFFIC",
                                   description="the stack-wide switch (the workers read it too): 0 = no request "
                                   "is ever captured for training; responses say `X-TIDE-Training: excluded`")
    capture_exclude: Exclusions = Field(frozenset(), validation_alias="TIDE_CAPTURE_EXCLUDE",
                                        description="requests never captured for training besides `store: false`: "
                                        "any of logprobs, tools, tool_results, response_format")
    target: str = Field("ref", validation_alias=TARGET_ENV,
                        description="target for the tokenizer / chat template (see tide.target)")
    served_model_name: str | None = Field(None, validation_alias="TIDE_SERVED_MODEL_NAME",
                                          json_schema_extra=shown_default("the target's id"),
                                          description="model name clients send and /v1/models lists")
    model_aliases: NameSet = Field(frozenset(), validation_alias="TIDE_MODEL_ALIASES",
                                   description="more names clients may send as `model` for the served model; "
                                               "/v1/models lists them too, responses name the served model")
    max_model_len: Annotated[int | None, check(lambda v: v is None or v >= 2, ">= 2")] = Field(
        None, validation_alias=AliasChoices("TIDE_MAX_MODEL_LEN", "TIDE_MAX_SEQ_LEN"),
        json_schema_extra=shown_default("the target's max_position_embeddings"),
        description="upper bound on the context (prompt + completion tokens); the gateway serves the smallest "
                    "limit its healthy workers report, at most this")
    max_n: Count = Field(16, description="largest `n` (choices per request)")
    poll_interval_s: Seconds = Field(1.0, validation_alias="TIDE_GATEWAY_POLL_S",
                                     description="worker GetStatus polling period")
    status_timeout_s: Seconds = Field(5.0, description="GetStatus deadline (a busy CPU worker answers slowly)")
    worker_wait_s: Annotated[float, check(lambda v: v >= 0, ">= 0")] = Field(
        30.0, description="how long a request waits for a healthy worker when none is (one being restarted) "
                          "before 503; 0 = fail at once")
    max_body_bytes: Annotated[int | None, check(lambda v: v is None or v >= 1, ">= 1")] = Field(
        None, json_schema_extra=shown_default("1 KiB per token of the context, at least 1 MiB"),
        description="largest accepted request body (413 above it, from Content-Length before reading it)")
    cors_origins: Origins = Field((), validation_alias="TIDE_CORS_ORIGINS",
                                  description="origins browsers may call the API from (CORS: preflight answered, "
                                              "Access-Control-* headers sent); * = any; empty = no CORS headers")
    tokenize_timeout_s: Seconds = Field(10.0, description="time budget for tokenizing one request's prompts "
                                                          "(503 when over it)")
    # /v1/responses' stored responses (services.gateway.response_store), in this gateway's memory
    responses_store_mb: NonNegative = Field(64, description="MiB of stored responses (previous_response_id, "
                                                            "GET /v1/responses/{id}), oldest evicted first; "
                                                            "0 = store none")
    responses_ttl_s: Seconds = Field(86400.0, description="seconds a stored response is kept")
    # /v1/status: where the other services are (empty: not shown) and tide up's process table
    registry_addr: OptionalAddress = Field("", validation_alias="TIDE_REGISTRY_ADDR",
                                           description="registry gRPC address, health-checked by /v1/status")
    controller_addr: OptionalAddress = Field("", validation_alias="TIDE_CONTROLLER_ADDR",
                                             description="controller gRPC address, health-checked by /v1/status")
    trainer_addr: OptionalAddress = Field("", validation_alias="TIDE_TRAINER_ADDR",
                                          description="trainer gRPC address, health-checked by /v1/status")
    stack_state: str = Field("", validation_alias="TIDE_STACK_STATE",
                             description="tide up's stack.json: each process's state and restarts for /v1/status "
                                         "(empty: not supervised by tide up)")
    log_level: LogLevel = log_level_field()

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys or self.api_keys_no_train)

    def body_limit(self, max_model_len: int) -> int:
        """The largest accepted body: `max_body_bytes`, by default derived from the context."""
        return self.max_body_bytes or max(1 << 20, max_model_len * 1024)

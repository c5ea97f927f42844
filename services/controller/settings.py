"""Controller settings: one frozen object built once from the environment, passed explicitly.

Every variable (all optional), its type, default and meaning is a field of `ControllerSettings`; the
table in docs/configuration.md is generated from it (tools/gen_config_docs.py). Times are seconds
unless the name says ms. Besides its own `TIDE_CONTROLLER_*` variables the controller reads
TIDE_REGISTRY_ADDR (rollbacks), TIDE_ADMIN_TOKEN, TIDE_LOG_LEVEL and the storage variables
(`tide.blobs.StorageSettings`: TIDE_REDIS_URL, TIDE_STREAM_PREFIX).
"""

from __future__ import annotations

import socket
from typing import Annotated

from pydantic import BeforeValidator, Field, InstanceOf, ValidationInfo, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from services.controller.decisions import DEFAULT_DECISION_JSON, StaticDecision
from tide.blobs import StorageSettings
from tide.grpcutil import ADMIN_TOKEN_ENV
from tide.registry_client import REGISTRY_ADDR_ENV
from tide.settings import (
    AddressList,
    Count,
    Doc,
    Flag,
    ListenAddress,
    ListenHostMixin,
    LogLevel,
    OptionalAddress,
    Port,
    Seconds,
    Secret,
    TideSettings,
    at_least,
    check,
    env_names,
    finite_at_least,
    log_level_field,
    shown_default,
)

DEFAULT_LISTEN = "127.0.0.1:50053"
CONTROLLER_ADDR_ENV = "TIDE_CONTROLLER_ADDR"  # how other services (the trainer) reach the controller
COLLECTION_MODES = ("auto", "on", "off")

Decision = Annotated[
    InstanceOf[StaticDecision],
    BeforeValidator(lambda v: StaticDecision.from_json(v) if isinstance(v, str) else v),
    Doc("JSON object (decisions.py)"),
]
Margin = Annotated[float, at_least(0)]


class ControllerSettings(ListenHostMixin, TideSettings):
    """Everything the controller is configured with. Times in seconds unless the name says ms."""

    model_config = SettingsConfigDict(env_prefix="TIDE_CONTROLLER_", str_strip_whitespace=True)

    listen: ListenAddress = Field(DEFAULT_LISTEN, description="gRPC host:port (compose: 0.0.0.0:50053)")
    metrics_port: Port = Field(9403, description="Prometheus HTTP port on the listen host; 0 = off")
    workers: AddressList = Field((), description="worker host:ports to push decisions to, besides the workers "
                                 "that call RegisterWorker")
    decision: Decision = Field(default_factory=StaticDecision, json_schema_extra=shown_default(
        f"`{DEFAULT_DECISION_JSON}`"), description="the static decision as JSON (see decisions.py)")
    reconcile_s: Seconds = Field(2.0, description="seconds between rounds of worker status checks / pushes")
    rpc_timeout_s: Seconds = Field(10.0, description="deadline of GetStatus / ApplyDecision calls to workers")
    consumer: Annotated[str, check(bool, "non-empty")] = Field(
        default_factory=socket.gethostname, json_schema_extra=shown_default("hostname"),
        description="consumer name in the telemetry stream's group")
    claim_idle_ms: Count = Field(30_000, description="take over telemetry entries pending this long (ms)")
    ema_short: float = Field(50.0, description="short acceptance EMA horizon (observations)")
    ema_long: float = Field(1000.0, description="long acceptance EMA horizon (observations)")
    load_window_s: Seconds = Field(30.0, description="window of the per-worker load statistics")
    # Collection control (TIDE Algorithm 1, collection.py); "" = from the decision's collection_enabled.
    collection_mode: str = Field("", validation_alias="TIDE_CONTROLLER_COLLECTION", json_schema_extra=shown_default(
        "`auto`; `on` / `off` when the decision sets collection_enabled true / false"),
        description="auto (Algorithm 1) | on | off (forced)")
    shift_epsilon: Margin = Field(0.15, description="shift when the short EMA of the acceptance rate per checked "
                                  "draft token is below the long one by more than this (0..1)")
    shift_hold_s: Annotated[float, finite_at_least(0)] = Field(
        30.0, description="seconds the shift condition must hold before collection opens for a shift (a few seconds "
        "of hard prompts dip the short EMA too)")
    break_even_rate: Annotated[float, check(lambda v: 0 <= v <= 1, "in [0, 1]")] = Field(
        0.0, description="cold start: collect while the serving draft's acceptance rate per drafted token is below "
        "this (0..1); 0 = the γ policy's break-even from the workers' latency profile (TIDE_CONTROLLER_LATENCY_"
        "PROFILE, else the newest EAGLE-3 profile cached on this machine, else the reference CPU's: 0.19)")
    latency_profile: str = Field("", json_schema_extra=shown_default("the newest EAGLE-3 profile cached here, else "
                                 "the reference CPU's"), description="LatencyProfile JSON for the break-even rate "
                                 "and the load rule")
    reachable_rate: Annotated[float, check(lambda v: 0 <= v < 1, "in [0, 1)")] = Field(
        0.6, description="load rule: hold collection off while the workers' running batch is one where even a draft "
        "accepting this rate per drafted token (or the serving draft's own, if higher) would not pay at any γ (0..1; "
        "0 = no load rule; needs a latency profile). 0.6: above the best the reference model's drafts reached, 0.56")
    load_hold_s: Annotated[float, finite_at_least(0)] = Field(
        60.0, description="seconds the load rule's condition must hold, or clear, before it takes effect")
    collection_learn: Flag = Field(True, description="1 = auto mode also collects a judged draft that is neither "
                                   "weak nor shifted, until training stops gaining (learning the traffic)")
    min_on_s: Annotated[float, finite_at_least(0)] = Field(
        300.0, description="seconds collection stays on before training that gains nothing may turn it off "
        "(hysteresis: two small early cycles that miss the margin are noise)")
    min_observations: Count = Field(50, description="verifications of a version before its EMAs are judged")
    no_gain_runs: Count = Field(2, description="consecutive training runs without gain that turn collection off")
    gain_margin: Margin = Field(0.02, description="eval accept-length gain a promoted run needs to count as a gain")
    tokens_needed: Count = Field(16384, description="tokens to collect for a training run (shown in GetState)")
    # Automatic rollback (rollback.py).
    auto_rollback: Flag = Field(True, description="1 = roll back a promoted draft that accepts worse live")
    rollback_window: Count = Field(200, description="verifications of the new version before judging it, and of "
                                   "the previous version (its last ones before the takeover) to judge by")
    rollback_margin: Annotated[float, check(lambda v: 0 <= v < 1, "in [0, 1)")] = Field(
        0.05, description="roll back when its live acceptance rate per checked draft token (0..1; it does not move "
        "with γ, the accept length does) is below the previous version's over its window by more than this")
    rollback_z: Annotated[float, finite_at_least(0)] = Field(
        3.0, description="... and by more than this many standard errors of the difference (a window is a few "
        "seconds of traffic; 0 = the margin alone)")
    registry_addr: OptionalAddress = Field("", validation_alias=REGISTRY_ADDR_ENV,
                                           description="the registry (host:port) rollbacks go to; empty = no rollback")
    admin_token: Secret = Field(None, validation_alias=ADMIN_TOKEN_ENV, description="bearer token: required by "
                                "this service's admin RPCs and sent with ApplyDecision to the workers (unset: admin "
                                "calls refused)")
    storage: StorageSettings = Field(default_factory=StorageSettings, description="Redis (telemetry stream)")
    log_level: LogLevel = log_level_field()

    @field_validator("collection_mode")
    @classmethod
    def _collection_mode(cls, mode: str, info: ValidationInfo) -> str:
        """The mode, "" resolved from the decision's collection_enabled; a contradiction is an error."""
        decision = info.data.get("decision")
        if decision is None:  # the decision is invalid: that error is reported
            return mode
        fixed = decision.collection_enabled
        implied = "auto" if fixed is None else ("on" if fixed else "off")
        mode = mode.lower() or implied
        if mode not in COLLECTION_MODES:
            raise ValueError(f"collection mode must be one of {COLLECTION_MODES}, got {mode!r}")
        if fixed is not None and mode != implied:
            raise ValueError(f"the decision sets collection_enabled={str(fixed).lower()} but the collection mode "
                             f"is {mode!r}: set only one of them")
        return mode

    @model_validator(mode="after")
    def _ema_horizons(self) -> ControllerSettings:
        if not 0 < self.ema_short < self.ema_long:
            short, long = (env_names(type(self), n)[0] for n in ("ema_short", "ema_long"))
            raise ValueError(f"need 0 < EMA short {short} ({self.ema_short}) < EMA long {long} ({self.ema_long})")
        return self

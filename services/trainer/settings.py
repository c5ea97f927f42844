"""Trainer-service settings: one frozen object built once from the environment, passed explicitly.

Every variable (all optional), its type, default and meaning is a field of `TrainerSettings`; the
table in docs/configuration.md is generated from it (tools/gen_config_docs.py). Besides its own
`TIDE_TRAINER_*` variables the trainer reads TIDE_TARGET, TIDE_REGISTRY_ADDR, TIDE_CONTROLLER_ADDR,
TIDE_ADMIN_TOKEN, TIDE_LOG_LEVEL and the storage variables (`tide.blobs.StorageSettings`:
TIDE_S3_*, TIDE_REDIS_URL, TIDE_STREAM_PREFIX).
"""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field
from pydantic_settings import SettingsConfigDict

from tide.blobs import StorageSettings
from tide.grpcutil import ADMIN_TOKEN_ENV
from tide.registry_client import DEFAULT_REGISTRY_ADDR, REGISTRY_ADDR_ENV
from tide.settings import (
    TARGET_ENV,
    Address,
    Count,
    CpuSet,
    CpuSetMixin,
    Doc,
    Flag,
    ListenAddress,
    ListenHostMixin,
    LogLevel,
    NonNegative,
    OptionalAddress,
    OptionalCount,
    Port,
    Secret,
    TideSettings,
    above,
    at_least,
    check,
    finite_at_least,
    log_level_field,
    shown_default,
    within,
)

DEFAULT_LISTEN = "127.0.0.1:50054"
TRAINER_ADDR_ENV = "TIDE_TRAINER_ADDR"  # how clients (tidectl, tests) reach the trainer

Device = Annotated[str, check(lambda v: v in ("auto", "cpu", "cuda") or v.startswith("cuda:"),
                              "auto, cpu, cuda or cuda:N")]
Prefix = Annotated[str, AfterValidator(lambda v: v.strip("/")), check(bool, "non-empty"),
                   Doc("S3 key prefix")]
PositiveFinite = Annotated[float, check(lambda v: 0 < v < float("inf"), "finite and > 0")]
Share = Annotated[float, within(0, 1)]
Extent = Annotated[float, finite_at_least(0)]


class TrainerSettings(ListenHostMixin, CpuSetMixin, TideSettings):
    """Everything the trainer service is configured with."""

    model_config = SettingsConfigDict(env_prefix="TIDE_TRAINER_", str_strip_whitespace=True)

    listen: ListenAddress = Field(DEFAULT_LISTEN, description="gRPC host:port (compose: 0.0.0.0:50054)")
    metrics_port: Port = Field(9404, description="Prometheus HTTP port on the listen host; 0 = off")
    target: str = Field("ref", validation_alias=TARGET_ENV, description='target whose drafts this trainer trains '
                        '("ref", a HF directory, a .gguf file)')
    device: Device = Field("auto", description="device of the training runs (auto: CUDA when present)")
    consumer: Annotated[str, check(bool, "non-empty")] = Field(
        default_factory=socket.gethostname, json_schema_extra=shown_default("hostname"),
        description="consumer name in the chunk stream's group")
    claim_idle_ms: Count = Field(120_000, description="take over chunk entries pending this long (ms; more than "
                                 "one chunk's handling)")
    prefix: Prefix = Field("trainer", description="S3 key prefix of the manifest and run records")
    reconcile_interval_s: Extent = Field(60.0, description="how often the reconciler looks for chunk blobs no stream "
                                         "entry names (a worker died between blob and reference), seconds (also at "
                                         "start): it re-enqueues valid ones and dead-letters corrupt ones; 0 = off")
    reconcile_grace_s: Extent = Field(120.0, description="the reconciler leaves blobs younger than this alone, "
                                      "seconds (their references may still come)")
    reconcile_prefix: Prefix = Field("chunks", description="S3 key prefix the workers write chunk blobs under "
                                     "(their TIDE_CHUNK_PREFIX)")
    # the governed chunk store (governance.py, docs/data-handling.md)
    chunk_retention_h: Annotated[float, finite_at_least(0)] = Field(
        24.0, validation_alias="TIDE_CHUNK_RETENTION_H",
        description="hours a consumed chunk (one a recorded run trained on) is kept after it was stored; the chunk "
        "stream's acked entries are trimmed after as long")
    chunk_unconsumed_retention_h: Annotated[float, finite_at_least(0)] = Field(
        168.0, validation_alias="TIDE_CHUNK_UNCONSUMED_RETENTION_H",
        description="hours any other chunk is kept (never trained on: collected while training was off or "
        "behind); dead letters are trimmed after as long")
    chunk_bucket_bytes: NonNegative = Field(
        8 << 30, validation_alias="TIDE_CHUNK_BUCKET_BYTES",
        description="byte budget of the chunk blobs in the bucket (under TIDE_TRAINER_RECONCILE_PREFIX): the oldest "
        "are deleted while they add up to more; 0 = no budget")
    sweep_interval_s: Extent = Field(60.0, description="how often retention and the byte budget are applied, "
                                     "seconds; 0 = never (no deletion at all)")
    work_dir: str = Field(default_factory=lambda: str(Path(tempfile.gettempdir()) / "tide-trainer"),
                          json_schema_extra=shown_default("`<tmp>/tide-trainer`"),
                          description="local directory for run outputs")
    # A run's data grows with the traffic buffered while it waits; the fixed part with the target's
    # size (an 8B target's draft and head are ~6 GB to train): services/trainer/memory_budget.py.
    memory_mb: OptionalCount = Field(
        None, json_schema_extra=shown_default("50% of the memory available when the run starts"),
        description="memory budget (MiB) of a training run: the target's head, the draft with its optimizer, a "
        "batch's activations and the chunks' hidden states; a run takes the oldest buffered chunks that fit (the "
        "rest stay buffered) and does not start where the fixed part alone does not fit")
    min_tokens: NonNegative = Field(16_384, description="buffered tokens a run needs unless forced")
    min_tokens_growth: Annotated[float, at_least(0)] = Field(
        0.0, description="automatic runs also wait for this multiple of the tokens earlier runs trained on (cycles "
        "that grow with the data; 0.5: each cycle adds half as much again); 0 = TIDE_TRAINER_MIN_TOKENS alone")
    auto_train: Flag = Field(True, description="1: start a run by itself once TIDE_TRAINER_MIN_TOKENS are "
                             "buffered; 0: only TriggerTraining")
    auto_check_s: PositiveFinite = Field(5.0, description="how often the automatic trigger looks, seconds (also "
                                         "right after each intake)")
    steps: NonNegative = Field(0, description="optimizer steps per run; 0 = TIDE_TRAINER_EPOCHS passes")
    epochs: Annotated[float, above(0)] = Field(1.0, description="passes over the data when steps is 0")
    batch_rows: Count = Field(8, description="packed rows per batch")
    lr: PositiveFinite = Field(3e-4, description="peak learning rate (AdamW, warm-up then cosine)")
    warmup_steps: NonNegative = Field(20, description="learning-rate warm-up steps")
    max_len: Count = Field(512, description="tokens per packed row")
    draft_vocab: Count = Field(8192, description="draft vocabulary of from-scratch drafts")
    eval_fraction: Annotated[float, check(lambda v: 0 < v < 1, "in (0, 1)")] = Field(
        0.1, description="share of the chunks held out for evaluation")
    eval_history_tokens: NonNegative = Field(
        8192, description="earlier runs' held-out chunks, newest first, up to this many tokens, join each run's "
        "eval set (a small cycle's own held-out tenth is too few tokens to judge a candidate by); 0 = off")
    replay: Annotated[float, at_least(0)] = Field(
        1.0, description="chunks of earlier runs mixed into each run, as a multiple of the new chunks' tokens "
        "(rehearsal: fine-tuning on the newest domain alone forgets the others); 0 = off")
    replay_recent: Share = Field(0.0, description="share of the replayed tokens taken from the newest earlier "
                                 "chunks, the rest sampled over the whole history")
    max_epochs: Extent = Field(0.0, description="with TIDE_TRAINER_STEPS: at most this many passes over a run's "
                               "data (a step budget on a few chunks memorises them); 0 = no cap")
    # the training library evaluates γ = 1..5
    eval_gamma: Annotated[int, within(1, 5)] = Field(3, description="γ (1-5) at which candidate and base are "
                                                     "compared: the served accept length (tokens per verification "
                                                     "along the engine's walk)")
    promote_margin: Extent = Field(0.02, description="promote when candidate - base >= this (tokens per step; no "
                                   "base: against 1.0)")
    latency_profile: str = Field(
        "", json_schema_extra=shown_default("the newest EAGLE-3 profile cached here, else the reference CPU's"),
        description="LatencyProfile JSON whose batch-1 step costs turn accept lengths into predicted speed-ups: a "
        "candidate is promoted only if it predicts one over what serves now (promotion.py)")
    auto_promote: Flag = Field(True, description="1: promote a candidate that beats the margin; 0: register only "
                               "(promote by hand: `tidectl drafts promote VERSION`)")
    seed: int = Field(0, description="training seed")
    cpus: CpuSet = Field("", description="CPUs the trainer may use (affinity, and torch threads = their count)")
    nice: Annotated[int, within(0, 19)] = Field(
        0, description="nice increment (0-19: an increment; lowering priority needs no privilege) applied at start. "
        "Where the trainer shares a machine with inference workers (`tide up` on one small machine) use a high "
        "value (tide up sets 10) so training never slows serving. It only ranks threads of one scheduler group: "
        "between containers (cgroups) or sessions (autogroups) give the trainer's group a low CPU weight "
        "instead (docker-compose.yml: cpu_shares)")
    registry_addr: Address = Field(DEFAULT_REGISTRY_ADDR, validation_alias=REGISTRY_ADDR_ENV,
                                   description="draft registry host:port: base drafts, registration, promotion")
    controller_addr: OptionalAddress = Field("", validation_alias="TIDE_CONTROLLER_ADDR",
                                             description="controller host:port to report outcomes to; empty = none")
    admin_token: Secret = Field(None, validation_alias=ADMIN_TOKEN_ENV,
                                description="bearer token for TriggerTraining, the registry and the controller")
    storage: StorageSettings = Field(default_factory=StorageSettings, description="S3 (chunks, drafts) and Redis")
    log_level: LogLevel = log_level_field()

"""Inference-service settings: one frozen object built once from the environment, passed explicitly.

Environment variables (all optional; defaults in brackets):

    TIDE_TARGET               target model: "ref", a HF directory or a .gguf file            ["ref"]
    TIDE_DTYPE                auto | bf16 | fp16 | fp32; auto = bf16 where the device computes
                              it natively, else fp32 (tide/precision.py)                      [auto]
    TIDE_DEVICE               cpu | cuda | cuda:N                                              [cpu]
    TIDE_CPUS                 CPUs this worker runs on, e.g. "0" or "0-5" (affinity, and torch
                              threads = their count; keep the trainer's TIDE_TRAINER_CPUS apart;
                              `tide up` starts its other services on the remaining CPUs)   [all]
    TIDE_MAX_BATCH            KV-cache slots = most sequences decoded per step                 [16]
    TIDE_MAX_SEQ_LEN          prompt + output tokens per sequence                              [2048]
    TIDE_MAX_TOKENS_PER_STEP  prefill token budget per step                                    [512]
    TIDE_MAX_GAMMA            hard cap on draft tokens per request per step                    [8]
    TIDE_MAX_QUEUE            requests that may wait beyond max batch before RESOURCE_EXHAUSTED [64]
    TIDE_LISTEN               gRPC "host:port"                                                 [127.0.0.1:50051]
    TIDE_METRICS_PORT         Prometheus HTTP port on the listen host; 0 = off                 [9101]
    TIDE_WORKER_ID            worker id in telemetry and chunks                                [hostname-pid]
    TIDE_DRAFTER              ngram | none | eagle3: the registry's current draft for the target
                              (n-gram until one loads; see drafts.py)                          [ngram]
    TIDE_REGISTRY_ADDR        draft registry gRPC "host:port" (watched while "eagle3" is used) [127.0.0.1:50055]
    TIDE_DRAFT_CACHE_DIR      where registry drafts are downloaded         [$TIDE_CACHE_DIR/drafts]
    TIDE_POLICY               γ policy name (tide.policies.registry.POLICY_NAMES)              [static]
    TIDE_POLICY_PARAMS        JSON object: the policy's keyword arguments                      [{"gamma": 3}]
    TIDE_LATENCY_PROFILE      path of a LatencyProfile JSON for policies that need one        [none]
    TIDE_PROFILE_AT_START     auto | 1 | 0: measure T(b, n), D(b) at start when no profile file is
                              given (auto: for policies that take a profile; see profiling.py)  [auto]
    TIDE_PROFILE_CACHE_DIR    where measured profiles are cached             [$TIDE_CACHE_DIR/profiles]
    TIDE_FORCED_GAMMA         γ for requests with speculative=true where the policy says 0     [3]
    TIDE_COLLECTION           1/0: hidden-state export on at start                             [0]
    TIDE_CHUNK_TOKENS         rows per hidden-state chunk                                      [2048]
    TIDE_CHUNK_BUFFERS        preallocated chunk buffers (bounds exporter memory)              [3]
    TIDE_FLUSH_INTERVAL_S     flush a partial chunk after this many seconds                    [30]
    TIDE_CHUNK_PREFIX         S3 key prefix for chunk blobs                                    [chunks]
    TIDE_TELEMETRY_BATCH      step records per XADD pipeline                                   [64]
    TIDE_TELEMETRY_INTERVAL_S seconds between telemetry flushes                                [0.5]
    TIDE_TELEMETRY_BUFFER     step records kept while Redis is unreachable (oldest dropped)    [10000]
    TIDE_SEED                 RNG seed for sampled requests without their own seed             [0]
    TIDE_ADMIN_TOKEN          bearer token for ApplyDecision (unset = admin calls refused)
    TIDE_S3_* / TIDE_REDIS_URL / TIDE_STREAM_PREFIX   see tide.blobs.StorageSettings
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field
from types import MappingProxyType
from typing import Any

from tide.blobs import StorageSettings
from tide.grpcutil import ADMIN_TOKEN_ENV
from tide.precision import DTYPE_NAMES
from tide.registry_client import DEFAULT_REGISTRY_ADDR, REGISTRY_ADDR_ENV
from tide.resources import parse_cpus

DRAFTERS = ("ngram", "none", "eagle3")


def _bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {value!r}")


@dataclass(frozen=True)
class InferenceSettings:
    """Everything the inference service is configured with. Times in seconds; sizes in tokens/slots."""

    target: str = "ref"
    dtype: str = "auto"
    device: str = "cpu"
    cpus: str = ""  # "" = every CPU the process may use
    max_batch: int = 16
    max_seq_len: int = 2048
    max_tokens_per_step: int = 512
    max_gamma: int = 8
    max_queue: int = 64
    listen: str = "127.0.0.1:50051"
    metrics_port: int = 9101
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    drafter: str = "ngram"
    registry_addr: str = DEFAULT_REGISTRY_ADDR
    draft_cache_dir: str = ""  # "" = tide.target.cache_dir() / "drafts"
    policy: str = "static"
    policy_params: Mapping[str, Any] = field(default_factory=lambda: {"gamma": 3})
    latency_profile: str = ""
    profile_at_start: str = "auto"
    profile_cache_dir: str = ""
    forced_gamma: int = 3
    collection: bool = False
    chunk_tokens: int = 2048
    chunk_buffers: int = 3
    flush_interval_s: float = 30.0
    chunk_prefix: str = "chunks"
    telemetry_batch: int = 64
    telemetry_interval_s: float = 0.5
    telemetry_buffer: int = 10_000
    seed: int = 0
    admin_token: str | None = field(default=None, repr=False)
    storage: StorageSettings = field(default_factory=StorageSettings)

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"TIDE_DRAFTER must be one of {DRAFTERS}, got {self.drafter!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"TIDE_DTYPE must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        for name in ("max_batch", "max_seq_len", "max_tokens_per_step", "chunk_tokens", "chunk_buffers",
                     "telemetry_batch", "telemetry_buffer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_gamma", "max_queue", "forced_gamma", "metrics_port"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.flush_interval_s <= 0 or self.telemetry_interval_s <= 0:
            raise ValueError("flush and telemetry intervals must be > 0 seconds")
        if self.profile_at_start.strip().lower() not in ("auto", "", "1", "0", "true", "false", "yes", "no", "on",
                                                          "off"):
            raise ValueError(f"TIDE_PROFILE_AT_START must be auto, 1 or 0, got {self.profile_at_start!r}")
        parse_cpus(self.cpus)  # ValueError when malformed
        if not isinstance(self.policy_params, Mapping):
            raise ValueError("TIDE_POLICY_PARAMS must be a JSON object")
        # A read-only copy: the settings object is shared and must never change.
        object.__setattr__(self, "policy_params", MappingProxyType(dict(self.policy_params)))

    @property
    def torch_dtype(self):
        """The dtype the target and draft run in ("auto" resolved for the device)."""
        from tide.precision import resolve_dtype

        return resolve_dtype(self.dtype, self.device)

    @property
    def cpu_set(self) -> frozenset[int]:
        """CPUs of TIDE_CPUS (empty: all)."""
        return parse_cpus(self.cpus)

    @property
    def listen_host(self) -> str:
        return self.listen.rsplit(":", 1)[0]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> InferenceSettings:
        env = os.environ if env is None else env
        d = cls.__dataclass_fields__

        def get(name: str, key: str, conv=str):
            raw = env.get(key)
            if raw is None or raw == "":
                f = d[name]
                return f.default if f.default_factory is MISSING else f.default_factory()
            try:
                return conv(raw)
            except ValueError as e:
                raise ValueError(f"{key}={raw!r}: {e}") from None

        return cls(
            target=get("target", "TIDE_TARGET"),
            dtype=get("dtype", "TIDE_DTYPE"),
            device=get("device", "TIDE_DEVICE"),
            cpus=get("cpus", "TIDE_CPUS"),
            max_batch=get("max_batch", "TIDE_MAX_BATCH", int),
            max_seq_len=get("max_seq_len", "TIDE_MAX_SEQ_LEN", int),
            max_tokens_per_step=get("max_tokens_per_step", "TIDE_MAX_TOKENS_PER_STEP", int),
            max_gamma=get("max_gamma", "TIDE_MAX_GAMMA", int),
            max_queue=get("max_queue", "TIDE_MAX_QUEUE", int),
            listen=get("listen", "TIDE_LISTEN"),
            metrics_port=get("metrics_port", "TIDE_METRICS_PORT", int),
            worker_id=get("worker_id", "TIDE_WORKER_ID"),
            drafter=get("drafter", "TIDE_DRAFTER"),
            registry_addr=get("registry_addr", REGISTRY_ADDR_ENV),
            draft_cache_dir=get("draft_cache_dir", "TIDE_DRAFT_CACHE_DIR"),
            policy=get("policy", "TIDE_POLICY"),
            policy_params=get("policy_params", "TIDE_POLICY_PARAMS", json.loads),
            latency_profile=get("latency_profile", "TIDE_LATENCY_PROFILE"),
            profile_at_start=get("profile_at_start", "TIDE_PROFILE_AT_START"),
            profile_cache_dir=get("profile_cache_dir", "TIDE_PROFILE_CACHE_DIR"),
            forced_gamma=get("forced_gamma", "TIDE_FORCED_GAMMA", int),
            collection=get("collection", "TIDE_COLLECTION", _bool),
            chunk_tokens=get("chunk_tokens", "TIDE_CHUNK_TOKENS", int),
            chunk_buffers=get("chunk_buffers", "TIDE_CHUNK_BUFFERS", int),
            flush_interval_s=get("flush_interval_s", "TIDE_FLUSH_INTERVAL_S", float),
            chunk_prefix=get("chunk_prefix", "TIDE_CHUNK_PREFIX"),
            telemetry_batch=get("telemetry_batch", "TIDE_TELEMETRY_BATCH", int),
            telemetry_interval_s=get("telemetry_interval_s", "TIDE_TELEMETRY_INTERVAL_S", float),
            telemetry_buffer=get("telemetry_buffer", "TIDE_TELEMETRY_BUFFER", int),
            seed=get("seed", "TIDE_SEED", int),
            admin_token=env.get(ADMIN_TOKEN_ENV) or None,
            storage=StorageSettings.from_env(env),
        )

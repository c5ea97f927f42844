"""Trainer-service settings: one frozen object built once from the environment, passed explicitly.

Environment variables (all optional; defaults in brackets):

    TIDE_TRAINER_LISTEN          gRPC "host:port" (compose: 0.0.0.0:50054)                 [127.0.0.1:50054]
    TIDE_TRAINER_METRICS_PORT    Prometheus HTTP port on the listen host; 0 = off         [9404]
    TIDE_TARGET                  target whose drafts this trainer trains ("ref", a HF dir, a .gguf) [ref]
    TIDE_TRAINER_DEVICE          auto | cpu | cuda | cuda:N (auto: CUDA when present)      [auto]
    TIDE_TRAINER_CONSUMER        consumer name in the chunk stream's group                [hostname]
    TIDE_TRAINER_CLAIM_IDLE_MS   take over chunk entries pending this long (> one chunk's handling) [120000]
    TIDE_TRAINER_PREFIX          S3 key prefix of the manifest and run records            [trainer]
    TIDE_TRAINER_WORK_DIR        local directory for run outputs                          [<tmp>/tide-trainer]
    TIDE_TRAINER_MIN_TOKENS      buffered tokens a run needs unless forced                [16384]
    TIDE_TRAINER_AUTO_TRAIN      1: start a run by itself once MIN_TOKENS are buffered; 0: only TriggerTraining [1]
    TIDE_TRAINER_AUTO_CHECK_S    how often the automatic trigger looks (also right after each intake) [5]
    TIDE_TRAINER_STEPS           optimizer steps per run; 0 = TIDE_TRAINER_EPOCHS passes    [0]
    TIDE_TRAINER_EPOCHS          passes over the data when steps is 0                     [1]
    TIDE_TRAINER_BATCH_ROWS      packed rows per batch                                    [8]
    TIDE_TRAINER_LR              peak learning rate (AdamW, warm-up then cosine)           [3e-4]
    TIDE_TRAINER_WARMUP_STEPS    learning-rate warm-up steps                              [20]
    TIDE_TRAINER_MAX_LEN         tokens per packed row                                    [512]
    TIDE_TRAINER_DRAFT_VOCAB     draft vocabulary of from-scratch drafts                  [8192]
    TIDE_TRAINER_EVAL_FRACTION   share of the chunks held out for evaluation              [0.1]
    TIDE_TRAINER_REPLAY          chunks of earlier runs mixed into each run, as a multiple of the new
                                 chunks' tokens (rehearsal: fine-tuning on the newest domain alone
                                 forgets the others); 0 = off                              [1]
    TIDE_TRAINER_REPLAY_RECENT   share (0-1) of the replayed tokens taken from the newest earlier
                                 chunks, the rest sampled over the whole history            [0]
    TIDE_TRAINER_MAX_EPOCHS      with TIDE_TRAINER_STEPS: at most this many passes over a run's
                                 data (a step budget on a few chunks memorises them); 0 = no cap [0]
    TIDE_TRAINER_EVAL_GAMMA      γ (1-5) at which candidate and base are compared: the served accept
                                 length (tokens per verification along the engine's walk)  [3]
    TIDE_TRAINER_PROMOTE_MARGIN  promote when candidate - base >= this (tokens/step; no base: vs 1.0) [0.02]
    TIDE_TRAINER_AUTO_PROMOTE    1: promote a candidate that beats the margin; 0: register only
                                 (promote by hand: `tidectl drafts promote VERSION`)          [1]
    TIDE_TRAINER_SEED            training seed                                            [0]
    TIDE_TRAINER_CPUS            CPUs the trainer may use, e.g. "1", "2-3", "0,2-3" (affinity, and torch
                                 threads = their count); empty = all                      [all]
    TIDE_TRAINER_NICE            nice increment (0-19) applied at start. Where the trainer shares a
                                 machine with inference workers (`tide up` on one small machine) use a
                                 high value (tide up sets 10) so training never slows serving [0]
    TIDE_REGISTRY_ADDR           draft registry host:port: base drafts, registration, promotion [127.0.0.1:50055]
    TIDE_CONTROLLER_ADDR         controller host:port to report outcomes to; empty = none [none]
    TIDE_ADMIN_TOKEN             bearer token for TriggerTraining, the registry and the controller
    TIDE_S3_* / TIDE_REDIS_URL / TIDE_STREAM_PREFIX   see tide.blobs.StorageSettings
    TIDE_LOG_LEVEL               log level of the JSON logs                               [INFO]
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tide.blobs import StorageSettings
from tide.grpcutil import ADMIN_TOKEN_ENV
from tide.registry_client import DEFAULT_REGISTRY_ADDR, REGISTRY_ADDR_ENV
from tide.resources import parse_cpus

DEFAULT_LISTEN = "127.0.0.1:50054"
TRAINER_ADDR_ENV = "TIDE_TRAINER_ADDR"  # how clients (tidectl, tests) reach the trainer


def _address(value: str, allow_zero: bool = False) -> str:
    """`value` if it is host:port (port 0 = any free port, only where `allow_zero`)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if allow_zero else 1) <= int(port) < 65536:
        raise ValueError(f"expected host:port, got {value!r}")
    return value


def _flag(value: str) -> bool:
    v = value.lower()
    if v not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        raise ValueError("expected 1 or 0")
    return v in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class TrainerSettings:
    listen: str = DEFAULT_LISTEN
    metrics_port: int = 9404
    target: str = "ref"
    device: str = "auto"
    consumer: str = field(default_factory=socket.gethostname)
    claim_idle_ms: int = 120_000
    prefix: str = "trainer"
    work_dir: str = field(default_factory=lambda: str(Path(tempfile.gettempdir()) / "tide-trainer"))
    min_tokens: int = 16_384
    auto_train: bool = True
    auto_check_s: float = 5.0
    steps: int = 0
    epochs: float = 1.0
    batch_rows: int = 8
    lr: float = 3e-4
    warmup_steps: int = 20
    max_len: int = 512
    draft_vocab: int = 8192
    eval_fraction: float = 0.1
    replay: float = 1.0
    replay_recent: float = 0.0
    max_epochs: float = 0.0
    eval_gamma: int = 3
    promote_margin: float = 0.02
    auto_promote: bool = True
    seed: int = 0
    cpus: str = ""
    nice: int = 0
    registry_addr: str = DEFAULT_REGISTRY_ADDR
    controller_addr: str = ""
    admin_token: str | None = field(default=None, repr=False)
    storage: StorageSettings = field(default_factory=StorageSettings)
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        _address(self.listen, allow_zero=True)
        _address(self.registry_addr)
        if self.controller_addr:
            _address(self.controller_addr)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"TIDE_TRAINER_DEVICE must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("batch_rows", "max_len", "draft_vocab", "claim_idle_ms", "eval_gamma"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "min_tokens", "metrics_port", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 1 <= self.eval_gamma <= 5:  # the training library evaluates γ = 1..5
            raise ValueError(f"eval_gamma must be in 1..5, got {self.eval_gamma}")
        if not (0 <= self.promote_margin < float("inf")):
            raise ValueError(f"promote_margin must be a finite number >= 0, got {self.promote_margin}")
        if not (0 < self.lr < float("inf")) or not (0 < self.auto_check_s < float("inf")):
            raise ValueError("lr and auto_check_s must be finite and > 0")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"nice must be in 0..19 (an increment; lowering priority needs no privilege), "
                             f"got {self.nice}")
        parse_cpus(self.cpus)
        if self.replay < 0:
            raise ValueError(f"TIDE_TRAINER_REPLAY must be >= 0, got {self.replay}")
        if not 0 <= self.replay_recent <= 1:
            raise ValueError(f"TIDE_TRAINER_REPLAY_RECENT must be in [0, 1], got {self.replay_recent}")
        if not 0 <= self.max_epochs < float("inf"):
            raise ValueError(f"TIDE_TRAINER_MAX_EPOCHS must be a finite number >= 0, got {self.max_epochs}")
        if not 0 < self.eval_fraction < 1 or self.epochs <= 0:
            raise ValueError("eval fraction must be in (0, 1) and epochs > 0")
        if not self.prefix.strip("/") or not self.consumer:
            raise ValueError("the S3 prefix and the consumer name must not be empty")

    @property
    def cpu_set(self) -> frozenset[int]:
        """CPUs of TIDE_TRAINER_CPUS (empty: all)."""
        return parse_cpus(self.cpus)

    @property
    def listen_host(self) -> str:
        return self.listen.rsplit(":", 1)[0]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TrainerSettings:
        """Build from the environment (or `env`); raises ValueError naming the bad variable."""
        env = os.environ if env is None else env
        d = cls()

        def get(key: str, name: str, conv=str):
            raw = env.get(key)
            if raw is None or raw.strip() == "":
                return getattr(d, name)
            try:
                return conv(raw.strip())
            except ValueError as e:
                raise ValueError(f"{key}={raw!r}: {e}") from None

        return cls(
            listen=get("TIDE_TRAINER_LISTEN", "listen"),
            metrics_port=get("TIDE_TRAINER_METRICS_PORT", "metrics_port", int),
            target=get("TIDE_TARGET", "target"),
            device=get("TIDE_TRAINER_DEVICE", "device"),
            consumer=get("TIDE_TRAINER_CONSUMER", "consumer"),
            claim_idle_ms=get("TIDE_TRAINER_CLAIM_IDLE_MS", "claim_idle_ms", int),
            prefix=get("TIDE_TRAINER_PREFIX", "prefix").strip("/"),
            work_dir=get("TIDE_TRAINER_WORK_DIR", "work_dir"),
            min_tokens=get("TIDE_TRAINER_MIN_TOKENS", "min_tokens", int),
            auto_train=get("TIDE_TRAINER_AUTO_TRAIN", "auto_train", _flag),
            auto_check_s=get("TIDE_TRAINER_AUTO_CHECK_S", "auto_check_s", float),
            steps=get("TIDE_TRAINER_STEPS", "steps", int),
            epochs=get("TIDE_TRAINER_EPOCHS", "epochs", float),
            batch_rows=get("TIDE_TRAINER_BATCH_ROWS", "batch_rows", int),
            lr=get("TIDE_TRAINER_LR", "lr", float),
            warmup_steps=get("TIDE_TRAINER_WARMUP_STEPS", "warmup_steps", int),
            max_len=get("TIDE_TRAINER_MAX_LEN", "max_len", int),
            draft_vocab=get("TIDE_TRAINER_DRAFT_VOCAB", "draft_vocab", int),
            eval_fraction=get("TIDE_TRAINER_EVAL_FRACTION", "eval_fraction", float),
            replay=get("TIDE_TRAINER_REPLAY", "replay", float),
            replay_recent=get("TIDE_TRAINER_REPLAY_RECENT", "replay_recent", float),
            max_epochs=get("TIDE_TRAINER_MAX_EPOCHS", "max_epochs", float),
            eval_gamma=get("TIDE_TRAINER_EVAL_GAMMA", "eval_gamma", int),
            promote_margin=get("TIDE_TRAINER_PROMOTE_MARGIN", "promote_margin", float),
            auto_promote=get("TIDE_TRAINER_AUTO_PROMOTE", "auto_promote", _flag),
            seed=get("TIDE_TRAINER_SEED", "seed", int),
            cpus=get("TIDE_TRAINER_CPUS", "cpus"),
            nice=get("TIDE_TRAINER_NICE", "nice", int),
            registry_addr=get(REGISTRY_ADDR_ENV, "registry_addr"),
            controller_addr=get("TIDE_CONTROLLER_ADDR", "controller_addr"),
            admin_token=env.get(ADMIN_TOKEN_ENV) or None,
            storage=StorageSettings.from_env(env),
            log_level=get("TIDE_LOG_LEVEL", "log_level").upper(),
        )

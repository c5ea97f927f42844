"""Controller settings: one frozen object built once from the environment, passed explicitly.

Environment variables (all optional; defaults in brackets):

    TIDE_CONTROLLER_LISTEN         gRPC "host:port" (compose: 0.0.0.0:50053)              [127.0.0.1:50053]
    TIDE_CONTROLLER_METRICS_PORT   Prometheus HTTP port on the listen host; 0 = off      [9403]
    TIDE_CONTROLLER_WORKERS        comma list of worker host:port to push decisions to, besides the
                                   workers that call RegisterWorker                       [none]
    TIDE_CONTROLLER_DECISION       the static decision as JSON (see decisions.py)         [speculation on, static γ=3]
    TIDE_CONTROLLER_RECONCILE_S    seconds between rounds of worker status checks / pushes [2]
    TIDE_CONTROLLER_RPC_TIMEOUT_S  deadline of GetStatus / ApplyDecision calls to workers [10]
    TIDE_CONTROLLER_CONSUMER       consumer name in the telemetry stream's group          [hostname]
    TIDE_CONTROLLER_CLAIM_IDLE_MS  take over telemetry entries pending this long          [30000]
    TIDE_CONTROLLER_EMA_SHORT      short acceptance EMA horizon (observations)            [50]
    TIDE_CONTROLLER_EMA_LONG       long acceptance EMA horizon (observations)             [1000]
    TIDE_CONTROLLER_LOAD_WINDOW_S  window of the per-worker load statistics               [30]
  Collection control (TIDE Algorithm 1, collection.py):
    TIDE_CONTROLLER_COLLECTION     auto (Algorithm 1) | on | off (forced)                 [auto; on / off when
                                   TIDE_CONTROLLER_DECISION sets collection_enabled true / false]
    TIDE_CONTROLLER_SHIFT_EPSILON  shift when the short EMA of the acceptance rate per checked draft
                                   token is below the long one by more than this (0..1)  [0.15]
    TIDE_CONTROLLER_COLD_ACCEPT    a serving draft whose long accept-length EMA is below this is weak:
                                   cold start (tokens per verification)                  [1.3]
    TIDE_CONTROLLER_MIN_OBSERVATIONS  verifications of a version before its EMAs are judged [50]
    TIDE_CONTROLLER_NO_GAIN_RUNS   consecutive training runs without gain that turn collection off [2]
    TIDE_CONTROLLER_GAIN_MARGIN    eval accept-length gain a promoted run needs to count as a gain [0.02]
    TIDE_CONTROLLER_TOKENS_NEEDED  tokens to collect for a training run (shown in GetState) [16384]
  Automatic rollback (rollback.py):
    TIDE_CONTROLLER_AUTO_ROLLBACK  1 = roll back a promoted draft that accepts worse live  [1]
    TIDE_CONTROLLER_ROLLBACK_WINDOW   verifications of the new version before judging it, and of the
                                   previous version (its last ones before the takeover) to judge by [200]
    TIDE_CONTROLLER_ROLLBACK_MARGIN   roll back when its live acceptance rate per checked draft token
                                   (0..1; it does not move with γ, the accept length does) is below
                                   the previous version's over its window by more than this [0.05]
    TIDE_CONTROLLER_ROLLBACK_Z     ... and by more than this many standard errors of the difference
                                   (a window is a few seconds of traffic; 0 = the margin alone) [3]
    TIDE_REGISTRY_ADDR             the registry (host:port) rollbacks go to; unset = no rollback [unset]
    TIDE_ADMIN_TOKEN               bearer token: required by this service's admin RPCs and sent
                                   with ApplyDecision to the workers (unset: admin calls refused)
    TIDE_REDIS_URL / TIDE_STREAM_PREFIX   see tide.blobs.StorageSettings
    TIDE_LOG_LEVEL                 log level of the JSON logs                             [INFO]
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.controller.decisions import DEFAULT_DECISION_JSON, StaticDecision
from tide.blobs import StorageSettings
from tide.grpcutil import ADMIN_TOKEN_ENV
from tide.registry_client import REGISTRY_ADDR_ENV

DEFAULT_LISTEN = "127.0.0.1:50053"
CONTROLLER_ADDR_ENV = "TIDE_CONTROLLER_ADDR"  # how other services (the trainer) reach the controller
COLLECTION_MODES = ("auto", "on", "off")


def _flag(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1 or 0")


def _address(value: str, allow_zero: bool = False) -> str:
    """`value` if it is host:port (port 0 = any free port, only where `allow_zero`)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if allow_zero else 1) <= int(port) < 65536:
        raise ValueError(f"expected host:port, got {value!r}")
    return value


@dataclass(frozen=True)
class ControllerSettings:
    """Everything the controller is configured with. Times in seconds unless the name says ms."""

    listen: str = DEFAULT_LISTEN
    metrics_port: int = 9403
    workers: tuple[str, ...] = ()
    decision: StaticDecision = field(default_factory=StaticDecision)
    reconcile_s: float = 2.0
    rpc_timeout_s: float = 10.0
    consumer: str = field(default_factory=socket.gethostname)
    claim_idle_ms: int = 30_000
    ema_short: float = 50.0
    ema_long: float = 1000.0
    load_window_s: float = 30.0
    collection_mode: str = ""  # "" = from the decision's collection_enabled (auto when it is null)
    shift_epsilon: float = 0.15
    cold_accept: float = 1.3
    min_observations: int = 50
    no_gain_runs: int = 2
    gain_margin: float = 0.02
    tokens_needed: int = 16384
    auto_rollback: bool = True
    rollback_window: int = 200
    rollback_margin: float = 0.05  # acceptance rate per checked draft token (0..1)
    rollback_z: float = 3.0  # standard errors (rollback.standard_error)
    registry_addr: str = ""
    admin_token: str | None = field(default=None, repr=False)
    storage: StorageSettings = field(default_factory=StorageSettings)
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        for a in self.workers:
            _address(a)
        _address(self.listen, allow_zero=True)
        if self.reconcile_s <= 0 or self.rpc_timeout_s <= 0 or self.load_window_s <= 0:
            raise ValueError("reconcile, RPC timeout and load window must be > 0 seconds")
        if not 0 < self.ema_short < self.ema_long:
            raise ValueError(f"need 0 < EMA short ({self.ema_short}) < EMA long ({self.ema_long})")
        if self.claim_idle_ms < 1 or self.metrics_port < 0 or not self.consumer:
            raise ValueError("claim idle must be >= 1 ms, metrics port >= 0 and the consumer name non-empty")
        self._check_collection()
        if self.rollback_window < 1 or not 0 <= self.rollback_margin < 1 or not 0 <= self.rollback_z < float("inf"):
            raise ValueError("rollback window must be >= 1 verification, the rollback margin (an acceptance "
                             "rate) in [0, 1) and the rollback z a finite number >= 0")
        if self.registry_addr:
            _address(self.registry_addr)

    def _check_collection(self) -> None:
        fixed = self.decision.collection_enabled
        implied = "auto" if fixed is None else ("on" if fixed else "off")
        mode = self.collection_mode or implied
        if mode not in COLLECTION_MODES:
            raise ValueError(f"collection mode must be one of {COLLECTION_MODES}, got {mode!r}")
        if fixed is not None and mode != implied:
            raise ValueError(f"the decision sets collection_enabled={str(fixed).lower()} but the collection mode "
                             f"is {mode!r}: set only one of them")
        object.__setattr__(self, "collection_mode", mode)
        if self.shift_epsilon < 0 or self.cold_accept < 0 or self.gain_margin < 0:
            raise ValueError("shift epsilon, cold accept length and gain margin must be >= 0")
        if self.min_observations < 1 or self.no_gain_runs < 1 or self.tokens_needed < 1:
            raise ValueError("min observations, no-gain runs and tokens needed must be >= 1")

    @property
    def listen_host(self) -> str:
        return self.listen.rsplit(":", 1)[0]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ControllerSettings:
        """Build from the environment (or `env`); raises ValueError naming the bad variable."""
        env = os.environ if env is None else env

        def get(key: str, default, conv=str):
            raw = env.get(key)
            if raw is None or raw.strip() == "":
                return default
            try:
                return conv(raw.strip())
            except ValueError as e:
                raise ValueError(f"{key}={raw!r}: {e}") from None

        d = cls()
        return cls(
            listen=get("TIDE_CONTROLLER_LISTEN", d.listen),
            metrics_port=get("TIDE_CONTROLLER_METRICS_PORT", d.metrics_port, int),
            workers=get("TIDE_CONTROLLER_WORKERS", (), lambda s: tuple(p.strip() for p in s.split(",") if p.strip())),
            decision=get("TIDE_CONTROLLER_DECISION", StaticDecision.from_json(DEFAULT_DECISION_JSON),
                         StaticDecision.from_json),
            reconcile_s=get("TIDE_CONTROLLER_RECONCILE_S", d.reconcile_s, float),
            rpc_timeout_s=get("TIDE_CONTROLLER_RPC_TIMEOUT_S", d.rpc_timeout_s, float),
            consumer=get("TIDE_CONTROLLER_CONSUMER", d.consumer),
            claim_idle_ms=get("TIDE_CONTROLLER_CLAIM_IDLE_MS", d.claim_idle_ms, int),
            ema_short=get("TIDE_CONTROLLER_EMA_SHORT", d.ema_short, float),
            ema_long=get("TIDE_CONTROLLER_EMA_LONG", d.ema_long, float),
            load_window_s=get("TIDE_CONTROLLER_LOAD_WINDOW_S", d.load_window_s, float),
            collection_mode=get("TIDE_CONTROLLER_COLLECTION", "", str.lower),
            shift_epsilon=get("TIDE_CONTROLLER_SHIFT_EPSILON", d.shift_epsilon, float),
            cold_accept=get("TIDE_CONTROLLER_COLD_ACCEPT", d.cold_accept, float),
            min_observations=get("TIDE_CONTROLLER_MIN_OBSERVATIONS", d.min_observations, int),
            no_gain_runs=get("TIDE_CONTROLLER_NO_GAIN_RUNS", d.no_gain_runs, int),
            gain_margin=get("TIDE_CONTROLLER_GAIN_MARGIN", d.gain_margin, float),
            tokens_needed=get("TIDE_CONTROLLER_TOKENS_NEEDED", d.tokens_needed, int),
            auto_rollback=get("TIDE_CONTROLLER_AUTO_ROLLBACK", d.auto_rollback, _flag),
            rollback_window=get("TIDE_CONTROLLER_ROLLBACK_WINDOW", d.rollback_window, int),
            rollback_margin=get("TIDE_CONTROLLER_ROLLBACK_MARGIN", d.rollback_margin, float),
            rollback_z=get("TIDE_CONTROLLER_ROLLBACK_Z", d.rollback_z, float),
            registry_addr=get(REGISTRY_ADDR_ENV, ""),
            admin_token=env.get(ADMIN_TOKEN_ENV) or None,
            storage=StorageSettings.from_env(env),
            log_level=get("TIDE_LOG_LEVEL", d.log_level).upper(),
        )

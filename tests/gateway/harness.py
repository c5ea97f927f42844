"""Helpers of the gateway tests: real inference workers (processes) and real gateways (uvicorn threads) on loopback."""

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

import grpc
import httpx
import uvicorn

from services.gateway.app import create_app
from services.gateway.engine_client import GrpcEngineClient
from services.gateway.settings import GatewaySettings
from services.gateway.tokenizer import TargetTokenizer
from tide.grpcutil import channel
from tide.proto.tide.v1 import inference_pb2, inference_pb2_grpc
from tide.servers import free_port

REPO = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 4096  # long enough that a generation can run for seconds while a test acts on it
SHORT_CONTEXT = 64  # the `short_worker`'s context (its TIDE_MAX_SEQ_LEN): no generation on it runs long
MODEL_NAME = "tide-test"


@dataclass
class WorkerProcess:
    """A `python -m services.inference` process (the real inference service) on loopback."""

    proc: subprocess.Popen
    address: str
    log: Path

    def kill(self) -> None:
        """SIGKILL: the worker dies as in a crash, with no chance to drain or say goodbye."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


def worker_status(address: str, timeout_s: float = 5.0) -> inference_pb2.WorkerStatus:
    ch = channel(address)
    try:
        return inference_pb2_grpc.InferenceServiceStub(ch).GetStatus(
            inference_pb2.GetWorkerStatusRequest(), timeout=timeout_s
        )
    finally:
        ch.close()


def start_worker(
    target: Path, log_dir: Path, port: int = 0, timeout_s: float = 120.0, max_seq_len: int = MAX_MODEL_LEN,
    env: dict[str, str] | None = None,
) -> WorkerProcess:
    """Start the inference service for `target` on `port` (0 = a free one) with a context of `max_seq_len`
    tokens and wait until it answers GetStatus. Redis and S3 point at closed ports: the worker serves
    without them (it drops telemetry and chunks, as designed), which is all the gateway needs; `env`
    overrides any variable (e.g. a real Redis and S3)."""
    port = port or free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "TIDE_TARGET": str(target),
        "TIDE_LISTEN": f"127.0.0.1:{port}",
        "TIDE_DTYPE": "fp32",
        "TIDE_MAX_SEQ_LEN": str(max_seq_len),
        "TIDE_MAX_BATCH": "8",
        "TIDE_METRICS_PORT": "0",
        "TIDE_WORKER_ID": f"gateway-test-{port}",
        "TIDE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        "TIDE_S3_ENDPOINT": f"127.0.0.1:{free_port()}",
        "TIDE_SHUTDOWN_GRACE_S": "0",
        **(env or {}),
    }
    log = log_dir / f"worker-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.inference"], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO
        )
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            worker_status(address, timeout_s=1.0)
            return WorkerProcess(proc, address, log)
        except grpc.RpcError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            tail = log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"inference worker did not start (log {log}):\n{tail}")
        time.sleep(0.1)


@contextlib.contextmanager
def serve_gateway(
    tokenizer: TargetTokenizer, workers: tuple[str, ...], wait_ready: bool = True, **overrides
) -> Iterator[str]:
    """Run a gateway on a free loopback port in a thread; yields its base URL ("http://127.0.0.1:<port>")."""
    options = dict(
        max_model_len=MAX_MODEL_LEN,
        host="127.0.0.1",
        port=0,
        workers=workers,
        served_model_name=MODEL_NAME,
        poll_interval_s=0.2,
        status_timeout_s=2.0,
        worker_wait_s=0.0,  # tests of "no worker" want the 503 at once; test_workers sets a wait
    )
    settings = GatewaySettings(**{**options, **overrides})
    engine = GrpcEngineClient.from_addresses(settings.workers, settings.poll_interval_s, settings.status_timeout_s,
                                             settings.worker_wait_s)
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

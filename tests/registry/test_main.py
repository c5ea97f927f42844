"""`python -m services.registry` as a process: env settings, health, metrics, JSON logs, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from grpc_health.v1 import health_pb2, health_pb2_grpc
from registry.harness import TOKEN

from services.registry.settings import RegistrySettings
from tide import grpcutil
from tide.servers import free_port


def test_settings_from_env():
    s = RegistrySettings.from_env(
        {
            "TIDE_REGISTRY_LISTEN": "0.0.0.0:7000",
            "TIDE_ADMIN_TOKEN": "secret",
            "TIDE_REGISTRY_ROOT": "/reg/",
            "TIDE_REGISTRY_POLL_S": "0.5",
            "TIDE_S3_BUCKET": "b1",
            "TIDE_REGISTRY_METRICS_PORT": "0",
        }
    )
    assert (s.listen, s.admin_token, s.root, s.poll_s, s.storage.s3_bucket, s.metrics_port) == (
        "0.0.0.0:7000",
        "secret",
        "reg",
        0.5,
        "b1",
        0,
    )
    assert "secret" not in repr(s)
    d = RegistrySettings.from_env({})
    assert d.listen.startswith("127.0.0.1:") and d.admin_token is None


def test_service_process(s3_server, s3_bucket):
    port, metrics = free_port(), free_port()
    env = {
        **os.environ,
        "TIDE_REGISTRY_LISTEN": f"127.0.0.1:{port}",
        "TIDE_ADMIN_TOKEN": TOKEN,
        "TIDE_S3_ENDPOINT": s3_server.url,
        "TIDE_S3_ACCESS_KEY": s3_server.access_key,
        "TIDE_S3_SECRET_KEY": s3_server.secret_key,
        "TIDE_S3_BUCKET": s3_bucket,
        "TIDE_REGISTRY_METRICS_PORT": str(metrics),
    }
    proc = subprocess.Popen([sys.executable, "-m", "services.registry"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        ch = grpcutil.channel(f"127.0.0.1:{port}")
        grpcutil.wait_ready(ch, timeout_s=30)
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="tide.v1.RegistryService"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        argv = ["--registry", f"127.0.0.1:{port}", "drafts", "rollback", "tiny", "--json"]
        cli = subprocess.run(
            [sys.executable, "-m", "tools.admin.cli", *argv], capture_output=True, text=True, timeout=60, env=env
        )
        assert cli.returncode == 4 and json.loads(cli.stdout)["error"]["code"] == "FAILED_PRECONDITION"
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
        assert 'tide_registry_rpcs_total{code="FAILED_PRECONDITION",method="Rollback"} 1.0' in text
        ch.close()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0 and time.monotonic() - t0 < 15
    finally:
        if proc.poll() is None:
            proc.kill()
    logs = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
    serving = next(r for r in logs if r["msg"] == "registry serving")
    assert serving["address"] == f"127.0.0.1:{port}" and serving["bucket"] == s3_bucket
    assert logs[-1]["msg"] == "stopped"
    assert TOKEN not in json.dumps(logs)


def test_a_bad_setting_exits_2_with_a_log_line_naming_it():
    """Like every other service: exit 2 and one JSON line, not a traceback and exit 1."""
    env = {**os.environ, "TIDE_REGISTRY_METRICS_PORT": "not-a-port"}
    proc = subprocess.run([sys.executable, "-m", "services.registry"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "TIDE_REGISTRY_METRICS_PORT" in proc.stderr

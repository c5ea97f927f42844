"""The service as a process: env settings, JSON logs, health, metrics endpoint, graceful SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from inference.service.svc import request, run_stream, wait_for

from services.inference.settings import InferenceSettings
from tide.grpcutil import channel
from tide.proto.tide.v1 import inference_pb2_grpc
from tide.servers import free_port


def test_settings_from_env():
    s = InferenceSettings.from_env({"TIDE_MAX_BATCH": "8", "TIDE_POLICY_PARAMS": '{"gamma": 2}',
                                    "TIDE_COLLECTION": "on", "TIDE_ADMIN_TOKEN": "t", "TIDE_S3_BUCKET": "b"})
    assert (s.max_batch, s.policy_params["gamma"], s.collection, s.admin_token, s.storage.s3_bucket) == \
        (8, 2, True, "t", "b")
    assert (s.target, s.dtype, s.drafter, s.listen) == ("ref", "auto", "ngram", "127.0.0.1:50051")
    import torch

    from tide.precision import fast_bf16

    assert s.torch_dtype == (torch.bfloat16 if fast_bf16("cpu") else torch.float32)  # bf16 only where fast
    assert InferenceSettings.from_env({"TIDE_DTYPE": "fp32"}).torch_dtype == torch.float32
    int4 = InferenceSettings.from_env({"TIDE_WEIGHTS": "int4", "TIDE_DTYPE": "fp32"})
    assert (int4.weight_format, int4.torch_dtype) == ("int4", torch.float32)
    assert InferenceSettings.from_env({"TIDE_WEIGHTS": "fp32"}).torch_dtype == torch.float32
    assert "admin_token" not in repr(s)  # secrets stay out of logs
    with pytest.raises(TypeError):
        s.policy_params["gamma"] = 5  # read-only, like the rest of the settings
    for bad in ({"TIDE_MAX_BATCH": "x"}, {"TIDE_DRAFTER": "medusa"}, {"TIDE_COLLECTION": "maybe"},
                {"TIDE_POLICY_PARAMS": "[1]"}, {"TIDE_MAX_BATCH": "0"}, {"TIDE_DTYPE": "int8"},
                {"TIDE_WEIGHTS": "q4_k"}, {"TIDE_WEIGHTS": "bf16", "TIDE_DTYPE": "fp32"},
                {"TIDE_WEIGHTS": "int4", "TIDE_DEVICE": "cuda"}):
        with pytest.raises(ValueError):
            InferenceSettings.from_env(bad)


def test_process_serves_and_stops_on_sigterm(tiny_target, redis_server, s3_server, s3_bucket, unique_prefix):
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "TIDE_TARGET": str(tiny_target.path), "TIDE_DTYPE": "fp32", "TIDE_MAX_SEQ_LEN": "256",
           "TIDE_LISTEN": f"127.0.0.1:{port}", "TIDE_METRICS_PORT": str(metrics_port),
           "TIDE_REDIS_URL": redis_server.url,
           "TIDE_S3_ENDPOINT": s3_server.endpoint, "TIDE_S3_ACCESS_KEY": s3_server.access_key,
           "TIDE_S3_SECRET_KEY": s3_server.secret_key, "TIDE_S3_BUCKET": s3_bucket,
           "TIDE_STREAM_PREFIX": unique_prefix, "TIDE_SHUTDOWN_GRACE_S": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "services.inference"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        health = health_pb2_grpc.HealthStub(channel(f"127.0.0.1:{port}"))

        def serving():
            try:
                return health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                    health_pb2.HealthCheckResponse.SERVING
            except Exception:
                assert proc.poll() is None, proc.stderr.read()
                return False

        wait_for(serving, timeout_s=120, what="the service to report SERVING")
        client = inference_pb2_grpc.InferenceServiceStub(channel(f"127.0.0.1:{port}"))
        tokens, _, last = run_stream(client, request("p1", [5, 9, 14, 5, 9], max_tokens=12))
        assert len(tokens) == 12 and last.final.completion_tokens == 12
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert "tide_inference_generated_tokens_total 12.0" in body
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        lines = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
        messages = [rec["msg"] for rec in lines]
        assert any("serving" in m for m in messages) and messages[-1] == "stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

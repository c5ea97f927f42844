"""API keys, /health, /ready, /metrics, settings from the environment and JSON logs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.harness import MODEL_NAME, REPO, free_port, serve_gateway
from services.gateway.settings import GatewaySettings
from tide.logs import JsonFormatter

CHAT_BODY = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def locked_gateway(tokenizer, worker):
    with serve_gateway(
        tokenizer, (worker.address,), api_keys=frozenset({"key-one", "key-two"}), max_body_bytes=2048
    ) as url:
        yield url


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "key-one"},
        {"Authorization": "Basic key-one"},
        {"Authorization": "Bearer"},
    ],
)
def test_api_key_required(locked_gateway, headers):
    for method, path, body in (
        ("POST", "/v1/chat/completions", CHAT_BODY),
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "x"}),
    ):
        response = httpx.request(method, f"{locked_gateway}{path}", json=body, headers=headers)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"


def test_api_key_accepted_and_probes_open(locked_gateway):
    for key in ("key-one", "key-two"):
        response = httpx.post(
            f"{locked_gateway}/v1/chat/completions",
            json=CHAT_BODY,
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{locked_gateway}{path}").status_code == 200


def test_body_too_large(locked_gateway):
    body = {**CHAT_BODY, "messages": [{"role": "user", "content": "x" * 4096}]}
    response = httpx.post(
        f"{locked_gateway}/v1/chat/completions", json=body, headers={"Authorization": "Bearer key-one"}
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_health_ready_and_request_id(client, worker):
    assert client.get("/health").json() == {"status": "ok"}
    ready = client.get("/ready")
    assert ready.status_code == 200
    body = ready.json()
    assert body["model"] == MODEL_NAME
    assert [(w["address"], w["healthy"]) for w in body["workers"]] == [(worker.address, True)]
    assert client.get("/health", headers={"x-request-id": "abc-123"}).headers["x-request-id"] == "abc-123"
    assert client.get("/health").headers["x-request-id"]


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics(client):
    before = _samples(client.get("/metrics").text)
    assert client.post("/v1/chat/completions", json={**CHAT_BODY, "temperature": 7}).status_code == 400
    assert client.post("/v1/chat/completions", json={**CHAT_BODY, "ignore_eos": True}).status_code == 200
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    after = _samples(response.text)
    chat = ("endpoint", "/v1/chat/completions")

    def delta(name: str, *labels) -> float:
        key = (name, tuple(sorted(labels)))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("tide_gateway_requests_total", chat, ("status", "400")) == 1
    assert delta("tide_gateway_requests_total", chat, ("status", "200")) == 1
    assert delta("tide_gateway_errors_total", chat, ("status", "400"), ("type", "invalid_request_error")) == 1
    assert delta("tide_gateway_completion_tokens_total", chat) == 3
    assert delta("tide_gateway_request_duration_seconds_count", chat) == 2
    assert delta("tide_gateway_time_to_first_token_seconds_count", chat) == 0  # only streams observe it
    assert after[("tide_gateway_workers_healthy", ())] == 1


def test_settings_from_env():
    defaults = GatewaySettings.from_env({})
    assert (defaults.host, defaults.port) == ("127.0.0.1", 8000)
    assert defaults.api_keys == frozenset() and not defaults.auth_enabled
    s = GatewaySettings.from_env(
        {
            "TIDE_WORKERS": "10.0.0.1:50051, w2:7000,",
            "TIDE_API_KEYS": "a,b",
            "TIDE_GATEWAY_PORT": "9000",
            "TIDE_MAX_MODEL_LEN": "4096",
            "TIDE_SERVED_MODEL_NAME": "smol",
            "TIDE_TARGET": "/models/x",
        }
    )
    assert s.workers == ("10.0.0.1:50051", "w2:7000") and s.api_keys == frozenset({"a", "b"})
    assert (s.port, s.max_model_len, s.served_model_name, s.target) == (9000, 4096, "smol", "/models/x")
    with pytest.raises(ValueError):
        GatewaySettings.from_env({"TIDE_WORKERS": "no-port"})
    with pytest.raises(ValueError):
        GatewaySettings.from_env({"TIDE_GATEWAY_MAX_N": "0"})
    with pytest.raises(AttributeError):
        s.port = 1  # frozen


def test_json_log_lines():
    record = logging.LogRecord("tide.gateway.access", logging.INFO, __file__, 1, "request %s", ("done",), None)
    record.status = 200
    record.request_id = "r1"
    line = JsonFormatter().format(record)
    assert "\n" not in line
    out = json.loads(line)
    assert out["msg"] == "request done" and out["level"] == "INFO" and out["status"] == 200
    assert out["request_id"] == "r1" and out["logger"] == "tide.gateway.access"


def test_python_m_services_gateway(chat_target, worker, tmp_path):
    """The entry point: settings from the environment, real uvicorn, JSON log lines on stderr."""
    port = free_port()
    env = {
        **os.environ,
        "TIDE_GATEWAY_PORT": str(port),
        "TIDE_WORKERS": worker.address,
        "TIDE_TARGET": str(chat_target),
        "TIDE_SERVED_MODEL_NAME": "served-name",
        "TIDE_GATEWAY_POLL_S": "0.2",
        "PYTHONPATH": str(REPO),
    }
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.gateway"], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{url}/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "served-name"
        body = {**CHAT_BODY, "model": "served-name"}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert any(rec.get("path") == "/v1/chat/completions" and rec.get("status") == 200 for rec in lines)
    assert {"ts", "level", "logger", "msg"} <= set(lines[0])

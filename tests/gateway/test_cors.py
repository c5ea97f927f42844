"""CORS (TIDE_CORS_ORIGINS): a browser's preflight is answered and responses carry Access-Control-* headers
for the configured origins; with none configured (the default) no CORS header is ever sent."""

from __future__ import annotations

import httpx
import pytest

from gateway.harness import MODEL_NAME, serve_gateway
from services.gateway.settings import GatewaySettings

ORIGIN = "https://app.example.com"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}
BODY = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}


@pytest.fixture(scope="module")
def cors_gateway(tokenizer, worker):
    with serve_gateway(tokenizer, (worker.address,), cors_origins=(ORIGIN,), api_keys=frozenset({"k"})) as url:
        yield url


def test_preflight_and_headers_for_a_configured_origin(cors_gateway):
    r = httpx.options(f"{cors_gateway}/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 200  # answered before the API key check: browsers send no credentials here
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.post(f"{cors_gateway}/v1/completions", json=BODY, headers={"Origin": ORIGIN, "Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.post(f"{cors_gateway}/v1/completions", json=BODY, headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN  # errors readable too


def test_other_origins_get_no_grant(cors_gateway):
    r = httpx.options(f"{cors_gateway}/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{cors_gateway}/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_wildcard(tokenizer, worker):
    with serve_gateway(tokenizer, (worker.address,), cors_origins=("*",)) as url:
        r = httpx.options(f"{url}/v1/completions", headers={**PREFLIGHT, "Origin": "https://any.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_no_cors_by_default(client):
    r = client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 405 and not any(h.startswith("access-control-") for h in r.headers)
    assert not any(h.startswith("access-control-") for h in client.get("/health", headers={"Origin": ORIGIN}).headers)


def test_settings_from_env():
    assert GatewaySettings.from_env({}).cors_origins == ()
    env = {"TIDE_CORS_ORIGINS": "https://a.example, http://localhost:3000"}
    assert GatewaySettings.from_env(env).cors_origins == ("https://a.example", "http://localhost:3000")
    with pytest.raises(ValueError, match="TIDE_CORS_ORIGINS"):
        GatewaySettings.from_env({"TIDE_CORS_ORIGINS": "a.example/path"})

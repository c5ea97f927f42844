"""Schemathesis fuzzes every operation of the gateway's /openapi.json against a real gateway and worker.

Valid and invalid inputs (Schemathesis's positive and negative modes; its examples, coverage and
fuzzing phases) go to a gateway on loopback routed to the `short_worker` (a context of
SHORT_CONTEXT tokens, so no generation runs long). No response may be a 5xx, and every 4xx body
must have OpenAI's error shape. Deterministic: a fixed seed, derandomized Hypothesis, no example
database; a bounded number of examples per operation keeps the run short on a busy CPU (about a
minute on two busy cores, most of it the coverage phase's valid requests, each a short generation).
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error

from gateway.harness import MODEL_NAME, serve_gateway
from services.gateway.app import gateway_openapi

SEED = 20261125
# Per operation and generation mode, in the fuzzing phase; TIDE_FUZZ_EXAMPLES=1000 for a deeper local run.
MAX_EXAMPLES = int(os.environ.get("TIDE_FUZZ_EXAMPLES", "30"))
MAX_N = 2  # the fuzzed gateway's largest `n`: each choice is a generation of up to SHORT_CONTEXT tokens
CONFIG = {
    "seed": SEED,
    "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
    "phases": {"stateful": {"enabled": False}},
    "request-timeout": 60,
}
# The document a gateway serving MODEL_NAME serves (test_the_fuzzed_schema_is_the_served_one), loaded
# at collection time so that pytest gets one test per operation.
OPENAPI = gateway_openapi(MODEL_NAME, MAX_N)
schema = schemathesis.openapi.from_dict(OPENAPI, config=schemathesis.Config.from_dict(CONFIG))


@pytest.fixture(scope="module")
def fuzzed_gateway(tokenizer, short_worker):
    with serve_gateway(tokenizer, (short_worker.address,), max_n=MAX_N) as url:
        yield url


def test_the_fuzzed_schema_is_the_served_one(fuzzed_gateway):
    assert httpx.get(f"{fuzzed_gateway}/openapi.json").json() == json.loads(json.dumps(OPENAPI))


def openai_error_body(ctx, response, case) -> None:
    """A 4xx answer is JSON {"error": {"message", "type", "param", "code"}} with a message (on Anthropic's
    /v1/messages, Anthropic's {"type": "error", "error": {"type", "message"}})."""
    if not 400 <= response.status_code < 500:
        return
    assert response.headers.get("content-type", [""])[0].startswith("application/json"), response.headers
    body = response.json()
    if case.path.startswith("/v1/messages"):
        assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body
        assert body["error"]["type"] in ("invalid_request_error", "authentication_error", "not_found_error",
                                         "request_too_large"), body
        return
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] in ("invalid_request_error", "authentication_error", "not_found_error"), error


@schema.parametrize()
def test_no_server_errors(case, fuzzed_gateway):
    case.call_and_validate(base_url=fuzzed_gateway, checks=[not_a_server_error, openai_error_body])

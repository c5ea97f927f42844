"""TIDE_MODEL_ALIASES: more names for the served model, accepted as `model` everywhere and listed by
/v1/models; responses name the served model. A real gateway and worker."""

from __future__ import annotations

import httpx
import pytest

from gateway.harness import MODEL_NAME, serve_gateway
from services.gateway.settings import GatewaySettings

ALIASES = ("gpt-4o-mini", "my-model")


def test_the_variable_is_a_comma_list():
    settings = GatewaySettings.from_env({"TIDE_MODEL_ALIASES": "gpt-4o-mini, my-model,"})
    assert settings.model_aliases == frozenset(ALIASES)


@pytest.fixture(scope="module")
def aliased(tokenizer, worker):
    with (serve_gateway(tokenizer, (worker.address,), model_aliases=frozenset(ALIASES)) as url,
          httpx.Client(base_url=url, timeout=60) as c):
        yield c


def test_aliases_are_listed_and_accepted(aliased):
    listed = aliased.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == [MODEL_NAME, *ALIASES]
    assert len({m["root"] for m in listed}) == 1  # one model under three names
    assert aliased.get("/v1/models/my-model").json()["id"] == "my-model"
    for name in (MODEL_NAME, *ALIASES):
        chat = aliased.post("/v1/chat/completions", json={"model": name, "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "Hi"}]})
        assert chat.status_code == 200 and chat.json()["model"] == MODEL_NAME
        completion = aliased.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 2})
        assert completion.status_code == 200 and completion.json()["model"] == MODEL_NAME
        assert aliased.post("/tokenize", json={"model": name, "prompt": "Hi"}).status_code == 200
    unknown = aliased.post("/v1/completions", json={"model": "other", "prompt": "Hi", "max_tokens": 2})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert aliased.get("/v1/models/other").status_code == 404
    enum = aliased.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
    assert enum["enum"] == [MODEL_NAME, *ALIASES]

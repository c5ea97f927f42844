"""services/gateway/README.md's table of request parameters says what the request models take, both ways:
every (parameter, endpoint) row is a field of that endpoint's model and every field has its row; the
rows marked refused are exactly the models' refused parameters, those marked TIDE the TIDE extensions,
those marked vLLM vLLM's extensions."""

from __future__ import annotations

import re
from pathlib import Path

from services.gateway.protocol import (
    TIDE_EXTENSIONS,
    VLLM_CHAT_EXTENSIONS,
    VLLM_EXTENSIONS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    VllmChatExtensions,
)
from services.gateway.protocol_messages import CountTokensRequest, MessagesRequest
from services.gateway.protocol_responses import ResponsesRequest

README = Path(__file__).resolve().parents[2] / "services" / "gateway" / "README.md"
MODELS = {"chat": ChatCompletionRequest, "completions": CompletionRequest, "responses": ResponsesRequest,
          "messages": MessagesRequest, "count_tokens": CountTokensRequest, "tokenize": TokenizeRequest,
          "detokenize": DetokenizeRequest}
TIDE_ON = {"chat", "completions", "responses", "messages"}  # endpoints taking TIDE's extensions
VLLM_ON = {"chat", "completions"}  # and vLLM's
KINDS = {"supported", "ignored", "refused", "TIDE", "vLLM"}


def table() -> list[tuple[str, str, str]]:
    """(parameter, endpoint, kind) of every row of the table under '## Request parameters'."""
    text = README.read_text()
    section = text[text.index("## Request parameters") :]
    section = section[: section.index("\n#", 1)] if "\n#" in section[1:] else section
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] in ("parameter", "---") or len(cells) < 3:
            continue
        name = re.fullmatch(r"`(\w+)`", cells[0])
        assert name, f"a row's parameter is not a `name`: {line}"
        assert cells[2] in KINDS, f"unknown kind in: {line}"
        for endpoint in cells[1].split(","):
            rows.append((name.group(1), endpoint.strip(), cells[2]))
    return rows


def test_every_field_has_a_row_and_every_row_a_field():
    rows = table()
    documented = {(name, endpoint) for name, endpoint, _ in rows}
    assert len(documented) == len(rows), "a parameter is listed twice for an endpoint"
    fields = {(name, endpoint) for endpoint, model in MODELS.items() for name in model.model_fields}
    assert documented - fields == set(), "rows for parameters the models do not have"
    assert fields - documented == set(), "parameters the table does not list"


def test_kinds_match_the_models():
    rows = table()
    for endpoint, model in MODELS.items():
        refused = {name for name, ep, kind in rows if ep == endpoint and kind == "refused"}
        assert refused == set(getattr(model, "unsupported_params", ())), endpoint
        tide = {name for name, ep, kind in rows if ep == endpoint and kind == "TIDE"}
        assert tide == (set(TIDE_EXTENSIONS) if endpoint in TIDE_ON else set()), endpoint
        vllm = {name for name, ep, kind in rows if ep == endpoint and kind == "vLLM"}
        expected = set(VLLM_EXTENSIONS) if endpoint in VLLM_ON else set()
        expected |= set(VLLM_CHAT_EXTENSIONS) if endpoint == "chat" else set()
        expected |= set(VllmChatExtensions.model_fields) if endpoint == "tokenize" else set()
        assert vllm == expected, endpoint

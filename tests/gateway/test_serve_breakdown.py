"""`tide bench engine --serve`'s breakdown (benchmarks.serve_breakdown) against a real gateway and worker
(this folder's session fixtures: the tiny chat target): every layer decodes the same token ids to the
same length, and the parts add up to what the gateway's client saw."""

from __future__ import annotations

import pytest

from benchmarks.serve_breakdown import breakdown
from tide.engine.llama import LlamaModel
from tide.target import resolve_target


def test_the_parts_add_up_to_the_served_token(gateway, chat_target):
    model = LlamaModel.load(resolve_target(str(chat_target)))
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [100, 200, 300, 400]]
    res = breakdown(model, gateway, prompts, 12)
    layers = res["serve_layers"]
    assert set(layers) == {"engine", "worker", "grpc", "gateway"}
    for name, layer in layers.items():
        assert layer["requests"] == 3 * res["serve_stack"]["rounds"], name
        assert layer["tpot_ms"] > 0 and layer["ttft_ms"] > 0, (name, layer)
    parts = res["serve_breakdown_ms"]
    assert parts["total"] == layers["gateway"]["tpot_ms"]
    assert sum(v for k, v in parts.items() if k != "total") == pytest.approx(parts["total"], abs=0.01)
    assert res["serve_stack"]["worker"] and res["serve_engine_share"] > 0
    assert len(res["serve_engine_share_by_round"]) == res["serve_stack"]["rounds"]

"""Fixtures for engine tests (helpers live in tests/support/engine.py)."""

from __future__ import annotations

import pytest
import torch
from support.engine import save_tiny_target

from tide.engine.llama import LlamaModel
from tide.target import TargetFiles, resolve_target


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> TargetFiles:
    return save_tiny_target(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_model(tiny_target) -> LlamaModel:
    return LlamaModel.load(tiny_target, dtype=torch.float32)


@pytest.fixture(scope="session")
def ref_target() -> TargetFiles:
    return resolve_target("ref")


@pytest.fixture(scope="session")
def ref_model_bf16(ref_target) -> LlamaModel:
    return LlamaModel.load(ref_target, dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def ref_model_fp32(ref_target) -> LlamaModel:
    """What "auto" serves on a CPU without native bf16 (tide.precision)."""
    return LlamaModel.load(ref_target, dtype=torch.float32)


@pytest.fixture(scope="session", params=["int8", "int4"])
def tiny_model_quantized(request, tiny_target) -> LlamaModel:
    """The tiny target with weight-only quantized projections (tide.quant), computing in float32."""
    return LlamaModel.load(tiny_target, dtype=torch.float32, weight_format=request.param)


@pytest.fixture(scope="session")
def ref_model_int8(ref_target) -> LlamaModel:
    return LlamaModel.load(ref_target, dtype=torch.bfloat16, weight_format="int8")


@pytest.fixture(scope="session")
def ref_model_int4(ref_target) -> LlamaModel:
    return LlamaModel.load(ref_target, dtype=torch.bfloat16, weight_format="int4")

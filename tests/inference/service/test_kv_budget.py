"""A worker sizes its KV cache from TIDE_KV_CACHE_MB: the slots and context it derives are what it
serves with and what GetStatus reports; explicit values that do not fit refuse the start."""

from __future__ import annotations

import pytest
from inference.service.svc import stub

from services.inference.settings import InferenceSettings
from tide.engine.kv_budget import KVBudgetError
from tide.proto.tide.v1 import inference_pb2


def test_small_budget_derives_slots_and_context(make_service, caplog):
    # The tiny target (fp32, 8 layers, 2 kv heads of 16, hidden 64, context 512): a 512-token slot
    # takes 832 rows × 2816 B (target K/V and EAGLE-3 features) + 960 × 256 B (draft K/V) = 2.5 MiB.
    with caplog.at_level("INFO", logger="services.inference.app"):
        svc = make_service(max_batch=None, max_seq_len=None, kv_cache_mb=6)
    st = stub(svc).GetStatus(inference_pb2.GetWorkerStatusRequest())
    assert (st.max_batch_size, st.max_model_len) == (2, 512)
    assert st.memory.kv_cache_bytes == 2 * 832 * 2048 <= 6 * 2**20  # the target's K/V, float32
    assert "KV cache: 5 MiB, 2 slots × 512 tokens (budget 6 MiB: TIDE_KV_CACHE_MB)" in caplog.text


def test_explicit_values_over_the_budget_refuse_the_start(make_service):
    with pytest.raises(KVBudgetError, match=r"TIDE_MAX_BATCH=4 slots × TIDE_MAX_SEQ_LEN=256 tokens need \d+ MiB"):
        make_service(max_batch=4, max_seq_len=256, kv_cache_mb=1)


def test_settings_leave_slots_and_context_to_the_budget():
    s = InferenceSettings.from_env({})
    assert s.max_batch is None and s.max_seq_len is None and s.kv_cache_mb is None
    s = InferenceSettings.from_env({"TIDE_KV_CACHE_MB": "512", "TIDE_MAX_BATCH": "4"})
    assert (s.kv_cache_mb, s.max_batch, s.max_seq_len) == (512, 4, None)
    with pytest.raises(ValueError, match="TIDE_KV_CACHE_MB"):
        InferenceSettings.from_env({"TIDE_KV_CACHE_MB": "0"})

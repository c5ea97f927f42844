"""KV-cache sizing from a memory budget (tide.engine.kv_budget): the arithmetic on tiny numbers and
the reference model's shape, explicit and derived slots and context, refusals naming the numbers,
and the plan's bytes against what the engine and an EAGLE-3 drafter really allocate."""

from __future__ import annotations

import pytest
import torch
from support.engine import save_tiny_target

from tide.engine.drafters.eagle3 import TREE_SCRATCH, Eagle3Drafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.kv_budget import (
    CONTEXT_STEP,
    DEFAULT_CONTEXT,
    DEFAULT_SLOTS,
    TREE_SCRATCH_ROWS,
    KVBudgetError,
    model_slot_cost,
    plan,
    slot_cost,
)
from tide.engine.llama import LlamaModel
from tide.engine.profiling import random_draft
from tide.layers import pad_keys
from tide.memory import available_bytes

MiB = 2**20
EXTRA = EngineConfig().max_new_per_step + 1  # 257 rows past the context at the defaults
# The reference model (SmolLM2-135M: 30 layers, 3 kv heads of 64, hidden 576) in bf16 on CPU.
REF = slot_cost(30, 3, 64, 576, model_dtype_bytes=2, cache_dtype_bytes=4, extra_rows=EXTRA)


def test_bytes_per_token_count_every_part():
    assert REF.target == 30 * 3 * 64 * 2 * 4  # layers × kv heads × head dim × (K, V) × float32
    assert REF.draft == 3 * 64 * 2 * 4 and REF.features == 3 * 576 * 2
    rows = pad_keys(2048 + EXTRA)
    assert rows == 2368 and REF.slot_bytes(2048) == rows * (REF.target + REF.features) + (rows + 128) * REF.draft
    plain = slot_cost(30, 3, 64, 576, model_dtype_bytes=2, cache_dtype_bytes=2, extra_rows=EXTRA, drafting=False)
    assert plain.per_token == 30 * 3 * 64 * 2 * 2 and plain.slot_bytes(2048) == rows * plain.target
    assert TREE_SCRATCH_ROWS == TREE_SCRATCH


def test_reference_defaults_kept_where_memory_allows():
    """`make run` on a 24 GB machine: 16 × 2048 take about 1.9 GiB, far under half of what is free."""
    p = plan(REF, 4096 * MiB, 8192)
    assert (p.slots, p.context) == (DEFAULT_SLOTS, DEFAULT_CONTEXT) and p.bytes <= 4096 * MiB
    assert "KV cache: 1848 MiB, 16 slots × 2048 tokens (budget 4096 MiB" in p.describe()
    big = plan(REF, 1 << 40, 8192)  # a large budget is a ceiling: the defaults do not grow
    assert (big.slots, big.context) == (DEFAULT_SLOTS, DEFAULT_CONTEXT)
    assert plan(REF, 1 << 40, 1024).context == 1024  # the model's context when shorter


def test_derived_slots_then_context():
    slot = REF.slot_bytes(2048)
    p = plan(REF, 5 * slot + slot // 2, 8192)  # fewer slots, the context kept
    assert (p.slots, p.context) == (5, 2048)
    p = plan(REF, slot - 1, 8192)  # not one slot of 2048: one slot, the longest context that fits
    assert p.slots == 1 and p.context % CONTEXT_STEP == 0 and 256 <= p.context < 2048
    assert REF.slot_bytes(p.context) <= slot - 1 < REF.slot_bytes(p.context + CONTEXT_STEP)
    with pytest.raises(KVBudgetError, match=r"one slot of 256 tokens need \d+ MiB .*raise TIDE_KV_CACHE_MB"):
        plan(REF, REF.slot_bytes(256) - 1, 8192)


def test_explicit_values_honoured_or_refused():
    slot = REF.slot_bytes(2048)
    assert plan(REF, 3 * slot, 8192, slots=3, context=2048).slots == 3
    with pytest.raises(KVBudgetError, match=r"TIDE_MAX_BATCH=16 slots × TIDE_MAX_SEQ_LEN=2048 tokens need 1848 MiB"
                                            r".*more than the 100 MiB KV-cache budget \(TIDE_KV_CACHE_MB\)"):
        plan(REF, 100 * MiB, 8192, slots=16, context=2048, budget_source="TIDE_KV_CACHE_MB")
    p = plan(REF, 4 * REF.slot_bytes(512), 8192, context=512)  # slots derived for the given context
    assert (p.slots, p.context) == (4, 512)
    p = plan(REF, 2 * slot - 1, 8192, slots=2)  # context derived for the given slots
    assert p.slots == 2 and p.context < 2048 and p.bytes <= 2 * slot - 1
    with pytest.raises(KVBudgetError, match="TIDE_MAX_BATCH=64 slots of 256 tokens"):
        plan(REF, 100 * MiB, 8192, slots=64)
    with pytest.raises(KVBudgetError, match="one slot of TIDE_MAX_SEQ_LEN=8192 tokens"):
        plan(REF, 100 * MiB, 8192, context=8192)
    with pytest.raises(KVBudgetError, match="exceeds the model's context 1024"):
        plan(REF, 1 << 40, 1024, context=2048)


@pytest.mark.parametrize("budget_mib", [3, 17, 64, 200, 900, 5000])
@pytest.mark.parametrize("given", [{}, {"slots": 1}, {"context": 300}])
def test_never_over_budget(budget_mib, given):
    try:
        p = plan(REF, budget_mib * MiB, 4096, **given)
    except KVBudgetError:
        return
    assert p.bytes == p.slots * REF.slot_bytes(p.context) <= budget_mib * MiB


@pytest.mark.parametrize(("arch", "dtype"), [("llama", torch.float32), ("qwen3", torch.bfloat16),
                                             ("gemma2", torch.float32), ("phi3", torch.bfloat16)])
def test_plan_matches_what_is_allocated(tmp_path, arch, dtype):
    """The target's cache and the feature store exactly; the draft's cache at most what is counted
    (float32 where its step runs on the kernels, else the model dtype)."""
    model = LlamaModel.load(save_tiny_target(tmp_path, layers=2, arch=arch, head_dim=24), dtype=dtype)
    config = EngineConfig(max_gamma=4)
    cost = model_slot_cost(model, config.max_new_per_step)
    # float32: head size 24 is not one the kernels' attention takes, so even a bf16 model's cache is
    assert cost.target == 2 * model.cfg.num_kv_heads * 24 * 2 * 4
    p = plan(cost, 3 * cost.slot_bytes(200), model.cfg.max_position_embeddings, context=200)
    assert (p.slots, p.context) == (3, 200)
    engine = LLMEngine(model, EngineConfig(max_batch=p.slots, max_seq_len=p.context, max_gamma=4))
    drafter = Eagle3Drafter(random_draft(model, 32), "t", p.slots, engine.runner.cache.max_len)
    engine.swap_drafter(drafter)
    rows = engine.runner.cache.max_len
    assert engine.runner.cache.nbytes() == p.slots * rows * cost.target
    assert engine.features.rows.nbytes == p.slots * rows * cost.features
    draft = drafter.k.nbytes + drafter.v.nbytes
    assert draft <= p.slots * (rows + TREE_SCRATCH) * cost.draft
    assert engine.runner.cache.nbytes() + engine.features.rows.nbytes + draft <= p.bytes


def test_available_memory_reads_meminfo_and_the_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   16000000 kB\n")
    cg = tmp_path / "cg"
    cg.mkdir()
    assert available_bytes(str(meminfo), str(cg)) == (16000000 * 1024, "MemAvailable")
    (cg / "memory.max").write_text("max\n")
    assert available_bytes(str(meminfo), str(cg))[0] == 16000000 * 1024
    (cg / "memory.max").write_text(f"{8 << 30}\n")
    (cg / "memory.current").write_text(f"{3 << 30}\n")
    assert available_bytes(str(meminfo), str(cg)) == (5 << 30, "cgroup memory.max - memory.current")
    assert available_bytes(str(tmp_path / "none"), str(tmp_path / "none")) is None


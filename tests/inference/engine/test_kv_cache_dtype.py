"""A bf16 model's KV cache on the CPU kernels is bf16: half the memory, the same bits as float32.

The keys and values a bf16 model writes are bf16 already, so a bf16 cache holds them exactly and
the kernels widen them in registers; every logit must equal the float32 cache's bit for bit, or
greedy output would change with the cache's type.
"""

from __future__ import annotations

import pytest
import torch
from support.engine import save_tiny_target

from tide.engine.llama import ForwardBatch, KVCache, LlamaModel, kv_cache_dtype
from tide.kernels import ops as kernel_ops

kernels = kernel_ops()
needs_kernels = pytest.mark.skipif(kernels is None or not kernels.has_decode_attention,
                                   reason="the kernels' attention is not built here")


def _as_float32(cache: KVCache) -> KVCache:
    cache.k = [t.float() for t in cache.k]
    cache.v = [t.float() for t in cache.v]
    return cache


def test_cache_dtype_follows_the_model_and_the_kernels():
    assert kv_cache_dtype(torch.float32, "cpu", 64) == torch.float32
    assert kv_cache_dtype(torch.float16, "cpu", 64) == torch.float32
    expected = torch.bfloat16 if kernels is not None and kernels.has_decode_attention else torch.float32
    assert kv_cache_dtype(torch.bfloat16, "cpu", 64) == expected
    assert kv_cache_dtype(torch.bfloat16, "cpu", 24) == torch.float32  # a head size the kernels do not take
    assert kv_cache_dtype(torch.bfloat16, "meta", 24) == torch.bfloat16  # off the CPU: the model's dtype


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_bf16_cache_gives_the_float32_cache_bits(tmp_path, arch):
    target = save_tiny_target(tmp_path, arch=arch)
    model = LlamaModel.load(target, dtype=torch.bfloat16)
    half, full = model.new_cache(3, 96), _as_float32(model.new_cache(3, 96))
    assert half.k[0].dtype == torch.bfloat16 and half.nbytes() * 2 == full.nbytes()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (3, 40), generator=gen)

    def both(fb: ForwardBatch) -> torch.Tensor:
        a, _, _ = model.forward(fb, half)
        b, _, _ = model.forward(fb, full)
        assert torch.equal(a, b)
        return a

    # A prompt of 24 tokens in each of slots 0..2, one sequence at a time.
    for s in range(3):
        pos = torch.arange(24)[None]
        mask = torch.arange(24)[None, None, None, :] <= pos[:, None, :, None]
        both(ForwardBatch(ids[s:s + 1, :24], pos, torch.tensor([s]), 24, mask, slot_range=(s, s + 1)))
    # A verify chunk of 4 tokens for all three (a slot range), then decode steps of slots 2 and 0
    # (gathered rows: another attention path).
    pos = torch.arange(24, 28).expand(3, 4)
    mask = torch.arange(28)[None, None, None, :] <= pos[:, None, :, None]
    both(ForwardBatch(ids[:, 24:28], pos, torch.arange(3), 28, mask, slot_range=(0, 3)))
    for i in range(28, 34):
        slots = torch.tensor([2, 0])
        both(ForwardBatch(ids[[2, 0], i:i + 1], torch.tensor([[i], [i]]), slots, i + 1, None))
    assert torch.equal(half.k[3][:, :, :34].float(), full.k[3][:, :, :34])


@needs_kernels
def test_kernel_attention_reads_bf16_keys_as_their_float32_values():
    """Rows with holes in their visible keys (a draft tree's nodes) and padded rows included."""
    gen = torch.Generator().manual_seed(5)
    B, hq, hkv, t, L, D = 2, 4, 2, 5, 70, 64
    q = torch.randn(B, hq, t, D, generator=gen).to(torch.bfloat16)
    k = torch.randn(B, hkv, L, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(B, hkv, L, D, generator=gen).to(torch.bfloat16)
    visible = torch.rand(B, t, L, generator=gen) < 0.7
    bias = torch.zeros(B, t, L).masked_fill_(~visible, float("-inf"))
    out = kernels.decode_attention(q, k, v, bias)
    assert torch.equal(out, kernels.decode_attention(q, k.float(), v.float(), bias))
    with pytest.raises(RuntimeError, match="both the same"):
        kernels.decode_attention(q, k, v.float(), bias)

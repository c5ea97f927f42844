"""tide.kernels' bf16 GEMM (gemm.cpp), the projections' and lm_head's path on CPUs with
AVX512_BF16: accurate against float64, and a row's output the same bits whatever shares its call
(the property lossless speculation stands on: verification must reproduce plain decoding)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tide import kernels
from tide.layers import Linear

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def ops():
    module = kernels.ops()
    assert module is not None, "the kernels must build where a compiler exists (see the log's warning)"
    if not module.has_bf16_gemm:
        pytest.skip("this CPU has no AVX512_BF16: Linear takes oneDNN's GEMM instead")
    return module


def _tensor(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (48, 6), (16, 2), (1040, 130)])
def test_matches_a_float64_reference_within_rounding(ops, n, k):
    w, x, bias = _tensor(n, k, seed=1, scale=0.05), _tensor(7, k, seed=2, scale=2.0), _tensor(n, seed=3)
    y = ops.bf16_linear(x, ops.bf16_pack(w), bias)
    ref = x.double() @ w.double().T + bias.double()
    # float32 accumulation over k products, then one rounding to bf16 (8-bit mantissa)
    bound = ref.abs() * 2.0 ** -8 + (x.double().abs() @ w.double().abs().T) * k * 2.0 ** -24
    assert y.shape == (7, n) and y.dtype == torch.bfloat16
    assert bool(((y.double() - ref).abs() <= bound).all())


def test_a_row_gets_the_same_bits_alone_in_any_batch_and_on_any_thread_count(ops):
    w, bias = _tensor(960, 576, seed=4, scale=0.05), _tensor(960, seed=5)
    packed = ops.bf16_pack(w)
    rows = _tensor(97, 576, seed=6, scale=3.0)
    alone = torch.cat([ops.bf16_linear(rows[i:i + 1], packed, bias) for i in range(rows.shape[0])])
    for m in (2, 5, 6, 7, 13, 16, 33, 97):  # register tiles of 6 rows: every remainder
        assert torch.equal(ops.bf16_linear(rows[:m], packed, bias), alone[:m]), m
    assert torch.equal(ops.bf16_linear(rows[40:57], packed, bias), alone[40:57])  # another offset
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ops.bf16_linear(rows, packed, bias), alone)
    finally:
        torch.set_num_threads(threads)


def test_strided_and_batched_inputs_keep_their_leading_shape(ops):
    w = _tensor(64, 32, seed=7)
    packed = ops.bf16_pack(w)
    x = _tensor(2, 3, 64, seed=8)[..., ::2]  # [2, 3, 32], not contiguous
    y = ops.bf16_linear(x, packed, None)
    assert y.shape == (2, 3, 64)
    assert torch.equal(y, ops.bf16_linear(x.contiguous(), packed, None))
    assert ops.bf16_linear(x[:0], packed, None).shape == (0, 3, 64)


def test_shapes_it_cannot_take_are_refused_with_a_message(ops):
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.bf16_pack(_tensor(24, 32, seed=9))
    with pytest.raises(RuntimeError, match="bf16"):
        ops.bf16_linear(torch.ones(2, 32), ops.bf16_pack(_tensor(16, 32, seed=9)), None)


def test_linear_takes_the_kernel_for_bf16_and_falls_back_where_it_cannot(ops):
    lin = Linear(_tensor(960, 576, seed=10))
    assert lin.kind == "bf16-kernel" and lin.row_exact
    odd = Linear(_tensor(24, 576, seed=11))  # 24 features: not whole blocks of 16
    assert odd.kind != "bf16-kernel" and not odd.row_exact
    x = _tensor(3, 576, seed=12)
    assert torch.allclose(odd(x).float(), (x.float() @ odd.weight.float().T), rtol=0.02, atol=0.05)
    with kernels.disabled():
        assert Linear(_tensor(960, 576, seed=10)).kind != "bf16-kernel"


def test_int8_weights_match_their_dequantized_values_and_keep_rows_invariant(ops):
    from tide.quant import Int8Linear

    w, bias = _tensor(960, 576, seed=13, scale=0.05).float(), _tensor(960, seed=14)
    lin = Int8Linear(w, bias, torch.bfloat16)
    assert lin.kind == "int8-kernel"
    rows = _tensor(40, 576, seed=15, scale=3.0)
    y = lin(rows)
    q = torch.round(w / lin.scale.float()[:, None]).clamp(-127, 127)
    ref = (rows.double() @ q.double().T) * lin.scale.double() + bias.double()
    bound = ref.abs() * 2.0 ** -8 + (rows.double().abs() @ q.double().abs().T) * lin.scale.double() * 576 * 2.0 ** -24
    assert bool(((y.double() - ref).abs() <= bound).all())
    alone = torch.cat([lin(rows[i:i + 1]) for i in range(rows.shape[0])])
    assert torch.equal(y, alone)
    assert torch.equal(lin(rows[3:20]), alone[3:20])

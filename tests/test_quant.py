"""Weight-only quantized linears (tide.quant) and how TIDE_WEIGHTS resolves (tide.precision).

The row tests are what lossless speculation on quantized weights rests on: verification runs a
sequence's γ + 1 tokens (and other sequences') through one GEMM, plain decoding runs one row, and
each row must come out the same bits either way.
"""

from __future__ import annotations

import pytest
import torch

from tide import quant
from tide.precision import resolve_weights
from tide.quant import INT4_GROUP, Int4Linear, Int8Linear, quantized_linear

FORMATS = [f for f in quant.QUANT_FORMATS if quant.supported(f)]
pytestmark = pytest.mark.skipif(not FORMATS, reason="this torch build has no CPU weight-only kernels")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_gets_the_same_bits_whatever_the_row_count(fmt, dtype):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(3072, 576, generator=g) * 0.05  # the reference model's gate|up shape
    layer = quantized_linear(weight, None, fmt, dtype)
    x = torch.randn(130, 576, generator=g).to(dtype)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
    for m in (2, 3, 4, 5, 8, 16, 17, 32, 33, 64, 130):
        assert torch.equal(layer(x[:m]), alone[:m]), f"{fmt}: rows differ in a GEMM of {m} rows"
    assert torch.equal(layer(x[:6].view(2, 3, 576)), alone[:6].view(2, 3, -1))  # leading dims kept


def test_int4_gives_back_gguf_q4_1_blocks_exactly():
    """A weight made of Q4_1 blocks (value = d * q + m, q in 0..15, one d and m per 32 inputs, each
    group using q = 0 and q = 15 as a quantizer's min and max do) comes back as it was."""
    g = torch.Generator().manual_seed(1)
    out, inp = 32, 4 * INT4_GROUP
    q = torch.randint(0, 16, (out, inp // INT4_GROUP, INT4_GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = 2.0 ** -torch.randint(4, 8, (out, inp // INT4_GROUP, 1), generator=g)  # exact in bf16
    m = -8 * d + d * torch.randint(-4, 4, d.shape, generator=g)
    weight = (d * q + m).view(out, inp)
    layer = Int4Linear(weight, None, torch.bfloat16)
    recovered = layer(torch.eye(inp, dtype=torch.bfloat16)).float().T  # row i of eye picks input i
    assert torch.equal(recovered, weight)


def test_int8_error_is_small_and_bias_is_added():
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(256, 128, generator=g) * 0.05, torch.randn(256, generator=g)
    x = torch.randn(4, 128, generator=g)
    layer = Int8Linear(weight, bias, torch.float32)
    exact = x @ weight.T + bias
    assert (layer(x) - exact).norm() / exact.norm() < 0.01
    assert layer.nbytes() < weight.numel() * 1.1  # one byte a weight plus a scale a row: about half of bf16


def test_int4_takes_int8_for_shapes_its_packing_refuses():
    assert isinstance(quantized_linear(torch.randn(300, 64), None, "int4", torch.float32), Int8Linear)  # 300 % 16
    assert isinstance(quantized_linear(torch.randn(96, 64), None, "int4", torch.float32), Int4Linear)
    with pytest.raises(ValueError, match="weight format"):
        quantized_linear(torch.randn(16, 32), None, "fp8", torch.float32)


def test_tide_weights_resolve_to_a_compute_dtype_and_a_format():
    assert resolve_weights("bf16") == (torch.bfloat16, "float")
    assert resolve_weights("fp32", "fp32") == (torch.float32, "float")
    assert resolve_weights("int4", "fp32") == (torch.float32, "int4")
    assert resolve_weights("auto", "fp32") == (torch.float32, "float")
    with pytest.raises(ValueError, match="contradict"):
        resolve_weights("bf16", "fp32")
    with pytest.raises(ValueError, match="not available on cuda"):
        resolve_weights("int8", "auto", "cuda")
    with pytest.raises(ValueError, match="must be one of"):
        resolve_weights("q4_k")


def test_checking_a_weight_format_leaves_no_openmp_pool_behind():
    """`supported` runs where settings are resolved (a worker's main thread). An OpenMP pool it
    started there would outlive the check, and with more pool threads than cores libgomp throttles
    every pool's spin-waits: an int8 worker's batch-1 step took 15 ms instead of 8.5. Counted in a
    fresh process: native threads (OpenMP's among them) before and after the check."""
    import subprocess
    import sys

    code = (
        "import os, threading, torch\n"
        "from tide.quant import supported\n"
        "native = lambda: len(os.listdir('/proc/self/task')) - threading.active_count()\n"
        "torch.set_num_threads(2)\n"
        "before = native()\n"
        "assert supported('int8') and supported('int4')\n"
        "print(before, native())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    before, after = map(int, out.stdout.split())
    assert after == before


@pytest.mark.parametrize("kernels", [True, False])
def test_int8_from_q8_0_blocks_equals_int8_of_their_values(kernels):
    """Int8Linear.from_q8_0 (tide.kernels' fused pack, or without the kernels the float values)
    holds what Int8Linear of the dequantized weight holds, from stacked parts (q|k|v)."""
    import contextlib

    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    from tide import kernels as tide_kernels
    from tide.gguf_tensors import dequantize

    w = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32) * 0.02
    w[5] = 0  # a zero row: the scale's floor
    raw = torch.from_numpy(quants.quantize(w, Q.Q8_0))
    with contextlib.nullcontext() if kernels else tide_kernels.disabled():
        direct = Int8Linear.from_q8_0([raw[:32], raw[32:40], raw[40:]], None, torch.bfloat16)
        via_float = Int8Linear(dequantize(raw.reshape(-1).numpy(), Q.Q8_0, (48, 256)), None, torch.bfloat16)
        x = torch.randn(3, 256).bfloat16()
        assert direct.kind == via_float.kind
        assert torch.equal(direct.scale, via_float.scale) and torch.equal(direct(x), via_float(x))

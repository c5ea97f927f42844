"""tide.layers.Linear and tide.precision: every dtype works on every CPU, and "auto" follows the hardware."""

import pytest
import torch
import torch.nn.functional as F

from tide import precision
from tide.layers import Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [96, 9000])  # packed when oneDNN can; the wide one on F.linear
def test_linear_equals_f_linear_on_this_cpu(dtype, out_features):
    # On a CPU without native bf16 (AVX2 only), oneDNN cannot pack a bf16 weight: Linear must fall back
    # to F.linear instead of raising (it raised there, and with it every bf16 engine).
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, 64, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype)
    x = torch.randn(5, 64, generator=g).to(dtype)
    y = Linear(w, b)(x)
    assert y.dtype == dtype and y.shape == (5, out_features)
    torch.testing.assert_close(y.float(), F.linear(x, w, b).float(), rtol=2e-2, atol=2e-2)


def test_packing_check_leaves_the_global_rng_alone():
    from tide import layers

    layers._PACK_OK.clear()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    Linear(torch.ones(4, 8))  # runs the packing check
    assert torch.equal(torch.rand(3), expected)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def test_auto_dtype_is_bf16_exactly_where_it_is_fast():
    # an oracle independent of torch: the CPU's own flags. bf16 instructions (avx512_bf16, AMX) mean
    # native; AVX2 + FMA mean tide.kernels' bf16 GEMM (when the kernels build); with neither, and
    # without AVX-512's bw/vl/dq or avx_ne_convert, nothing runs bf16 fast: float32.
    from tide import kernels

    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this OS")
    auto = precision.resolve_dtype("auto", "cpu")
    if flags & {"avx512_bf16", "amx_bf16"}:
        assert auto == torch.bfloat16
    if {"avx2", "fma"} <= flags and kernels.ops() is not None:
        assert auto == torch.bfloat16
    if not ({"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags or "avx2" in flags):
        assert auto == torch.float32
    if kernels.ops() is None and not precision.native_bf16("cpu"):
        assert auto == torch.float32  # emulated bf16 GEMMs: float32 is faster
    assert precision.dtype_name(auto) in precision.DTYPE_NAMES


def test_named_dtypes_resolve_and_bad_names_are_refused():
    assert precision.dtype_name(torch.float32) == "fp32" and precision.dtype_name(torch.bfloat16) == "bf16"
    assert precision.resolve_dtype("fp32", "cpu") == torch.float32
    assert precision.resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        precision.resolve_dtype("int8", "cpu")

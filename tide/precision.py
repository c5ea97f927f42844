"""Which floating-point type to compute in, per device: "auto" picks bf16 where it is fast.

bf16 halves memory traffic and, on hardware with bf16 arithmetic (CUDA GPUs from Ampere on,
x86 CPUs with AVX512-BF16 or AMX), roughly doubles GEMM throughput. On a CPU without it, torch
emulates bf16 GEMMs: measured on a 2-core AVX2-only EPYC (Zen 1), 10 GFLOP/s in bf16 against
55 GFLOP/s in float32 for the reference model's shapes. There tide.kernels' AVX2 GEMM (bf16
weights widened to float32 in registers, float32 sums) serves the projections and the lm_head
instead: on a 2-vCPU Zen 3 guest plain decoding ran 63.8 tok/s in bf16 against 13.9 in float32
at batch 1, and 119.7 against 80.5 at batch 16 (docs/results/engine-step, section 2c), so "auto"
means bf16 wherever those kernels are built, and float32 only on a CPU with neither.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a dtype is resolved: settings modules import this one without it
    import torch

DTYPE_NAMES = ("auto", "bf16", "fp16", "fp32")
# How the target's weights are stored (TIDE_WEIGHTS): a float type (computing in it too), or
# weight-only int8 / int4 (tide.quant) with activations in the compute dtype. "auto": the compute dtype.
WEIGHTS_NAMES = ("auto", "bf16", "fp16", "fp32", "int8", "int4")
_TORCH_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@functools.cache
def native_bf16(device_type: str = "cpu") -> bool:
    """True when `device_type` ("cpu", "cuda") computes bf16 GEMMs natively (fast)."""
    import torch

    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device_type == "cpu":
        # oneDNN's bf16 path needs avx512_bf16 / AMX / avx_ne_convert; its own check says which
        check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        try:
            return bool(check()) if check is not None else False
        except RuntimeError:
            return False
    return False


@functools.cache
def fast_bf16(device_type: str = "cpu") -> bool:
    """True when bf16 is the faster type to serve in on `device_type`: native bf16 GEMMs, or on a
    CPU tide.kernels' bf16 GEMM (AVX512_BF16, or AVX2 + FMA)."""
    if native_bf16(device_type):
        return True
    if device_type != "cpu":
        return False
    from tide import kernels

    module = kernels.ops()
    return bool(module is not None and getattr(module, "has_bf16_gemm", False))


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """The torch dtype for a name of DTYPE_NAMES on `device`; "auto" = bf16 where fast (`fast_bf16`),
    else float32."""
    import torch

    if name == "auto":
        return torch.bfloat16 if fast_bf16(torch.device(device).type) else torch.float32
    if name not in _TORCH_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {name!r}")
    return getattr(torch, _TORCH_NAMES[name])


def dtype_name(dtype: torch.dtype) -> str:
    """The short name ("bf16", "fp32", ...) of a torch dtype, for logs and reports."""
    import torch

    return next(k for k, v in _TORCH_NAMES.items() if getattr(torch, v) == dtype)


def resolve_weights(weights: str, dtype: str = "auto", device: str | torch.device = "cpu") -> tuple[torch.dtype, str]:
    """(compute dtype, weight format) for a WEIGHTS_NAMES entry and a DTYPE_NAMES entry on `device`.
    The format is "float" (weights in the compute dtype), "int8" or "int4". A float weights name
    sets the compute dtype, so it may not contradict an explicit `dtype`; the quantized formats run
    on torch's CPU kernels only (tide.quant)."""
    import torch

    if weights not in WEIGHTS_NAMES:
        raise ValueError(f"weights must be one of {WEIGHTS_NAMES}, got {weights!r}")
    if weights == "auto":
        return resolve_dtype(dtype, device), "float"
    if weights in _TORCH_NAMES:
        if dtype not in ("auto", weights):
            raise ValueError(f"weights {weights!r} compute in {weights}; they contradict dtype {dtype!r}")
        return resolve_dtype(weights, device), "float"
    from tide import quant

    kind = torch.device(device).type
    if not quant.supported(weights, kind):
        raise ValueError(f"{weights} weights need torch's CPU kernel for them; not available on {kind} "
                         "(use bf16 there)")
    return resolve_dtype(dtype, device), weights


def weights_label(dtype: torch.dtype, fmt: str) -> str:
    """How logs and reports name a model's precision: "bf16", or "int4 (bf16 activations)"."""
    return dtype_name(dtype) if fmt == "float" else f"{fmt} ({dtype_name(dtype)} activations)"

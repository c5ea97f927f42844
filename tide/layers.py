"""Building blocks shared by the target forward (inference engine) and the EAGLE-3 draft.

Plain functions over tensors, no modules: the engine calls them ~20 times per layer per step, so
they stay free of Python-side bookkeeping.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tide.kernels import use_for


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: x * rsqrt(mean(x^2) + eps) * weight, float32 inside, rounded once.

    HF rounds the normalised value to bf16 before scaling by the weight; this scales first and
    rounds once, so bf16 results differ from HF's in the last bit at most. On CPU without autograd
    it is one fused kernel (tide.kernels): F.rms_norm is ~8 ATen ops there, and the engine calls
    this 61 times per decode step (2.3 ms of the reference model's 24 ms step on a Zen 4 guest).
    """
    k = use_for(x, weight)
    if k is not None:
        return k.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): a residual add and the norm after it, one kernel on CPU."""
    k = use_for(x, delta, weight)
    if k is not None:
        return k.add_rms_norm(x, delta, weight, eps)
    x = x + delta
    return x, F.rms_norm(x, (x.shape[-1],), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from a fused gate|up projection's output [..., 2I] (gate first), one kernel
    on CPU instead of chunk, silu and mul."""
    k = use_for(gate_up)
    if k is not None:
        return k.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] for RoPE with any scaling transformers has (its
    modeling_rope_utils): default, linear, dynamic, yarn, longrope, llama3. Cos and sin are then
    multiplied by `rope_attention_factor` (yarn, longrope).

    "dynamic" (NTK) changes the base only past `max_position_embeddings`, which the engine never
    serves (EngineConfig refuses longer contexts): its frequencies are the default ones. "longrope"
    takes its short factors, as transformers does while the sequence is within
    `original_max_position_embeddings` (past it transformers switches every position to the long
    factors, which a KV cache cannot follow; TIDE keeps the short ones)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default", "dynamic"):
        return inv_freq.float()
    if rope_type == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if rope_type == "longrope":
        return (inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float64)).float()
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled).float()
    raise ValueError(f"unsupported rope scaling type {rope_type!r}")


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: interpolated (divided by `factor`) low frequencies, extrapolated (kept) high ones, a
    linear ramp between the dimensions that turn beta_slow and beta_fast times (defaults 1 and 32,
    the paper's) over the original context."""
    factor = float(scaling["factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the base frequency), 0: interpolate (divided by factor)
    return (inv_freq / factor * (1 - keep) + inv_freq * keep).float()


def rope_attention_factor(scaling: dict | None, max_position_embeddings: int) -> float:
    """The factor transformers multiplies RoPE's cos and sin by: YaRN's mscale, LongRoPE's
    sqrt(1 + ln(s) / ln(original context)), s = max_position_embeddings / original context; 1 else."""
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    old_ctx = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / old_ctx
    if rope_type == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def rope_table(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables [max_positions, head_dim] for `apply_rope`: cos, and sin with its first half
    negated (the sign HF's rotate_half puts on it, folded in once here instead of every step)."""
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    sin = emb.sin()
    sin[:, : inv_freq.shape[0]].neg_()
    return emb.cos(), sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, q, D]; cos/sin: [B, 1, q, D] from `rope_table`, gathered at each token's position.

    HF's x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]: here [x2, x1] * [-s, s],
    the same products bit for bit in 4 ops instead of 7 (this runs twice per layer per step)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Linear:
    """y = x @ W.T on the fastest row-invariant GEMM this machine has, chosen once at construction.

    - bf16 on a CPU with AVX512_BF16, or AVX2 + FMA (and the fused kernels built): tide.kernels'
      `bf16_linear` (on AVX2 the bf16 weights widened to float32 in registers, float32 sums).
      Every output element is one fixed instruction sequence whatever the row count, so a lone
      decode row, a verification and a prompt give a token the same bits (`row_exact`). Measured
      on a 2-vCPU Zen 4 guest, weights streamed from memory as in a step: 1.5-2.2x faster than
      oneDNN's pre-packed GEMM at 1-5 rows, 1.0-1.5x at 16 (docs/results/engine-step).
    - Else on CPU, oneDNN's pre-packed GEMM where it exists for the dtype: measured on the 2-core
      CI machine (bf16, 1-16 rows) ~2x faster than `F.linear` for the 576-wide SmolLM2
      projections, bitwise identical to it, and row-invariant for M >= 2. Wide outputs (the
      49k-row lm_head) stay on `F.linear` unless `pack_wide`.
    - Else `F.linear`.
    """

    PACK_MAX_OUT = 8192  # above this many output features F.linear wins (lm_head: 3.5 vs 4.2 ms)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack_wide: bool = False,
                 keep_weight: bool = True) -> None:
        """`pack_wide`: pre-pack whatever the width (where row invariance matters more than speed).
        `keep_weight=False`: where the kernel serves, drop the [out, in] tensor (`weight` is then
        None): it is never read again, and the reference model's projections are 212 MB in bf16."""
        self.weight = weight
        self.bias = bias
        self.packed = None
        self.kernel_packed = None  # [N/16, K/2, 16, 2] for tide.kernels' bf16_linear
        self._kernels = None
        kernels = use_for(weight)
        if (kernels is not None and getattr(kernels, "has_bf16_gemm", False) and weight.dtype == torch.bfloat16
                and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0):
            self.kernel_packed = kernels.bf16_pack(weight)
            self._kernels = kernels
            self._bias32 = None if bias is None else bias.float()  # the kernel adds it in float32
            if not keep_weight:
                self.weight = None
            return
        wide_ok = pack_wide or weight.shape[0] <= self.PACK_MAX_OUT
        if weight.device.type == "cpu" and wide_ok and _can_pack(weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)

    def dense_weight(self) -> torch.Tensor | None:
        """The [out, in] weight: the kept tensor, else unpacked from the kernel's layout (a copy)."""
        if self.weight is not None or self.kernel_packed is None:
            return self.weight
        p = self.kernel_packed  # [N/16, K/2, 16, 2]
        return p.permute(0, 2, 1, 3).reshape(p.shape[0] * 16, p.shape[1] * 2)

    @property
    def row_exact(self) -> bool:
        """A row's output is the same bits whatever the number of rows, one row included."""
        return self.kernel_packed is not None

    def nbytes(self) -> int:
        """Bytes of the weight a call reads (the kernel's packed copy where it serves)."""
        w = self.kernel_packed if self.kernel_packed is not None else self.weight
        return w.numel() * w.element_size()

    @property
    def kernel_args(self) -> tuple | None:
        """(packed weight, scale, float32 bias) as tide.kernels' decode_layer takes a projection, or
        None where this one does not run on the kernel."""
        return None if self.kernel_packed is None else (self.kernel_packed, None, self._bias32)

    @property
    def kind(self) -> str:
        """Which GEMM serves: "bf16-kernel", "onednn" or "torch" (latency profiles are keyed by it)."""
        return "bf16-kernel" if self.kernel_packed is not None else "onednn" if self.packed is not None else "torch"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in]. On CPU without the kernel give it two or more rows: a single row takes
        oneDNN/MKL's GEMV path, whose sums differ in the last bit from the GEMM path every M >= 2
        shares (measured: M = 2..256 agree row for row), and plain decoding must equal
        verification. LlamaModel.forward runs a lone decode row as two for that reason."""
        if self.kernel_packed is not None:
            return self._kernels.bf16_linear(x, self.kernel_packed, self._bias32)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


_PACK_OK: dict[torch.dtype, bool] = {}


def _can_pack(dtype: torch.dtype) -> bool:
    """oneDNN weight prepacking is an internal op: use it only if it exists for `dtype` on this CPU
    and agrees with F.linear. bf16 needs avx512_bf16/AMX or avx_ne_convert; on an AVX2-only CPU
    the op raises, and F.linear (torch's own bf16 kernels) serves instead."""
    if dtype not in _PACK_OK:
        try:
            w = torch.linspace(-1, 1, 128).reshape(8, 16).to(dtype)  # no draw from the global RNG
            x = torch.linspace(1, -0.5, 48).reshape(3, 16).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
            y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            atol = 1e-4 if dtype == torch.float32 else 1e-2  # bf16/fp16: 8- and 11-bit mantissas
            _PACK_OK[dtype] = bool(torch.allclose(y.float(), F.linear(x, w).float(), atol=atol))
        except (RuntimeError, AttributeError):
            _PACK_OK[dtype] = False
    return _PACK_OK[dtype]


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                      softcap: float | None = None) -> torch.Tensor:
    """Batch-invariant attention for few query tokens (decode / verify) with grouped KV heads.

    q: [B, Hq, t, D]; k, v: [B, Hkv, L, D]; bias: additive [B, t, L] (0 or -inf) or None.
    Query head h uses KV head h // (Hq / Hkv), as in HF's repeat_kv. Computed in float32.
    `softcap` (Gemma 2): scores become softcap * tanh(scores / softcap) before the mask; the
    kernels do not do it, so such attention always takes the torch ops below.

    Why this shape of computation: greedy speculative decoding must emit exactly the tokens plain
    decoding emits, so a token's logits may not depend on how many other tokens share its forward.
    On CPU (MKL), a GEMM's result for one row changes with the number of rows, so each GEMM here
    has the same M whatever the batch: per KV head and query position, `Q_j[g, D] @ K^T[D, L]`
    (g = the query heads sharing that KV head) and `P_j[g, L] @ V[L, D]`, batched over (sequence,
    KV head) with `bmm`. We loop over the t query positions (t <= γ + 1) instead of folding them
    into M. Each score is one D-long dot product, so it does not depend on L either.

    The caller pads L to a multiple of GROUPED_KEY_BLOCK (masking the padding with -inf): torch's
    CPU softmax adds a row's last L mod 16 entries in another order than the vectorised body, so
    the same row padded to another length (a longer batch mate) could get a normaliser one ulp
    off — measured on 8 of 252 random rows, and seen as 18,944 vs 18,950 tokens from the same
    prompts batched differently. Over multiples of 64 padding only adds zeros to the same partial
    sums of P @ V, and the GEMMs never see a ragged tail.

    Cost (2-core CI-sized CPU, float32 keys, 3 KV heads): Q @ K^T as a 3-D bmm reads K at ~13 GB/s;
    the former K @ Q^T form (g = 3 output columns) and 4-D matmuls ran 2-3x slower — at batch 32
    with 640 keys, 6.8 vs 2.7 ms per layer, most of a generation step.
    """
    kern = _kernel_attention(q, k, v) if softcap is None else None
    if kern is not None:
        # The same contract in one AVX-512 kernel (tide.kernels): ~4x less time at batch 1, and no
        # per-position GEMM loop for verification. Batch-invariant by construction; not the same bits.
        return kern.decode_attention(q, k, v, bias)
    B, hq, t, d = q.shape
    hkv, L = k.shape[1], k.shape[2]
    g = hq // hkv
    # [t, B*Hkv, g, D], contiguous: each position's operand has one memory layout whatever t is
    # (a strided view can take another GEMM path, with other rounding).
    qt = (q.float() * (d ** -0.5)).view(B, hkv, g, t, d).permute(3, 0, 1, 2, 4).reshape(t, B * hkv, g, d)
    # Views when k, v are the cache's [slots, Hkv, :L] slice (rows stay contiguous).
    kt = k.float().reshape(B * hkv, L, d).transpose(1, 2)
    vf = v.float().reshape(B * hkv, L, d)
    outs = []
    for j in range(t):
        scores = torch.bmm(qt[j], kt)  # [B*Hkv, g, L]: softmax over a contiguous last dim
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if bias is not None:
            scores = (scores.view(B, hkv, g, L) + bias[:, None, j, None, :]).view(B * hkv, g, L)
        outs.append(torch.bmm(torch.softmax(scores, dim=-1), vf))  # [B*Hkv, g, D]
    out = outs[0].view(B, hq, 1, d) if t == 1 else torch.stack(outs).view(t, B, hq, d).permute(1, 2, 0, 3)
    return out.to(q.dtype)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, positions: torch.Tensor,
                   paths: torch.Tensor, starts: torch.Tensor, window: int | None = None,
                   softcap: float | None = None) -> torch.Tensor:
    """`grouped_attention` for the t nodes of draft trees (tide.engine.llama.TreeRows), each node's
    row bit for bit what plain decoding computes for its path.

    q: [B, Hq, t, D]; k, v: [B, Hkv, L, D], the sequences' cache rows, node j's key and value at
    starts[b] + j (read only); bias: [B, t, L], each node's visible keys (the cached ones and its
    ancestors); positions: [B, t] = starts + depth; paths: [B, t, P], paths[b, j, a] = node at depth a
    on node j's path (j past its depth).

    tide.kernels' attention takes the bias as it is: it computes a row over its visible keys moved
    together. The torch ops group a row's softmax and P @ V sums by key index, so with an ancestor
    at another index than in plain decoding (siblings share depths) the last bit could differ; here
    each node instead reads a copy of its keys with its path placed at starts .. starts + depth,
    where plain decoding holds it, under plain decoding's causal mask. Cost: a copy of the keys and
    values per node and layer, on the torch path only (no kernels: tests with them off, GPUs).
    `window`: a sliding-window layer's (the bias then already hides keys at index <= position -
    window); `softcap`: as in grouped_attention."""
    if softcap is None and _kernel_attention(q, k, v) is not None:
        return grouped_attention(q, k, v, bias)
    B, _, t, _ = q.shape
    L, P = k.shape[2], paths.shape[2]
    b_idx = torch.arange(B, device=q.device)[:, None]
    at = starts[:, None] + torch.arange(P, device=q.device)  # [B, P]: where plain decoding holds a path
    keys = torch.arange(L, device=q.device)
    outs = []
    for j in range(t):
        src = starts[:, None] + paths[:, j]  # [B, P]: cache index of each node on node j's path
        kj, vj = k.float().clone(), v.float().clone()
        kj[b_idx, :, at] = kj[b_idx, :, src]
        vj[b_idx, :, at] = vj[b_idx, :, src]
        causal = torch.zeros((B, 1, L), dtype=torch.float32, device=q.device)
        hidden = keys[None, :] > positions[:, j, None]
        if window is not None:
            hidden |= keys[None, :] <= positions[:, j, None] - window
        causal.masked_fill_(hidden[:, None, :], float("-inf"))
        outs.append(grouped_attention(q[:, :, j:j + 1], kj, vj, causal, softcap))
    return torch.cat(outs, dim=2)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    softcap: float | None) -> torch.Tensor:
    """Prompt attention with soft-capped scores (Gemma 2), which SDPA cannot do: q [B, Hq, t, D],
    k, v [B, Hkv, L, D], mask [B, 1, t, L] bool (True = attend). float32 inside, as transformers'
    eager attention upcasts its softmax."""
    g = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    scores = torch.matmul(q.float(), kf.transpose(2, 3)) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), vf).to(q.dtype)


def _kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """tide.kernels when its decode attention takes these operands, else None."""
    kern = use_for(q, k, v)
    if (kern is not None and kern.has_decode_attention and k.dtype == v.dtype
            and k.dtype in (torch.float32, torch.bfloat16)
            and q.shape[-1] % 16 == 0 and q.shape[-1] <= 256 and k.stride(-1) == 1 and v.stride(-1) == 1):
        return kern
    return None


GROUPED_KEY_BLOCK = 64  # grouped_attention's key length is a multiple of this (see its docstring)


def pad_keys(n: int) -> int:
    """n rounded up to a multiple of GROUPED_KEY_BLOCK."""
    return -(-n // GROUPED_KEY_BLOCK) * GROUPED_KEY_BLOCK

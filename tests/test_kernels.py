"""tide.kernels: the fused CPU kernels the engine's forward takes (built here with the system
compiler), against the torch ops they replace, row by row; and the torch-op fallback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tide import kernels
from tide.layers import (
    add_rms_norm,
    apply_rope,
    grouped_attention,
    rms_norm,
    rope_inv_freq,
    rope_table,
    silu_mul,
)

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def ops():
    module = kernels.ops()
    assert module is not None, "the kernels must build where a compiler exists (see the log's warning)"
    return module


def _rows(n: int, h: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, generator=g) * 3).to(dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the dtype's last place at b's magnitude."""
    eps = torch.finfo(a.dtype).eps
    return float(((a.float() - b.float()).abs() / (b.float().abs().clamp_min(1e-30) * eps)).max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch_within_a_last_bit(ops, dtype):
    x, w = _rows(37, 576, dtype), _rows(1, 576, dtype, seed=1)[0]
    ours = ops.rms_norm(x, w, 1e-5)
    ref = F.rms_norm(x.double(), (576,), w.double(), 1e-5).to(dtype)
    assert ours.dtype == dtype and ours.shape == x.shape
    # bf16: float32 inside and one rounding, so at most one bf16 step off the exact value; float32:
    # the sum of squares and two products round in float32 itself, a few steps
    assert _ulps(ours, ref) <= (1.0 if dtype == torch.bfloat16 else 8.0)
    if dtype == torch.bfloat16:  # torch's own kernel in bf16: the same value but for rare roundings
        assert (ours != F.rms_norm(x, (576,), w, 1e-5)).float().mean() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_gets_the_same_bits_whatever_shares_its_call(ops, dtype):
    """Batched verification must equal plain decoding: a row's result may not depend on the
    number of rows, their order, or where in memory the row starts (alignment)."""
    h = 576 + 7  # a tail shorter than the 16 accumulation lanes, and rows at odd offsets
    x, w = _rows(64, h, dtype), _rows(1, h, dtype, seed=1)[0]
    full = ops.rms_norm(x, w, 1e-6)
    gu = _rows(64, 2 * h, dtype, seed=2)
    full_silu = ops.silu_mul(gu)
    s_full, n_full = ops.add_rms_norm(x, gu[:, :h].contiguous(), w, 1e-6)
    for r in (0, 1, 17, 63):
        shifted = torch.cat([torch.zeros(1, dtype=dtype), x[r]])[1:]  # the same values one element further on
        assert torch.equal(ops.rms_norm(shifted.view(1, h), w, 1e-6)[0], full[r])
        assert torch.equal(ops.rms_norm(x[r:], w, 1e-6)[0], full[r])  # first of 64 - r rows
        assert torch.equal(ops.silu_mul(gu[r:r + 1])[0], full_silu[r])
        s, n = ops.add_rms_norm(x[r:r + 1], gu[r:r + 1, :h].contiguous(), w, 1e-6)
        assert torch.equal(s[0], s_full[r]) and torch.equal(n[0], n_full[r])
    assert torch.equal(ops.rms_norm(x.flip(0), w, 1e-6), full.flip(0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_rounds_the_sum_as_the_residual_add_does(ops, dtype):
    x, d, w = _rows(9, 576, dtype), _rows(9, 576, dtype, seed=3), _rows(1, 576, dtype, seed=4)[0]
    s, n = ops.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(s, x + d)
    assert torch.equal(n, ops.rms_norm(x + d, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(ops, dtype):
    gu = _rows(5, 2 * 1536, dtype, seed=5).view(1, 5, -1)
    gate, up = gu.chunk(2, dim=-1)
    ours = ops.silu_mul(gu)
    assert ours.shape == (1, 5, 1536)
    ref = (F.silu(gate.double()).to(dtype).double() * up.double()).to(dtype)  # silu rounded, then the product
    # exp's last float bit differs between libm and torch's vector exp: one step after two roundings
    assert _ulps(ours, ref) <= 2.0
    if dtype == torch.bfloat16:
        assert (ours != (F.silu(gate) * up)).float().mean() < 0.01


def test_rope_kv_cache_gives_the_torch_ops_bits_and_writes_only_its_rows(ops):
    """RoPE on q and k of a fused q|k|v row, k and v into a float32 cache at (slot, position):
    bit for bit what apply_rope and the indexed cache writes give, so the engine's outputs do not
    move when the kernels are on."""
    nh, nkv, hd, B, q = 9, 3, 64, 3, 4
    cos, sin = (t.to(torch.bfloat16) for t in rope_table(rope_inv_freq(hd, 10000.0), 512))
    qkv = _rows(B * q, (nh + 2 * nkv) * hd, torch.bfloat16).view(B, q, -1)
    pos = torch.tensor([[10, 11, 12, 13], [100, 101, 102, 103], [0, 1, 2, 3]])
    slots = torch.tensor([2, 0, 1])
    kc, vc = torch.zeros(4, nkv, 256, hd), torch.zeros(4, nkv, 256, hd)
    k_ref, v_ref = kc.clone(), vc.clone()
    q_out = ops.rope_kv_cache(qkv, cos[pos], sin[pos], kc, vc, slots, pos, nh, nkv)
    qk = apply_rope(qkv[..., :(nh + nkv) * hd].view(B, q, nh + nkv, hd).transpose(1, 2),
                    cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    k_ref[slots[:, None], :, pos] = qk[:, nh:].transpose(1, 2).float()
    v_ref[slots[:, None], :, pos] = qkv[..., (nh + nkv) * hd:].view(B, q, nkv, hd).float()
    assert torch.equal(q_out, qk[:, :nh])
    assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref)  # slot 3 and every other position untouched
    with pytest.raises(RuntimeError, match="position out of range"):
        ops.rope_kv_cache(qkv, cos[pos], sin[pos], kc, vc, slots, pos + 250, nh, nkv)


def _attention_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, hq, hkv, t, D, L = 3, 9, 3, 4, 64, 320
    q = torch.randn(B, hq, t, D, generator=g).to(torch.bfloat16)
    k_cache, v_cache = torch.randn(5, hkv, 512, D, generator=g), torch.randn(5, hkv, 512, D, generator=g)
    bias = torch.zeros(B, t, L)
    bias[:, :, 300:] = float("-inf")  # padding past the longest sequence
    bias[1, :, 250:] = float("-inf")  # a shorter one
    bias[2, 0, 299] = float("-inf")  # causal masking within the verified positions
    return q, k_cache[1:4, :, :L], v_cache[1:4, :, :L], bias  # strided views, as the engine passes them


def test_decode_attention_matches_the_torch_path(ops):
    if not ops.has_decode_attention:
        pytest.skip("decode_attention needs AVX-512")
    q, k, v, bias = _attention_case()
    ours = ops.decode_attention(q, k, v, bias)
    with kernels.disabled():
        ref = grouped_attention(q, k, v, bias)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias.double()[:, None],
                                           enable_gqa=True)  # float64 reference
    assert ours.shape == ref.shape == q.shape and ours.dtype == torch.bfloat16
    assert (ours.double() - exact).abs().max() <= (ref.double() - exact).abs().max() + 2 ** -8
    assert (ours != ref).float().mean() < 0.02  # both round float32 results to bf16: rarely apart


def test_decode_attention_is_batch_position_and_padding_invariant(ops):
    """A query's output may not depend on its batch mates, on which verified position it is, or on
    how far the key length was padded (a longer batch mate pads everyone's keys)."""
    if not ops.has_decode_attention:
        pytest.skip("decode_attention needs AVX-512")
    q, k, v, bias = _attention_case(1)
    full = ops.decode_attention(q, k, v, bias)
    alone = ops.decode_attention(q[1:2], k[1:2], v[1:2], bias[1:2])
    assert torch.equal(alone[0], full[1])
    one_position = ops.decode_attention(q[:, :, 2:3].contiguous(), k, v, bias[:, 2:3])
    assert torch.equal(one_position[:, :, 0], full[:, :, 2])
    extra = torch.randn(3, 3, 64, 64)
    padded = ops.decode_attention(q, torch.cat([k, extra], 2), torch.cat([v, extra], 2),
                                  torch.cat([bias, torch.full((3, 4, 64), float("-inf"))], 2))
    assert torch.equal(padded, full)
    no_bias = ops.decode_attention(q[:1], k[:1, :, :300], v[:1, :, :300], None)
    assert torch.equal(no_bias, ops.decode_attention(q[:1], k[:1], v[:1], bias[:1]))


def test_decode_attention_row_with_hidden_keys_equals_its_visible_keys_contiguous(ops):
    """A draft tree's node sees the cached keys and its ancestors, not its siblings' keys between
    them (tide.engine.llama.TreeRows): its row must be the bits of the same keys side by side, as
    plain decoding of its path holds them."""
    if not ops.has_decode_attention:
        pytest.skip("decode_attention needs AVX-512 or AVX2")
    g = torch.Generator().manual_seed(3)
    cached, L = 77, 128
    k, v = torch.randn(1, 3, L, 64, generator=g), torch.randn(1, 3, L, 64, generator=g)
    q = torch.randn(1, 9, 1, 64, generator=g)  # float32 out: a bf16 result would round most differences away
    for ancestors in ([cached, cached + 2, cached + 5], [cached + 1, cached + 9], [cached + 3]):
        visible = [*range(cached), *ancestors]
        holes = torch.full((1, 1, L), float("-inf"))
        holes[..., visible] = 0.0
        side_by_side = torch.full((1, 1, L), float("-inf"))
        side_by_side[..., :len(visible)] = 0.0
        at = torch.tensor(visible + [i for i in range(L) if i not in visible])
        tree_row = ops.decode_attention(q, k, v, holes)
        plain_row = ops.decode_attention(q, k[:, :, at].contiguous(), v[:, :, at].contiguous(), side_by_side)
        assert torch.equal(tree_row, plain_row), ancestors


def test_non_contiguous_inputs_are_read_correctly(ops):
    x = _rows(8, 1152, torch.bfloat16)[:, ::2]  # a strided view
    w = _rows(1, 576, torch.bfloat16, seed=1)[0]
    assert torch.equal(ops.rms_norm(x, w, 1e-5), ops.rms_norm(x.contiguous(), w, 1e-5))


def test_layers_take_the_kernels_without_autograd_and_torch_ops_with_it(ops):
    """A draft in training needs gradients: the kernels have no backward."""
    w = torch.nn.Parameter(torch.ones(576))
    x = _rows(4, 576, torch.float32)
    y = rms_norm(x, w, 1e-5)
    y.sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    with torch.inference_mode():
        assert torch.equal(rms_norm(x, w, 1e-5), ops.rms_norm(x, w.detach(), 1e-5))
        gu = _rows(3, 64, torch.bfloat16)
        assert torch.equal(silu_mul(gu), ops.silu_mul(gu))
        s, n = add_rms_norm(x, x, w, 1e-5)
        assert torch.equal(s, x + x)


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = ("import torch; from tide import kernels; from tide.layers import rms_norm; "
            "print('ops', kernels.ops() is not None); "
            "x = torch.ones(2, 8); print('norm', round(rms_norm(x, torch.ones(8), 1e-6).sum().item(), 3))")
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


def test_off_switch_and_a_failed_build_fall_back_to_torch_ops(tmp_path):
    off = _probe({"TIDE_CPU_KERNELS": "0"})
    assert off.returncode == 0 and "ops False" in off.stdout and "norm 16.0" in off.stdout
    broken = _probe({"CXX": "/bin/false", "TIDE_CACHE_DIR": str(tmp_path)})
    assert broken.returncode == 0, broken.stderr
    assert "ops False" in broken.stdout and "norm 16.0" in broken.stdout
    assert "fused CPU kernels unavailable" in broken.stderr and "build-error.log" in broken.stderr
    again = _probe({"CXX": "/bin/false", "TIDE_CACHE_DIR": str(tmp_path)})  # no second compile attempt
    assert "ops False" in again.stdout and "an earlier build failed" in again.stderr


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_is_torchs_argmax_ties_nans_and_all(ops, dtype):
    """Greedy decoding's argmax (argmax.cpp): the token plain decoding and every verification emit."""
    from tide.engine.sampling import greedy_tokens

    if not ops.has_argmax:
        pytest.skip("argmax_rows needs AVX-512 (greedy_tokens takes torch's argmax)")
    for r, v in ((1, 49152), (17, 49152), (5, 8192), (3, 37), (2, 1)):  # whole vectors, tails, one entry
        x = _rows(r, v, dtype, seed=v)
        assert torch.equal(ops.argmax_rows(x), x.float().argmax(-1)), (r, v)
    x = _rows(5, 1000, dtype, seed=1)
    x[0, 300] = x[0, 700] = x[0].max() + 1  # a tie: the first wins
    x[1, 7] = x[1, 500] = float("nan")  # a NaN beats everything: the first NaN
    x[2] = float("-inf")
    x[3] = 0.0
    x[3, :5] = -0.0  # -0.0 == 0.0: index 0
    x[4, 999] = float("inf")  # in the scalar tail of a 1000-wide row
    assert ops.argmax_rows(x).tolist() == x.float().argmax(-1).tolist() == [300, 7, 0, 0, 999]
    wide = _rows(4, 2 * 49152, dtype, seed=2)[:, ::2]  # strided rows
    assert torch.equal(greedy_tokens(wide), wide.float().argmax(-1))

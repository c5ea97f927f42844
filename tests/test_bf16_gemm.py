"""tide.kernels' bf16 GEMM (gemm.cpp), the projections' and lm_head's path on CPUs with
AVX512_BF16 or AVX2 + FMA (each CPU runs one of the two): accurate against float64, and a row's
output the same bits whatever shares its call (the property lossless speculation stands on:
verification must reproduce plain decoding)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

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
        pytest.skip("this CPU has neither AVX512_BF16 nor AVX2: Linear takes oneDNN's GEMM instead")
    return module


def _tensor(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (48, 6), (16, 2), (1040, 130)])
def test_matches_a_float64_reference_within_rounding(ops, tiles, n, k):
    w, x, bias = _tensor(n, k, seed=1, scale=0.05), _tensor(7, k, seed=2, scale=2.0), _tensor(n, seed=3)
    y = ops.bf16_linear(x, ops.bf16_pack(w), bias)
    ref = x.double() @ w.double().T + bias.double()
    # float32 accumulation over k products, then one rounding to bf16 (8-bit mantissa)
    bound = ref.abs() * 2.0 ** -8 + (x.double().abs() @ w.double().abs().T) * k * 2.0 ** -24
    assert y.shape == (7, n) and y.dtype == torch.bfloat16
    assert bool(((y.double() - ref).abs() <= bound).all())


@pytest.fixture(params=["amx", "vdpbf16ps"])
def tiles(ops, request):
    """Each tile path this CPU has: AMX (gemm_amx.h, where the CPU and OS give it) and the AVX-512 /
    AVX2 tiles (on an AMX machine only with TIDE_AMX=0 or set_amx(False))."""
    if request.param == "amx" and not ops.has_amx:
        pytest.skip("no AMX on this CPU (or the OS did not grant it)")
    before = ops.amx_enabled()
    ops.set_amx(request.param == "amx")
    try:
        yield request.param
    finally:
        ops.set_amx(before)


def test_a_row_gets_the_same_bits_alone_in_any_batch_and_on_any_thread_count(ops, tiles):
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


def test_int8_weights_match_their_dequantized_values_and_keep_rows_invariant(ops, tiles):
    from tide.quant import Int8Linear

    if not ops.has_int8_gemm:
        pytest.skip("the int8 kernel needs AVX512_BF16 or AVX2 + FMA (tide.quant takes torch's int8 GEMM here)")
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
    for m in (2, 3, 4, 5, 7, 9):  # every register tile, and the splits of rows between them
        assert torch.equal(lin(rows[3:3 + m]), alone[3:3 + m]), m


def test_int8_prompts_share_the_int8_weights_where_the_kernel_widens_them(ops):
    """No bf16 copy of the projections for prompts where the int8 GEMM serves them near bf16 speed
    (tide.engine.llama.prefill_weights_for); int4 keeps its copies where they fit."""
    from tide.engine.llama import LlamaConfig, prefill_weights_for

    cfg = LlamaConfig.from_hf({"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    widened = getattr(ops, "int8_prompts_widened", False)
    cpu_has_bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    assert widened == (ops.has_int8_gemm and ops.has_bf16_gemm and cpu_has_bf16)
    assert prefill_weights_for("auto", cfg, torch.bfloat16, "int8") == ("shared" if widened else "float")
    assert prefill_weights_for("auto", cfg, torch.bfloat16, "int4") == "float"  # a tiny model's copies fit
    assert prefill_weights_for("float", cfg, torch.bfloat16, "int8") == "float"


@pytest.fixture(scope="module", params=["float", "int8"])
def tiny_bf16_model(ops, tmp_path_factory, request):
    """The tiny target with bf16 activations: bf16 weights, or int8 weights (tide.quant)."""
    from support.engine import save_tiny_target

    from tide.engine.llama import LlamaModel

    if request.param == "int8" and not ops.has_int8_gemm:
        pytest.skip("the int8 kernel needs AVX512_BF16 or AVX2 + FMA")
    model = LlamaModel.load(save_tiny_target(tmp_path_factory.mktemp("bf16-target")), dtype=torch.bfloat16,
                            weight_format=request.param)
    assert model._layer_args is not None and not model._pair_single_row  # every projection on the kernel
    return model


def _decode(model, cache, ids, starts, slots, capture=False, one_call=True):
    from tide.engine.llama import ForwardBatch

    B, q = ids.shape
    positions = torch.tensor(starts)[:, None] + torch.arange(q)[None]
    kv_len = int(positions.max()) + 1
    mask = torch.arange(kv_len)[None, None, None, :] <= positions[:, None, :, None]
    consecutive = slots == list(range(slots[0], slots[0] + B))
    fb = ForwardBatch(ids, positions, torch.tensor(slots), kv_len, mask if q > 1 or B > 1 else None,
                      slot_range=(slots[0], slots[0] + B) if consecutive else None, capture=capture)
    saved = model._layer_args
    model._layer_args = saved if one_call else None
    try:
        return model.forward(fb, cache)
    finally:
        model._layer_args = saved


def test_a_decode_layer_in_one_call_gives_the_per_op_loops_bits(tiny_bf16_model):
    """LlamaModel.forward's one-call layer (tide.kernels' decode_layer) against its per-op loop:
    lone decode rows, a verification of 4 tokens for 2 sequences in scattered slots, capture."""
    if not kernels.ops().has_decode_attention:
        pytest.skip("the one-call layer needs the AVX-512 attention kernel")
    model = tiny_bf16_model
    g = torch.Generator().manual_seed(16)
    prompt = torch.randint(3, 96, (2, 20), generator=g)
    results = {}
    for one_call in (True, False):
        cache = model.new_cache(4, 64)
        for b, slot in enumerate((3, 1)):  # prompts: the same (prefill) path either way
            _decode(model, cache, prompt[b:b + 1], [0], [slot], one_call=False)
        out = [_decode(model, cache, prompt[:1, :1], [20], [3], one_call=one_call)]
        out.append(_decode(model, cache, prompt[:, 4:8], [21, 20], [3, 1], capture=True, one_call=one_call))
        results[one_call] = out
    for fast, slow in zip(results[True], results[False], strict=True):
        for a, b in zip(fast, slow, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


def test_speculation_on_the_kernels_emits_plain_decodings_tokens(tiny_bf16_model):
    from support.engine import ScriptedDrafter

    from tide.engine.engine import EngineConfig, LLMEngine
    from tide.engine.sequence import SamplingParams
    from tide.policies import FixedGamma

    g = torch.Generator().manual_seed(17)
    prompts = [(torch.randint(3, 96, (n,), generator=g).tolist() * 3)[:3 * n] for n in (4, 9, 6)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    config = EngineConfig(max_batch=4, max_seq_len=256)
    plain = [s.output_ids for s in LLMEngine(tiny_bf16_model, config).generate(prompts, params)]
    for batch in (1, 3):
        drafter = ScriptedDrafter({f"gen-0-{i}": out for i, out in enumerate(plain)}, 96, corrupt_every=4)
        engine = LLMEngine(tiny_bf16_model, config, drafter=drafter, policy=FixedGamma(4))
        spec = engine.generate(prompts[:batch], params)
        assert [s.output_ids for s in spec] == plain[:batch]
        assert sum(s.accepted_tokens for s in spec) > 0


@pytest.fixture
def stalled_helpers(ops):
    """The kernels' pool on 2 threads, its helper sleeping 3 ms inside every chunk it takes: a
    stand-in for a helper the OS has preempted (no test can make the OS do that on demand), so
    the calling thread must run the helper's chunks again (pool.h)."""
    threads = torch.get_num_threads()
    ops.set_pool(True)
    ops.set_pool_threads(2)
    ops._set_pool_helper_delay_us(3000)
    try:
        yield ops
    finally:
        ops._set_pool_helper_delay_us(0)
        ops.set_pool_threads(0)
        ops.set_pool(kernels.pool_wanted())
        torch.set_num_threads(threads)


def test_a_stalled_helpers_chunks_are_redone_with_the_same_bits(stalled_helpers):
    ops = stalled_helpers
    w, bias = _tensor(3072, 576, seed=7, scale=0.05), _tensor(3072, seed=8)
    packed = ops.bf16_pack(w)
    rows = _tensor(9, 576, seed=9, scale=3.0)
    ops._set_pool_helper_delay_us(0)
    ops.set_pool(False)  # OpenMP's static split: the reference
    reference = ops.bf16_linear(rows, packed, bias)
    ops.set_pool(True)
    ops._set_pool_helper_delay_us(3000)
    redone = ops.pool_chunks_redone()
    for _ in range(200):  # until the helper has taken a chunk (it may still be waking up for the first)
        assert torch.equal(ops.bf16_linear(rows, packed, bias), reference)
        if ops.pool_chunks_redone() > redone:
            break
    assert ops.pool_chunks_redone() > redone  # the caller did not wait 3 ms a chunk: it redid them


def test_decoding_beside_a_stalled_helper_gives_the_same_tokens(stalled_helpers, tmp_path):
    from support.engine import save_tiny_target

    from tide.engine.engine import EngineConfig, LLMEngine
    from tide.engine.llama import LlamaModel
    from tide.engine.sequence import SamplingParams

    ops = stalled_helpers
    # wide enough that a projection is several of the pool's ~64 KB chunks (the usual tiny target's are one)
    tiny_bf16_model = LlamaModel.load(save_tiny_target(tmp_path, layers=2, hidden_size=256, intermediate_size=1024),
                                      dtype=torch.bfloat16)
    prompts = [[5, 9, 2, 44, 17, 3], [8, 8, 31]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    config = EngineConfig(max_batch=2, max_seq_len=64)
    ops._set_pool_helper_delay_us(0)
    ops.set_pool(False)
    reference = [s.output_ids for s in LLMEngine(tiny_bf16_model, config).generate(prompts, params)]
    ops.set_pool(True)
    ops._set_pool_helper_delay_us(3000)
    redone = ops.pool_chunks_redone()
    assert [s.output_ids for s in LLMEngine(tiny_bf16_model, config).generate(prompts, params)] == reference
    assert ops.pool_chunks_redone() > redone  # the decode steps ran on the pool, and past the stalled helper


def test_amx_tiles_round_otherwise_but_agree_within_rounding(ops):
    """Why a machine with AMX takes it for every row count (gemm_amx.h): its bits are not the
    VDPBF16PS tiles', so mixing the two by row count would break verification's equality."""
    if not ops.has_amx:
        pytest.skip("no AMX on this CPU (or the OS did not grant it)")
    w, x = _tensor(960, 576, seed=20, scale=0.05), _tensor(16, 576, seed=21, scale=3.0)
    packed = ops.bf16_pack(w)
    before = ops.amx_enabled()
    try:
        ops.set_amx(True)
        on_amx = ops.bf16_linear(x, packed, None)
        ops.set_amx(False)
        on_avx = ops.bf16_linear(x, packed, None)
    finally:
        ops.set_amx(before)
    assert torch.allclose(on_amx.float(), on_avx.float(), rtol=2 ** -7, atol=1e-3)
    assert not torch.equal(on_amx, on_avx)

"""Our Llama-family forward equals transformers' reference forward (fp32, max |diff| <= 1e-3)."""

from __future__ import annotations

import pytest
import torch
from support.engine import save_tiny_target

from tide.engine.llama import ForwardBatch, LlamaModel


def _prefill_batch(ids: torch.Tensor, start: int = 0) -> ForwardBatch:
    q = ids.shape[1]
    pos = torch.arange(start, start + q)[None]
    mask = torch.arange(start + q)[None, None, None, :] <= pos[:, None, :, None]
    return ForwardBatch(ids, pos, torch.tensor([0]), start + q, mask, slot_range=(0, 1))


def _hf_logits(target, ids: torch.Tensor) -> torch.Tensor:
    hf = target.transformers_model(torch.float32).eval()
    with torch.inference_mode():
        out = hf(ids, output_hidden_states=True)
    return out.logits[0], out.hidden_states


@pytest.mark.parametrize("arch,extra", [
    ("llama", {}),
    ("qwen2", {}),  # q/k/v biases
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
])
def test_prefill_and_decode_match_transformers(tmp_path, arch, extra):
    target = save_tiny_target(tmp_path, arch=arch, **extra)
    model = LlamaModel.load(target, dtype=torch.float32)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    ref, _ = _hf_logits(target, ids)
    # Prefill of the first 30 tokens, then 10 single-token decode steps through the KV cache.
    cache = model.new_cache(1, 64)
    logits, _, _ = model.forward(_prefill_batch(ids[:, :30]), cache)
    assert (logits - ref[:30]).abs().max() <= 1e-3
    for i in range(30, 40):
        fb = ForwardBatch(ids[:, i:i + 1], torch.tensor([[i]]), torch.tensor([0]), i + 1, None, slot_range=(0, 1))
        logits, _, _ = model.forward(fb, cache)
        assert (logits[0] - ref[i]).abs().max() <= 1e-3


def test_capture_returns_eagle3_layers_and_final_state(tmp_path):
    target = save_tiny_target(tmp_path)
    model = LlamaModel.load(target, dtype=torch.float32)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(2))
    _, hidden = _hf_logits(target, ids)
    fb = _prefill_batch(ids)
    fb.capture = True
    _, final, aux = model.forward(fb, model.new_cache(1, 16))
    # HF hidden_states[i] is the output of layer i-1; [-1] is already post-norm.
    expected_aux = torch.cat([hidden[i + 1] for i in model.cfg.aux_layers], dim=-1)
    assert model.cfg.aux_layers == (1, 3, 4)  # [1, L//2 - 1, L - 4] for L = 8
    assert (aux - expected_aux).abs().max() <= 1e-4
    assert (final - hidden[-1]).abs().max() <= 1e-4


@pytest.mark.slow
def test_reference_model_matches_transformers(ref_target):
    model = LlamaModel.load(ref_target, dtype=torch.float32)
    ids = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(3))
    ref, _ = _hf_logits(ref_target, ids)
    logits, _, _ = model.forward(_prefill_batch(ids), model.new_cache(1, 32))
    assert (logits - ref).abs().max() <= 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [3, 16, 33, 48, 97])
def test_vocab_logits_of_a_row_do_not_depend_on_how_many_rows_share_the_gemm(rows, dtype):
    """Verification computes B x (γ + 1) logits rows at once, plain decoding one: each row must get
    the same bits either way (greedy losslessness). On oneDNN's AMX path a bf16 GEMM of 33+ rows
    rounds a row differently from one of 1-32 rows (the reference head's shape), which one plain
    `F.linear` over all rows fails here; `vocab_logits` blocks the rows. On the same machines MKL's
    float32 GEMM rounds a row differently from 16 rows on (`logits_head` packs float32 heads)."""
    from tide.engine.llama import logits_head, vocab_logits

    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(49152, 576, generator=g) * 0.05).to(dtype)  # the reference model's lm_head shape
    head = logits_head(weight)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    together = vocab_logits(x, head)
    for i in (0, rows // 2, rows - 1):
        assert torch.equal(together[i], vocab_logits(x[i:i + 1], head)[0]), i


def test_decode_logits_do_not_depend_on_a_longer_batch_mate(tmp_path):
    """A decoding sequence's logits must have the same bits alone and next to a longer sequence,
    whose length sets how far every row's keys are padded (greedy output may not depend on batch
    mates). Before keys were padded to whole blocks, torch's softmax summed the padded row's tail in
    another order and some lengths came out one ulp apart."""
    model = LlamaModel.load(save_tiny_target(tmp_path), dtype=torch.float32)
    cache = model.new_cache(2, 400)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 96, (2, 300), generator=g)
    mismatched = []
    for n in range(9, 150, 2):
        m = n + int(torch.randint(1, 150, (1,), generator=g))
        for slot, length in ((0, n), (1, m)):  # prefill both sequences' contexts alone
            fb = _prefill_batch(ids[slot:slot + 1, :length])
            model.forward(ForwardBatch(fb.input_ids, fb.positions, torch.tensor([slot]), fb.kv_len, fb.mask,
                                       slot_range=(slot, slot + 1)), cache)
        alone, _, _ = model.forward(ForwardBatch(ids[:1, n:n + 1], torch.tensor([[n]]), torch.tensor([0]), n + 1,
                                                 None, slot_range=(0, 1)), cache)
        pos = torch.tensor([[n], [m]])
        mask = torch.arange(m + 1)[None, None, None, :] <= pos[:, None, :, None]
        both, _, _ = model.forward(ForwardBatch(torch.stack([ids[0, n:n + 1], ids[1, m:m + 1]]), pos,
                                                torch.tensor([0, 1]), m + 1, mask, slot_range=(0, 2)), cache)
        if not torch.equal(alone[0], both[0]):
            mismatched.append(n)
    assert not mismatched


def test_attention_over_a_slot_span_equals_gathering_the_slots(tmp_path):
    """Batches whose slots are not one range read the span of cache slots around them (an idle slot
    with a stale sequence included, out of order) instead of gathering: each sequence's decode and
    verify logits must have the bits the gathered batch gives it (and, decoding, the bits it gets
    alone), and the idle slot's stale contents must not leak in."""
    model = LlamaModel.load(save_tiny_target(tmp_path), dtype=torch.float32)
    cache = model.new_cache(4, 200)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (4, 120), generator=g)
    lengths = {0: 37, 1: 90, 2: 64, 3: 101}
    for slot, n in lengths.items():  # slot 1 keeps a stale sequence, idle in the batch below
        fb = _prefill_batch(ids[slot:slot + 1, :n])
        model.forward(ForwardBatch(fb.input_ids, fb.positions, torch.tensor([slot]), fb.kv_len, fb.mask,
                                   slot_range=(slot, slot + 1)), cache)
    slots = [3, 0, 2]
    for q in (1, 3):  # decode, and verification of 3 tokens
        pos = torch.stack([torch.arange(lengths[s], lengths[s] + q) for s in slots])
        kv_len = int(pos.max()) + 1
        mask = torch.arange(kv_len)[None, None, None, :] <= pos[:, None, :, None]
        batch = torch.stack([ids[s, lengths[s]:lengths[s] + q] for s in slots])
        spanned, _, _ = model.forward(ForwardBatch(batch, pos, torch.tensor(slots), kv_len, mask,
                                                   slot_span=(0, 4)), cache)
        gathered, _, _ = model.forward(ForwardBatch(batch, pos, torch.tensor(slots), kv_len, mask), cache)
        assert torch.equal(spanned, gathered), q
        if q == 1:
            for i, s in enumerate(slots):
                n = lengths[s]
                alone, _, _ = model.forward(ForwardBatch(ids[s:s + 1, n:n + 1], torch.tensor([[n]]), torch.tensor([s]),
                                                         n + 1, None, slot_range=(s, s + 1)), cache)
                assert torch.equal(spanned[i], alone[0]), s

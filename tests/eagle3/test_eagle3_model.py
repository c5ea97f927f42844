"""The draft layer computes SGLang's EAGLE-3 midlayer, and `step` composes with a caller's KV cache."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tide.eagle3 import causal_attend
from tide.eagle3.testing import TINY_TARGET as TARGET
from tide.eagle3.testing import make_draft


def reference_forward(draft, ids, hidden, positions):
    """SGLang's LlamaDecoderLayer (EAGLE-3) written out with plain ops, HF RoPE and repeat_kv."""
    cfg, m = draft.cfg, draft.midlayer
    B, n, _ = hidden.shape
    nh, nkv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps

    def norm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x):
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
        ang = positions[:, None, :, None].float() * inv  # [B, 1, n, hd/2]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)

    x = torch.cat([norm(draft.embed[ids], m.input_layernorm.weight), norm(hidden, m.hidden_norm.weight)], -1)
    a = m.self_attn
    q = rope((x @ a.q_proj.weight.T).view(B, n, nh, hd).transpose(1, 2))
    k = rope((x @ a.k_proj.weight.T).view(B, n, nkv, hd).transpose(1, 2)).repeat_interleave(nh // nkv, 1)
    v = (x @ a.v_proj.weight.T).view(B, n, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, n, nh * hd)
    h = hidden + o @ a.o_proj.weight.T
    u = norm(h, m.post_attention_layernorm.weight)
    out = h + (F.silu(u @ m.mlp.gate_proj.weight.T) * (u @ m.mlp.up_proj.weight.T)) @ m.mlp.down_proj.weight.T
    return out, norm(out, draft.norm.weight) @ draft.lm_head.weight.T


def test_step_matches_the_sglang_midlayer_written_out():
    draft, _ = make_draft()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, TARGET["vocab_size"], (2, 9), generator=g)
    hidden = draft.project(torch.randn(2, 9, 192, generator=g))
    positions = torch.arange(5, 14).expand(2, 9)
    with torch.no_grad():
        out = draft.step(ids, hidden, positions, causal_attend)
        ref_out, ref_logits = reference_forward(draft, ids, hidden, positions)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(draft.logits(out), ref_logits, atol=1e-5, rtol=1e-4)


def test_step_token_by_token_with_a_kv_cache_equals_one_causal_pass():
    draft, _ = make_draft()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, TARGET["vocab_size"], (1, 6), generator=g)
    hidden = draft.project(torch.randn(1, 6, 192, generator=g))
    positions = torch.arange(6)[None]
    keys, values = [], []

    def cached_attend(q, k, v):  # the engine's pattern: append this step's k/v, attend to all
        keys.append(k)
        values.append(v)
        return F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), enable_gqa=True)

    with torch.no_grad():
        full = draft.step(ids, hidden, positions, causal_attend)
        steps = [draft.step(ids[:, i:i + 1], hidden[:, i:i + 1], positions[:, i:i + 1], cached_attend)
                 for i in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-4)


def test_vocab_maps():
    draft, _ = make_draft()
    draft_ids = torch.arange(draft.cfg.draft_vocab_size)
    targets = draft.to_target_ids(draft_ids)
    assert draft.t2d[targets].all() and int(draft.t2d.sum()) == len(draft_ids)
    back = draft.target_to_draft()
    assert torch.equal(back[targets], draft_ids)
    assert (back[~draft.t2d] == -1).all()


def test_to_moves_and_casts_the_embedding():
    draft, embed = make_draft()
    draft = draft.to(torch.bfloat16)
    assert draft.embed.dtype == torch.bfloat16 and torch.equal(draft.embed, embed.bfloat16())
    assert "embed" not in " ".join(draft.state_dict())

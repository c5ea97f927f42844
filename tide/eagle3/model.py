"""The EAGLE-3 draft: fc over the target's aux states, one Llama decoder layer over embedding ⊕ hidden,
its own final norm and a reduced-vocabulary lm_head (SGLang's / vLLM's `LlamaForCausalLMEagle3`).

Parameter and buffer names are the checkpoint's tensor names (`state_dict()` is exactly what
`model.safetensors` holds). The embedding is the target's, frozen and not part of the state: set
it with `set_embedding`.

One draft step over q new tokens per sequence (what SGLang's `LlamaModel.forward` does for EAGLE-3):

    residual = hidden                                   # [B, q, H]: fc(aux) or the previous step's out
    x = cat(input_layernorm(embed(ids)), hidden_norm(hidden))        # [B, q, 2H]
    h = residual + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))   # RoPE on q, k
    out = h + mlp(post_attention_layernorm(h))          # pre-norm residual stream, fed back as hidden
    logits = lm_head(norm(out))                         # [B, q, Vd]; target id = i + d2t[i]

Attention is the caller's (`attend`), so the inference engine keeps its own KV cache and the
trainer its training-time-test masks, around one implementation of the layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tide.eagle3.config import DraftIncompatible, Eagle3Config
from tide.layers import apply_rope, rms_norm, rope_inv_freq, rope_table

# attend(q [B, nH, q, hd], k [B, nKV, q, hd], v [B, nKV, q, hd]) -> [B, nH, q, hd]; q and k RoPE'd.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under bf16 autocast x is bf16 while the (master) weight stays float32: mixed dtypes miss
        # torch's fused kernel and take the decomposed one. The cast keeps the gradient to the
        # float32 weight and is a no-op when the dtypes already agree (inference, fp32 training).
        return rms_norm(x, self.weight.to(x.dtype), self.eps)


class Attention(nn.Module):
    """Projections only; q/k/v read the 2H-wide embedding ⊕ hidden input."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, h, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Eagle3Draft(nn.Module):
    """See the module docstring. Shapes: H hidden, T target hidden, V target vocab, Vd draft vocab."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # Vocabulary maps (identity on the first Vd ids until trained): draft id i <-> target id i + d2t[i].
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        # Plain attributes, not buffers: neither saved nor cast by `.to(dtype)`.
        self.embed: torch.Tensor | None = None
        self._rope: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    # --- set-up ---------------------------------------------------------------------------------

    def set_embedding(self, weight: torch.Tensor) -> None:
        """The target's input embedding [V, H] (frozen; cast to the draft's dtype and device, and
        moved along by later `.to()` calls; never saved)."""
        want = (self.cfg.vocab_size, self.cfg.hidden_size)
        if tuple(weight.shape) != want:
            raise DraftIncompatible(f"target embedding is {list(weight.shape)}, the draft needs {list(want)}")
        p = self.fc.weight
        self.embed = weight.detach().to(device=p.device, dtype=p.dtype)

    def _apply(self, fn, recurse=True):
        """`.to(device / dtype)` and friends also move and cast the (unregistered) embedding."""
        super()._apply(fn, recurse)
        if self.embed is not None:
            self.embed = fn(self.embed)
        return self

    def _rope_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos/sin [max_positions, hd], built on first use per device."""
        if device not in self._rope:
            cfg = self.cfg
            inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
            cos, sin = rope_table(inv, cfg.max_position_embeddings + 64)  # +64: room for draft steps
            self._rope[device] = (cos.to(device), sin.to(device))
        return self._rope[device]

    # --- the engine-facing API ------------------------------------------------------------------

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """fc: concatenated target aux states [..., 3T] -> draft hidden [..., H]."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             attend: Attend) -> torch.Tensor:
        """One draft layer pass. input_ids [B, q] target-vocab ids (the token *after* the state in
        `hidden`), hidden [B, q, H], positions [B, q] (of the state). Returns out [B, q, H], pre-norm."""
        if self.embed is None:
            raise RuntimeError("Eagle3Draft.set_embedding(target embedding) was not called")
        cfg, layer = self.cfg, self.midlayer
        B, n = input_ids.shape
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        embeds = F.embedding(input_ids, self.embed).to(hidden.dtype)
        residual = hidden
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        cos_t, sin_t = self._rope_tables(x.device)
        cos = cos_t[positions].unsqueeze(1).to(x.dtype)  # [B, 1, q, hd]
        sin = sin_t[positions].unsqueeze(1).to(x.dtype)
        attn = layer.self_attn
        q = apply_rope(attn.q_proj(x).view(B, n, nh, hd).transpose(1, 2), cos, sin)
        k = apply_rope(attn.k_proj(x).view(B, n, nkv, hd).transpose(1, 2), cos, sin)
        v = attn.v_proj(x).view(B, n, nkv, hd).transpose(1, 2)
        o = attend(q, k, v)
        h = residual + attn.o_proj(o.transpose(1, 2).reshape(B, n, nh * hd))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] of a step's output."""
        return self.lm_head(self.norm(out))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_to_draft(self) -> torch.Tensor:
        """[V] long: draft id of each target id, -1 where the draft vocabulary lacks it."""
        ids = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        draft = torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device)
        ids[draft + self.d2t] = draft
        return ids


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`attend` for a whole sequence in one call with no cache: causal self-attention (GQA)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])

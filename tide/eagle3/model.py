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
from tide.kernels import use_for
from tide.layers import Linear, apply_rope, rms_norm, rope_inv_freq, rope_table, silu_mul
from tide.quant import quantized_linear

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


class ServingLinears:
    """A frozen draft's projections on tide.layers.Linear (tide.kernels' GEMM where it serves, on
    AVX512_BF16 and AVX2 CPUs alike) or tide.quant's int8 ones (`serving_format`), q|k|v and
    gate|up fused: the inference engine's copy (`Eagle3Draft.freeze_for_serving`). nn.Linear's bf16
    GEMM on an AVX2 CPU is torch's emulated one: a draft step took 3 ms there against a 15 ms
    target step."""

    def __init__(self, draft: Eagle3Draft, weights: str = "auto") -> None:
        dtype = draft.fc.weight.dtype
        ws = self.weights(draft)
        self.format = fmt = serving_format(draft, ws, weights)

        def make(weight: torch.Tensor):
            return Linear(weight) if fmt == "float" else quantized_linear(weight, None, fmt, dtype)

        self.fc, self.qkv, self.o = make(ws["fc"]), make(ws["qkv"]), make(ws["o"])
        self.gate_up, self.down, self.lm_head = make(ws["gate_up"]), make(ws["down"]), make(ws["lm_head"])

    @staticmethod
    def weights(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
        """Each serving projection's weight [out, in], q|k|v and gate|up concatenated."""
        attn, mlp = draft.midlayer.self_attn, draft.midlayer.mlp

        def w(*mods: nn.Linear) -> torch.Tensor:
            return torch.cat([m.weight.detach() for m in mods]) if len(mods) > 1 else mods[0].weight.detach()

        return {"fc": w(draft.fc), "qkv": w(attn.q_proj, attn.k_proj, attn.v_proj), "o": w(attn.o_proj),
                "gate_up": w(mlp.gate_proj, mlp.up_proj), "down": w(mlp.down_proj), "lm_head": w(draft.lm_head)}


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
        self._serving: ServingLinears | None = None  # see freeze_for_serving

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

    def freeze_for_serving(self, weights: str = "auto") -> Eagle3Draft:
        """Inference only from now on (the engine's drafter): the projections run on copies packed
        for tide.kernels' GEMM (`ServingLinears`; `weights` "float", "int8" or "auto", see
        `serving_format`); the parameters stay as they are for `state_dict`. A draft being trained
        never calls this: it needs autograd through nn.Linear."""
        self.requires_grad_(False)
        self._serving = ServingLinears(self, weights)
        return self

    @property
    def serving(self) -> ServingLinears | None:
        """The packed projections of a draft frozen for serving, else None."""
        return self._serving

    def rope_rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [..., hd] at `positions`, in `dtype`."""
        cos_t, sin_t = self._rope_tables(positions.device)
        return cos_t[positions].to(dtype), sin_t[positions].to(dtype)

    # --- the engine-facing API ------------------------------------------------------------------

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """fc: concatenated target aux states [..., 3T] -> draft hidden [..., H]."""
        aux = aux.to(self.fc.weight.dtype)
        return self._serving.fc(aux) if self._serving is not None else self.fc(aux)

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
        cos, sin = (t.unsqueeze(1) for t in self.rope_rows(positions, x.dtype))  # [B, 1, q, hd]
        attn, fast = layer.self_attn, self._serving
        if fast is not None:
            q, k, v = fast.qkv(x).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q = apply_rope(q.reshape(B, n, nh, hd).transpose(1, 2), cos, sin)
        k = apply_rope(k.reshape(B, n, nkv, hd).transpose(1, 2), cos, sin)
        v = v.reshape(B, n, nkv, hd).transpose(1, 2)
        o = attend(q, k, v).transpose(1, 2).reshape(B, n, nh * hd)
        if fast is None:
            h = residual + attn.o_proj(o)
            return h + layer.mlp(layer.post_attention_layernorm(h))
        h = residual + fast.o(o)
        return h + fast.down(silu_mul(fast.gate_up(layer.post_attention_layernorm(h))))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] of a step's output."""
        normed = self.norm(out)
        return self._serving.lm_head(normed) if self._serving is not None else self.lm_head(normed)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_to_draft(self) -> torch.Tensor:
        """[V] long: draft id of each target id, -1 where the draft vocabulary lacks it."""
        ids = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        draft = torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device)
        ids[draft + self.d2t] = draft
        return ids


def serving_format(draft: Eagle3Draft, weights: dict[str, torch.Tensor], asked: str = "auto") -> str:
    """The format ServingLinears packs the draft's projections (`weights`) in. "auto": "int8" where
    tide.kernels' int8 GEMM takes every one of this bf16 CPU draft's — the same accept length as
    bf16 and half the bytes a draft step reads (0.15-0.5 ms less a proposal on a Zen 4 guest;
    docs/results/speculation, "A Zen 4 CPU") — else "float"."""
    if asked != "auto":
        return asked
    kern = use_for(draft.fc.weight)
    if kern is None or not getattr(kern, "has_int8_gemm", False) or draft.fc.weight.dtype != torch.bfloat16:
        return "float"
    # Shapes the int8 kernel packs (tide.quant.Int8Linear): output features a multiple of 16, inputs of 4.
    fits = all(w.shape[0] % 16 == 0 and w.shape[1] % 4 == 0 for w in weights.values())
    return "int8" if fits else "float"


def fused_step_kernels(draft: Eagle3Draft):
    """tide.kernels where its `draft_layer` can run this frozen draft's steps (a CPU draft whose
    projections all run on the kernels' GEMM), else None."""
    lin = draft.serving
    kern = use_for(draft.fc.weight) if lin is not None else None
    if kern is None or not kern.has_decode_attention:
        return None
    if any(p.kernel_args is None for p in (lin.qkv, lin.o, lin.gate_up, lin.down)):
        return None
    return kern


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`attend` for a whole sequence in one call with no cache: causal self-attention (GQA)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])

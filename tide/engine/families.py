"""Model families the engine runs: one small description per architecture, one generic forward.

As vLLM's model registry maps a config's `architectures` entry to its implementation, this maps it
to a `Family`: what differs between Llama-shaped decoders (norm placement and form, biases, q/k
norms, activation, embedding scale, weight names). Values that vary within a family (soft-caps,
sliding windows, per-layer RoPE bases) are read from each checkpoint's config by
`tide.engine.llama.LlamaConfig.from_hf`. `tide.engine.llama.LlamaModel` consumes both.

Which path each family takes on CPU (tide.kernels; see `LlamaModel.forward`):
- Llama 2/3.x, SmolLM2, Qwen 2/2.5, Mistral (no sliding window within the served context),
  Phi-3: the fused decode layer (`decode_layer`, one C++ call a layer), as before.
- Qwen 3, Gemma 3, OLMo 2, Mistral / Qwen with a sliding window: the per-op loop on the kernels'
  ops (GEMMs, norms, RoPE + cache writes, attention with the window in its mask); q/k norms and
  sandwich / post norms run as extra norm calls the fused layer does not make.
- Gemma 2: the per-op loop with torch attention (soft-capped scores: the kernels' attention has no
  soft-cap), kernels for everything else.

Mixture-of-experts checkpoints (Mixtral, Qwen2/3-MoE, any config with more than one expert) and
architectures not described here are refused at load (`UnsupportedModel`), naming what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class UnsupportedModel(ValueError):
    """A checkpoint the engine cannot run; the message names the architecture and what is missing."""


# Norm roles within a decoder layer -> weight name under `model.layers.<i>.`. "attn_in"/"mlp_in"
# normalise a sub-block's input (pre-norms), "attn_out"/"mlp_out" its output before the residual
# add (post-norms). Llama's `post_attention_layernorm` is the MLP's pre-norm; Gemma's and OLMo 2's
# of the same name is the attention's post-norm.
PRE_NORMS = {"attn_in": "input_layernorm", "mlp_in": "post_attention_layernorm"}
SANDWICH_NORMS = {"attn_in": "input_layernorm", "attn_out": "post_attention_layernorm",
                  "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"}
POST_NORMS = {"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"}

SPLIT_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
SPLIT_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


@dataclass(frozen=True)
class Family:
    name: str
    norms: dict = field(default_factory=lambda: PRE_NORMS)
    # Weight names whose rows, concatenated in order, are the engine's fused q|k|v and gate|up
    # projections. Phi-3 stores them fused already, in that order (q, k, v; gate, up): one name
    # each, taken as they are.
    qkv: tuple[str, ...] = SPLIT_QKV
    gate_up: tuple[str, ...] = SPLIT_GATE_UP
    qkv_bias: bool = False  # q/k/v biases whatever the config says (Qwen2); else its `attention_bias`
    # RMSNorm of q and k before RoPE: "head" over each head's head_dim (Qwen 3, Gemma 3), "proj"
    # over the whole q (k) projection (OLMo 2); weights `self_attn.q_norm` / `self_attn.k_norm`.
    qk_norm: str | None = None
    norm_offset: float = 0.0  # 1.0: norms scale by (1 + weight) (Gemma's zero-centred weights)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), in the compute dtype (Gemma)
    # Layer types for configs without `layer_types`: "window" = every layer slides when the config
    # has a sliding_window (Mistral), "alternate" = even layers slide (Gemma 2), "pattern" = every
    # n-th layer (n = sliding_window_pattern) is global, the rest slide (Gemma 3).
    default_layers: str = "full"
    rope_per_layer_type: bool = False  # rope_parameters keyed by layer type (Gemma 3's local/global bases)

    @property
    def fused_layer_ok(self) -> bool:
        """Whether the family's layer is what tide.kernels' decode_layer computes (pre-norms,
        plain RMSNorm, no q/k norms); config-dependent features are checked by LlamaModel."""
        return self.norms == PRE_NORMS and self.qk_norm is None and self.norm_offset == 0.0


LLAMA = Family("llama")
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": Family("mistral", default_layers="window"),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True),
    "Qwen3ForCausalLM": Family("qwen3", qk_norm="head"),
    "Gemma2ForCausalLM": Family("gemma2", norms=SANDWICH_NORMS, norm_offset=1.0, embed_scale=True,
                                default_layers="alternate"),
    "Gemma3ForCausalLM": Family("gemma3", norms=SANDWICH_NORMS, norm_offset=1.0, embed_scale=True,
                                qk_norm="head", default_layers="pattern", rope_per_layer_type=True),
    "Phi3ForCausalLM": Family("phi3", qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",)),
    "Olmo2ForCausalLM": Family("olmo2", norms=POST_NORMS, qk_norm="proj"),
}
# Multimodal Gemma 3 checkpoints (4B and up) hold the same text decoder under `text_config`; the
# engine serves its text part (LlamaModel.load finds the decoder's weights under their prefix).
FAMILIES["Gemma3ForConditionalGeneration"] = FAMILIES["Gemma3ForCausalLM"]
# Configs without `architectures` (rare: hand-written ones) are looked up by model_type.
BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "gemma3": "Gemma3ForConditionalGeneration", "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def family_for(cfg: dict) -> tuple[str, Family]:
    """(architecture, Family) of a HF config dict, or UnsupportedModel saying why not."""
    archs = cfg.get("architectures") or [BY_MODEL_TYPE.get(cfg.get("model_type", ""), cfg.get("model_type"))]
    arch = str(archs[0])
    text = cfg.get("text_config") or {}
    for source in (cfg, text):
        experts = max((int(source.get(k) or 0) for k in EXPERT_KEYS), default=0)
        if experts > 1 or "moe" in str(source.get("model_type", "")).lower():
            raise UnsupportedModel(
                f"{arch}: a mixture-of-experts model ({experts or 'routed'} experts); the engine runs dense "
                f"decoders only ({', '.join(sorted(FAMILIES))}): expert routing is missing")
    if arch not in FAMILIES:
        raise UnsupportedModel(f"{arch} (model_type {cfg.get('model_type')!r}) is not a family the engine "
                               f"describes; it runs {', '.join(sorted(FAMILIES))} (tide/engine/families.py)")
    return arch, FAMILIES[arch]


def layer_types(cfg: dict, family: Family, num_layers: int) -> tuple[str, ...]:
    """Each layer's attention, "full_attention" or "sliding_attention", as transformers names them."""
    if cfg.get("layer_types"):
        types = tuple(cfg["layer_types"])
        if len(types) != num_layers:
            raise UnsupportedModel(f"{family.name}: layer_types has {len(types)} entries for {num_layers} layers")
        return types
    full, slide = "full_attention", "sliding_attention"
    if family.default_layers == "window" and cfg.get("sliding_window"):
        return (slide,) * num_layers
    if family.default_layers == "alternate":
        return tuple(slide if i % 2 == 0 else full for i in range(num_layers))
    if family.default_layers == "pattern":
        n = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        return tuple(full if (i + 1) % n == 0 else slide for i in range(num_layers))
    return (full,) * num_layers

"""EAGLE-3 draft configuration: the `config.json` that SGLang's and vLLM's `LlamaForCausalLMEagle3` read.

Aux layer ids, one convention inside TIDE: **index of the target decoder layer whose output is
captured** (0-based), as `tide.engine.llama.LlamaConfig.aux_layers` uses. Default
`(1, L//2 - 1, L - 4)`. The two serving engines spell the same choice differently:

- SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` in this same convention (it adds 1
  internally, because it captures the *input* of layer i+1).
- vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` first (and falls back to
  `eagle_config`), in its own convention: id j = input of layer j = output of layer j-1, so its
  default is `(2, L//2, L-3)`.

So `to_json_dict` writes both, each in its reader's convention, and `from_json_dict` accepts either
(preferring `eagle_config`) and refuses a file where the two disagree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

ARCHITECTURE = "LlamaForCausalLMEagle3"
FORMAT_VERSION = 1  # TIDE's own additions under the "tide" key of config.json

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DraftIncompatible(ValueError):
    """A draft checkpoint is malformed or does not fit the target it is meant to serve."""


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """SGLang's and vLLM's default capture layers for a target with `num_layers` decoder layers."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise DraftIncompatible(f"unsupported torch_dtype {name!r} (one of {sorted(_DTYPES)})")
    return _DTYPES[name]


@dataclass(frozen=True)
class Eagle3Config:
    """Shapes and hyper-parameters of a one-layer EAGLE-3 draft (units: features, tokens, layers)."""

    hidden_size: int  # H: draft width; equals the target's, because the embedding is the target's
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    vocab_size: int  # V: the target's vocabulary
    draft_vocab_size: int  # Vd: rows of the draft lm_head
    target_hidden_size: int  # T: width of each captured target state (fc input is 3T)
    # Captured target layer outputs (TIDE convention, see module doc); None = the engines' default
    # for whatever target serves it (third-party checkpoints often pin nothing).
    aux_layers: tuple[int, ...] | None
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.aux_layers is not None and len(self.aux_layers) != 3:
            raise DraftIncompatible(f"EAGLE-3 uses 3 aux layers, got {list(self.aux_layers)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DraftIncompatible("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise DraftIncompatible(f"draft_vocab_size {self.draft_vocab_size} not in (0, {self.vocab_size}]")
        torch_dtype(self.torch_dtype)

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.torch_dtype)

    @classmethod
    def for_target(cls, target: dict, draft_vocab_size: int, torch_dtype: str = "bfloat16",
                   intermediate_size: int | None = None) -> Eagle3Config:
        """A draft shaped like one decoder layer of `target` (its HF config.json dict)."""
        from tide.target import decoder_config

        t = target_facts(target)
        target = decoder_config(target)  # a multimodal Gemma 3's text decoder
        heads = int(target["num_attention_heads"])
        theta, scaling = draft_rope(target)
        return cls(
            hidden_size=t.hidden_size,
            intermediate_size=int(intermediate_size or target["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(target.get("num_key_value_heads") or heads),
            head_dim=int(target.get("head_dim") or t.hidden_size // heads),
            rms_norm_eps=float(target.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(target.get("max_position_embeddings", 4096)),
            vocab_size=t.vocab_size,
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=t.hidden_size,
            aux_layers=t.aux_layers,
            torch_dtype=torch_dtype,
        )

    def to_json_dict(self, extra: dict | None = None) -> dict:
        """config.json content; `extra` (JSON-able) goes under the "tide" key, which engines ignore."""
        d = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_act": "silu",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,  # SGLang would alias lm_head to the embedding if true
            "torch_dtype": self.torch_dtype,
            "eagle_config": {"use_aux_hidden_state": True},
            "tide": {"format_version": FORMAT_VERSION, **(extra or {})},
        }
        if self.aux_layers is not None:
            d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layers)
            d["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in self.aux_layers]  # vLLM convention
        if self.target_hidden_size != self.hidden_size:
            d["target_hidden_size"] = self.target_hidden_size
        return d

    @classmethod
    def from_json_dict(cls, d: dict) -> Eagle3Config:
        """Parse a config.json dict (ours, SpecForge's or another EAGLE-3 trainer's)."""
        if ARCHITECTURE not in (d.get("architectures") or []):
            raise DraftIncompatible(f"architectures {d.get('architectures')} does not name {ARCHITECTURE}")
        if int(d.get("num_hidden_layers", 1)) != 1:
            raise DraftIncompatible(f"only 1-layer drafts are supported, got {d['num_hidden_layers']}")
        if d.get("hidden_act", "silu") != "silu":
            raise DraftIncompatible(f"hidden_act {d['hidden_act']!r} unsupported (silu only)")
        if d.get("attention_bias") or d.get("mlp_bias") or d.get("bias"):
            raise DraftIncompatible("biases are not supported in the draft layer")
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            return cls(
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", 10000.0)),
                rope_scaling=d.get("rope_scaling"),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                vocab_size=int(d["vocab_size"]),
                draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
                target_hidden_size=int(d.get("target_hidden_size") or hidden),
                aux_layers=_aux_layers_from_json(d),
                torch_dtype=str(d.get("torch_dtype") or "bfloat16"),
            )
        except KeyError as e:
            raise DraftIncompatible(f"config.json lacks {e.args[0]!r}") from None

    def replace(self, **changes) -> Eagle3Config:
        return dataclasses.replace(self, **changes)


def _aux_layers_from_json(d: dict) -> tuple[int, ...] | None:
    sglang = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vllm = d.get("eagle_aux_hidden_state_layer_ids")
    ours = tuple(int(i) for i in sglang) if sglang else None
    theirs = tuple(int(i) - 1 for i in vllm) if vllm else None
    if ours and theirs and ours != theirs:
        raise DraftIncompatible(
            f"eagle_config.eagle_aux_hidden_state_layer_ids {list(sglang)} (layer outputs) and "
            f"eagle_aux_hidden_state_layer_ids {list(vllm)} (layer inputs, vLLM) name different layers")
    return ours or theirs  # None: neither engine is pinned; both use their (identical) default


def draft_rope(target: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) of a draft for `target` (a decoder's HF config dict): the
    target's full-attention RoPE. transformers 5 nests it in `rope_parameters`, keyed by layer type
    where layers differ (Gemma 3: its global base, not the sliding layers' local one); 4.x has
    rope_theta / rope_scaling (Gemma 3's local base apart, in rope_local_base_freq). The draft's one
    layer attends over the whole draft context, as a full-attention layer does; its RoPE is its own
    (trained with it), so any consistent choice serves, and this one is what SGLang derives too.
    A scaling's config-level fields (original_max_position_embeddings: Phi-3) are filled in."""
    params = dict(target.get("rope_parameters") or {})
    if "full_attention" in params:
        params = dict(params["full_attention"] or {})
    theta = float(params.pop("rope_theta", target.get("rope_theta", 10000.0)))
    params.pop("partial_rotary_factor", None)
    scaling = target.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    if scaling and "original_max_position_embeddings" not in scaling and target.get("original_max_position_embeddings"):
        scaling = {**scaling, "original_max_position_embeddings": target["original_max_position_embeddings"]}
    return theta, (dict(scaling) if scaling else None)


@dataclass(frozen=True)
class TargetFacts:
    """What a draft must agree with about its target."""

    vocab_size: int
    hidden_size: int
    aux_layers: tuple[int, ...]


def target_facts(target) -> TargetFacts:
    """From an HF config dict, or an object with vocab_size/hidden_size/aux_layers (engine LlamaConfig)."""
    if isinstance(target, dict):
        from tide.target import decoder_config

        target = decoder_config(target)  # a multimodal Gemma 3's text decoder
        layers = int(target["num_hidden_layers"])
        return TargetFacts(int(target["vocab_size"]), int(target["hidden_size"]), default_aux_layers(layers))
    return TargetFacts(int(target.vocab_size), int(target.hidden_size), tuple(target.aux_layers))

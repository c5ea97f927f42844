"""Every model family (tide.engine.families) equals transformers' own implementation on a tiny
random config made here: prefill and decode through the KV cache, fp32 within 1e-3 of its logits,
and the bf16 path within bf16's rounding; every RoPE scaling transformers has; MoE and undescribed
architectures refused by name; sharded fp16 checkpoints with generation_config.json's stop tokens."""

from __future__ import annotations

import json

import pytest
import torch
from support.engine import FAMILY_TARGETS, save_tiny_target

from tide.engine.families import UnsupportedModel
from tide.engine.llama import ForwardBatch, LlamaModel
from tide.target import TargetFiles

FAMILIES = sorted(FAMILY_TARGETS)
PREFILL, TOTAL = 30, 40  # both past the tiny configs' 12-token sliding window


def _prefill_batch(ids: torch.Tensor) -> ForwardBatch:
    q = ids.shape[1]
    pos = torch.arange(q)[None]
    mask = torch.arange(q)[None, None, None, :] <= pos[:, None, :, None]
    return ForwardBatch(ids, pos, torch.tensor([0]), q, mask, slot_range=(0, 1), prefill=True)


def _hf_logits(target: TargetFiles, ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    # eager: transformers' reference attention (SDPA cannot soft-cap Gemma 2's scores)
    hf = AutoModelForCausalLM.from_pretrained(target.path, dtype=dtype, attn_implementation="eager").eval()
    with torch.inference_mode():
        return hf(ids).logits[0].float()


def _ours(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    """Logits of every position: a prefill of PREFILL tokens, then one decode step a token."""
    cache = model.new_cache(1, 64)
    rows = [model.forward(_prefill_batch(ids[:, :PREFILL]), cache)[0]]
    for i in range(PREFILL, ids.shape[1]):
        fb = ForwardBatch(ids[:, i:i + 1], torch.tensor([[i]]), torch.tensor([0]), i + 1, None, slot_range=(0, 1))
        rows.append(model.forward(fb, cache)[0])
    return torch.cat(rows).float()


def _ids(vocab: int = 96) -> torch.Tensor:
    return torch.randint(0, vocab, (1, TOTAL), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_prefill_and_decode_match_transformers(tmp_path, family):
    target = save_tiny_target(tmp_path, arch=family, layers=2)
    ids = _ids()
    diff = (_ours(LlamaModel.load(target, dtype=torch.float32), ids) - _hf_logits(target, ids)).abs().max()
    assert diff <= 1e-3, (family, float(diff))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_path_matches_transformers(tmp_path, family):
    """bf16 against transformers' bf16 model: the two round at other places (fused projections, norms
    scaled before rounding, float32 attention), so the bound is bf16's: a few of its 2^-8 steps of
    the logits' scale, and the same argmax nearly everywhere."""
    target = save_tiny_target(tmp_path, arch=family, layers=2)
    ids = _ids()
    ours, ref = _ours(LlamaModel.load(target, dtype=torch.bfloat16), ids), _hf_logits(target, ids, torch.bfloat16)
    scale = ref.abs().max()
    assert (ours - ref).abs().max() <= 0.05 * scale, (family, float((ours - ref).abs().max()), float(scale))
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16,
                    "beta_slow": 2, "mscale": 0.9, "mscale_all_dim": 0.7},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64,
                 "short_factor": [1.0 + 0.3 * i for i in range(8)], "long_factor": [2.0 + i for i in range(8)]},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("scaling", sorted(ROPE_SCALINGS))
def test_every_rope_scaling_matches_transformers(tmp_path, scaling):
    params = {"rope_theta": 10000.0, **ROPE_SCALINGS[scaling]}
    target = save_tiny_target(tmp_path, layers=2, rope_parameters=params)
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_type"] == params["rope_type"]
    ids = _ids()
    diff = (_ours(LlamaModel.load(target, dtype=torch.float32), ids) - _hf_logits(target, ids)).abs().max()
    assert diff <= 1e-3, (scaling, float(diff))


def test_phi3_longrope_matches_transformers(tmp_path):
    """Phi-3 (fused qkv and gate_up) with its LongRoPE, original context beside rope_parameters."""
    params = {"rope_theta": 10000.0, **ROPE_SCALINGS["longrope"]}
    target = save_tiny_target(tmp_path, arch="phi3", layers=2, rope_parameters=params,
                              original_max_position_embeddings=64)
    ids = _ids()
    diff = (_ours(LlamaModel.load(target, dtype=torch.float32), ids) - _hf_logits(target, ids)).abs().max()
    assert diff <= 1e-3, float(diff)


def _config_only(tmp_path, config) -> TargetFiles:
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    return TargetFiles("cfg", tmp_path)


@pytest.mark.parametrize("name", ["MixtralConfig", "Qwen3MoeConfig", "Qwen2MoeConfig"])
def test_mixture_of_experts_is_refused_by_name(tmp_path, name):
    import transformers

    cfg = getattr(transformers, name)(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(UnsupportedModel, match="mixture-of-experts") as err:
        LlamaModel.load(_config_only(tmp_path, cfg))
    assert cfg.architectures is None or cfg.architectures[0] in str(err.value)


def test_an_undescribed_architecture_is_refused_by_name(tmp_path):
    from transformers import GPT2Config

    cfg = GPT2Config(n_layer=2)
    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel.*not a family"):
        LlamaModel.load(_config_only(tmp_path, cfg))


def test_partial_rotary_is_refused(tmp_path):
    from transformers import Phi3Config

    cfg = Phi3Config(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     partial_rotary_factor=0.75, pad_token_id=0, eos_token_id=2)
    cfg.architectures = ["Phi3ForCausalLM"]
    with pytest.raises(UnsupportedModel, match="partial rotary"):
        LlamaModel.load(_config_only(tmp_path, cfg))


def test_sharded_fp16_checkpoint_with_generation_config_stops(tmp_path):
    """A sharded fp16 HF directory loads (every shard), and the stop tokens are config.json's and
    generation_config.json's (a list, as Llama 3's and Gemma's instruct models have)."""
    from transformers import AutoModelForCausalLM

    src = save_tiny_target(tmp_path / "src", arch="qwen3", layers=2)
    hf = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float16)
    hf.generation_config.eos_token_id = [2, 7]
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    target = TargetFiles("sharded", tmp_path / "sharded")
    assert len(target.safetensors_files()) > 1
    model = LlamaModel.load(target, dtype=torch.float32)
    assert model.cfg.eos_token_ids == (2, 7)
    ids = _ids()
    assert (_ours(model, ids) - _hf_logits(target, ids)).abs().max() <= 1e-3


def test_which_families_take_the_fused_decode_layer(tmp_path):
    """tide.engine.families' table of paths: the fused layer for Llama-shaped layers only."""
    fused = {}
    for family in FAMILIES:
        fused[family] = LlamaModel.load(save_tiny_target(tmp_path / family, arch=family, layers=2),
                                        dtype=torch.float32)._fused_layer
    # Mistral's tiny config slides (a 12-token window): the per-op loop. Without a window it fuses.
    assert fused == {"llama": True, "qwen2": True, "phi3": True, "mistral": False, "qwen3": False,
                     "gemma2": False, "gemma3": False, "olmo2": False}
    no_window = LlamaModel.load(save_tiny_target(tmp_path / "m2", arch="mistral", layers=2, sliding_window=None),
                                dtype=torch.float32)
    assert no_window._fused_layer and no_window.cfg.sliding_window is None

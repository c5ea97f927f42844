"""Draft checkpoint layout (as SGLang/vLLM load it), round trip, and refusal of bad checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tide.eagle3 import DraftIncompatible, Eagle3Config, load_checkpoint, save_checkpoint, validate_checkpoint_dir
from tide.eagle3.testing import TINY_TARGET as TARGET
from tide.eagle3.testing import TINY_VD as VD
from tide.eagle3.testing import make_draft, run_draft

run = run_draft

# --- layout as the engines read it -------------------------------------------------------------

# Parameters of SGLang's LlamaForCausalLMEagle3 (python/sglang/srt/models/llama_eagle3.py), with
# the embedding set from the target at load time.
SGLANG_PARAMS = {
    "model.fc.weight", "model.midlayer.self_attn.qkv_proj.weight", "model.midlayer.self_attn.o_proj.weight",
    "model.midlayer.mlp.gate_up_proj.weight", "model.midlayer.mlp.down_proj.weight",
    "model.midlayer.input_layernorm.weight", "model.midlayer.hidden_norm.weight",
    "model.midlayer.post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight",
}
# vLLM's Eagle3LlamaForCausalLM (vllm/model_executor/models/llama_eagle3.py).
VLLM_PARAMS = {
    "model.fc.weight", "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight", "model.layers.0.hidden_norm.weight",
    "model.layers.0.post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight",
    "draft_id_to_target_id",
}
STACKED = [(".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
           (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")]


def sglang_name(name: str) -> str | None:
    """SGLang load_weights' name mapping: d2t -> hot tokens, t2d skipped, stacked shards, `model.` prefix."""
    if "d2t" in name:
        return "hot_token_id"
    if "t2d" in name:
        return None
    for shard, fused in STACKED:
        if shard in name:
            name = name.replace(shard, fused)
            break
    return name if name in SGLANG_PARAMS else f"model.{name}"


def vllm_name(name: str) -> str | None:
    name = name.replace("midlayer.", "layers.0.")
    if "t2d" in name:
        return None
    if "d2t" in name:
        return "draft_id_to_target_id"
    if "lm_head" not in name:
        name = "model." + name
    for shard, fused in STACKED:
        if shard in name:
            return name.replace(shard, fused)
    return name


def test_tensor_names_and_shapes_are_what_sglang_and_vllm_load(tmp_path):
    draft, _ = make_draft()
    save_checkpoint(draft, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    sglang = {sglang_name(n) for n in tensors} - {None, "hot_token_id"}
    assert sglang == SGLANG_PARAMS
    assert {vllm_name(n) for n in tensors} - {None} == VLLM_PARAMS
    h, nh, nkv, hd = 64, 4, 2, 16
    assert tensors["fc.weight"].shape == (h, 3 * h)
    qkv_rows = sum(tensors[f"midlayer.self_attn.{p}_proj.weight"].shape[0] for p in "qkv")
    assert qkv_rows == (nh + 2 * nkv) * hd  # rows of SGLang's fused qkv_proj
    for p in "qkv":
        assert tensors[f"midlayer.self_attn.{p}_proj.weight"].shape[1] == 2 * h  # embedding ⊕ hidden
    assert tensors["lm_head.weight"].shape == (VD, h)
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (VD,)
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (TARGET["vocab_size"],)
    assert not any("embed" in n for n in tensors)
    # SGLang's hot tokens are d2t + arange; they must be the target ids the draft emits.
    assert torch.equal(tensors["d2t"] + torch.arange(VD), draft.to_target_ids(torch.arange(VD)))


def test_config_json_is_what_the_engines_read(tmp_path):
    draft, _ = make_draft(dtype="bfloat16")
    save_checkpoint(draft, tmp_path, extra={"version": "v7"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["torch_dtype"]) == (300, VD, "bfloat16")
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang: layer outputs
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: layer inputs
    assert "target_hidden_size" not in cfg
    assert cfg["tide"] == {"format_version": 1, "version": "v7"}
    assert load_file(str(tmp_path / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    wide = Eagle3Config.for_target(TARGET, VD).replace(hidden_size=32)
    assert wide.to_json_dict()["target_hidden_size"] == 64


def test_config_accepts_either_engines_layer_ids_and_refuses_a_conflict():
    d = Eagle3Config.for_target(TARGET, VD).to_json_dict()
    only_vllm = {k: v for k, v in d.items() if k != "eagle_config"}
    assert Eagle3Config.from_json_dict(only_vllm).aux_layers == (1, 3, 4)
    none = {k: v for k, v in only_vllm.items() if k != "eagle_aux_hidden_state_layer_ids"}
    assert Eagle3Config.from_json_dict(none).aux_layers is None  # engines' default
    with pytest.raises(DraftIncompatible, match="name different layers"):
        Eagle3Config.from_json_dict({**d, "eagle_aux_hidden_state_layer_ids": [1, 3, 4]})


# --- round trip --------------------------------------------------------------------------------


def test_round_trip_float32_is_exact(tmp_path):
    draft, embed = make_draft()
    save_checkpoint(draft, tmp_path)
    loaded = load_checkpoint(tmp_path, embed, TARGET)
    assert torch.equal(run(draft), run(loaded))
    for name, t in draft.state_dict().items():
        assert torch.equal(t, loaded.state_dict()[name]), name


def test_round_trip_bfloat16_matches_the_cast_model(tmp_path):
    draft, embed = make_draft(dtype="bfloat16")
    save_checkpoint(draft, tmp_path)
    loaded = load_checkpoint(tmp_path, embed, TARGET)
    assert loaded.fc.weight.dtype == torch.bfloat16
    draft = draft.to(torch.bfloat16)
    draft.set_embedding(embed)
    assert torch.equal(run(draft), run(loaded))


# --- refusals ----------------------------------------------------------------------------------


def _rewrite(tmp_path, change) -> None:
    tensors = load_file(str(tmp_path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("midlayer.hidden_norm.weight"), "missing tensors"),
    (lambda t: t.update(extra=torch.zeros(1)), "unexpected tensors"),
    (lambda t: t.update({"fc.weight": torch.zeros(64, 64)}), "fc.weight has shape"),
    (lambda t: t.update({"lm_head.weight": torch.zeros(VD + 1, 64)}), "lm_head.weight has shape"),
    (lambda t: t.update(d2t=t["d2t"].int()), "d2t has dtype"),
    (lambda t: t.update(d2t=torch.zeros(VD, dtype=torch.long) + 299), "outside the target vocabulary"),
    (lambda t: t.update(d2t=-torch.arange(VD)), "same target id"),
    (lambda t: t.update(t2d=~t["t2d"]), "t2d does not mark"),
    (lambda t: t["norm.weight"].__setitem__(3, float("nan")), "non-finite"),
])
def test_bad_tensors_are_refused(tmp_path, change, message):
    draft, embed = make_draft()
    save_checkpoint(draft, tmp_path)
    _rewrite(tmp_path, change)
    with pytest.raises(DraftIncompatible, match=message):
        validate_checkpoint_dir(tmp_path)
    with pytest.raises(DraftIncompatible, match=message):
        load_checkpoint(tmp_path, embed, TARGET)


@pytest.mark.parametrize("target_change, message", [
    ({"vocab_size": 301}, "vocab_size 300 != target vocab 301"),
    ({"hidden_size": 32}, "target_hidden_size 64 != target hidden 32"),
    ({"num_hidden_layers": 12}, r"aux layers \[1, 3, 4\] != layers the target captures \[1, 5, 8\]"),
])
def test_drafts_for_another_target_are_refused(tmp_path, target_change, message):
    draft, embed = make_draft()
    save_checkpoint(draft, tmp_path)
    validate_checkpoint_dir(tmp_path)  # fine on its own
    with pytest.raises(DraftIncompatible, match=message):
        load_checkpoint(tmp_path, embed, {**TARGET, **target_change})


def test_wrong_embedding_is_refused(tmp_path):
    draft, _ = make_draft()
    save_checkpoint(draft, tmp_path)
    with pytest.raises(DraftIncompatible, match="target embedding"):
        load_checkpoint(tmp_path, torch.zeros(300, 32), TARGET)


def test_broken_files_are_refused(tmp_path):
    draft, _ = make_draft()
    save_checkpoint(draft, tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(DraftIncompatible, match="unreadable"):
        validate_checkpoint_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DraftIncompatible, match="not valid JSON"):
        validate_checkpoint_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(DraftIncompatible, match="does not name LlamaForCausalLMEagle3"):
        validate_checkpoint_dir(tmp_path)
    with pytest.raises(DraftIncompatible, match="no config.json"):
        validate_checkpoint_dir(tmp_path / "absent")


def test_specforge_style_config_without_layer_ids_loads(tmp_path):
    draft, embed = make_draft()
    save_checkpoint(draft, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("eagle_config", "eagle_aux_hidden_state_layer_ids", "tide", "mlp_bias"):
        cfg.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_checkpoint(tmp_path, embed, TARGET)
    assert loaded.cfg.aux_layers is None
    assert torch.equal(run(draft), run(loaded))


def test_a_checkpoint_is_found_in_its_own_dir_or_a_bootstrap_output_and_nowhere_else(tmp_path):
    from tide.eagle3.checkpoint import find_checkpoint_dir

    ckpt, bootstrap = tmp_path / "ckpt", tmp_path / "boot"
    draft, _ = make_draft()
    save_checkpoint(draft, ckpt)
    save_checkpoint(draft, bootstrap / "draft")
    (tmp_path / "empty").mkdir()
    assert find_checkpoint_dir(ckpt) == ckpt
    assert find_checkpoint_dir(str(bootstrap)) == bootstrap / "draft"
    with pytest.raises(FileNotFoundError, match="empty is neither a draft checkpoint nor a bootstrap directory"):
        find_checkpoint_dir(tmp_path / "empty")

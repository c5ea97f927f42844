"""`tide up --target DIR` refuses a checkpoint the engine cannot run before starting anything."""

from __future__ import annotations

import io
import json

from tools.launcher import StackConfig, up


def test_a_mixture_of_experts_target_is_refused_at_start(tmp_path):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    out = io.StringIO()
    assert up(StackConfig(target=str(tmp_path), data_dir=tmp_path / "var"), out=out) == 1
    assert "Qwen3MoeForCausalLM" in out.getvalue() and "mixture-of-experts" in out.getvalue()
    assert not (tmp_path / "var").exists()  # nothing started

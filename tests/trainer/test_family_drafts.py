"""Drafts for any target: `tide draft bootstrap` on a tiny random target of every model family
(tide.engine.families) produces an EAGLE-3 draft that loads as a drafter for that target, and greedy
generation with it speculating emits plain decoding's tokens, with draft tokens proposed.

And what the trainer reads from a target (tide.target.load_head_tensors, TargetHead) is what the
engine computes with: the embedding table, the final norm as a Llama norm multiplies by (Gemma's
1 + w), the lm_head (tied or not, under any decoder prefix), the logits' soft-cap (Gemma 2)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.bootstrap import TINY_BOOTSTRAP, save_tiny_chat_target, write_prompt_file
from support.engine import FAMILY_TARGETS, CyclingGamma, repetitive_prompts, save_tiny_target

from tide.eagle3 import Eagle3Config
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.sequence import SamplingParams
from tide.target import EMBED_TENSOR, LM_HEAD_TENSOR, NORM_TENSOR, TargetFiles, load_head_tensors

# A handful of seconds per family: a few prompts, short outputs, two passes over the data.
FAMILY_BOOTSTRAP = {**TINY_BOOTSTRAP, "minutes": 0.1, "eval_prompts": 4, "max_tokens": 24, "max_epochs": 3,
                    "evals": 2}
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


def bootstrap_family(root, family: str) -> TargetFiles:
    """A bootstrapped draft for a tiny `family` target: the target in root/target, the draft in root/out/draft."""
    from tools.draft.bootstrap import BootstrapConfig, bootstrap

    target = save_tiny_chat_target(root / "target", layers=4, init_std=0.05, arch=family)
    prompts = write_prompt_file(root / "prompts.jsonl", 24)
    bootstrap(BootstrapConfig(**{**FAMILY_BOOTSTRAP, "target": str(root / "target"), "prompts": [str(prompts)],
                                 "out": str(root / "out")}))
    return target


def speculated_equals_plain(model: LlamaModel, drafter) -> int:
    """Greedy outputs with `drafter` at γ = 3 equal plain decoding's; returns the draft tokens verified."""
    prompts = [p for p in repetitive_prompts(8, model.cfg.vocab_size, seed=3) if len(p) >= 9][:4]

    def engine(d=None):
        return LLMEngine(model, EngineConfig(max_batch=4, max_seq_len=128, max_tokens_per_step=64), drafter=d,
                         policy=CyclingGamma([3]) if d is not None else None)

    plain = [s.output_ids for s in engine().generate(prompts, GREEDY)]
    seqs = engine(drafter).generate(prompts, GREEDY)
    assert [s.output_ids for s in seqs] == plain
    return sum(s.draft_tokens for s in seqs)


@pytest.mark.parametrize("family", sorted(FAMILY_TARGETS))
def test_bootstrapped_draft_serves_losslessly_on_every_family(tmp_path, family):
    from tide.engine.drafters.eagle3 import Eagle3Drafter

    target = bootstrap_family(tmp_path, family)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert set(report["accept_length"]) == {"1", "2", "3", "4", "5"}
    model = LlamaModel.load(target, dtype=torch.float32)
    drafter = Eagle3Drafter.from_checkpoint(tmp_path / "out" / "draft", model, "boot", max_batch=4, max_len=160)
    cfg = drafter.draft.cfg
    assert (cfg.vocab_size, cfg.hidden_size, cfg.head_dim) == (model.cfg.vocab_size, model.cfg.hidden_size,
                                                               model.cfg.head_dim)
    assert cfg.rope_theta == model.cfg.rope_theta  # the target's full-attention base (Gemma 3: not the local one)
    assert speculated_equals_plain(model, drafter) > 0


@pytest.mark.parametrize("family", sorted(FAMILY_TARGETS))
def test_head_tensors_are_what_the_engine_computes_with(tmp_path, family):
    """Embedding, final norm and lm_head as the engine holds them (norm offset folded in), and the
    trainer's target logits soft-capped as the HF model's are (Gemma 2)."""
    import transformers

    from services.trainer.training.head import TargetHead

    target = save_tiny_target(tmp_path, arch=family, layers=4)
    model = LlamaModel.load(target, dtype=torch.float32)
    t = load_head_tensors(target)
    assert torch.equal(t[EMBED_TENSOR], model.embed)
    assert torch.equal(t[NORM_TENSOR], model.norm)
    assert torch.equal(t[LM_HEAD_TENSOR], model.lm_head)
    head = TargetHead.load(target)
    assert head.logit_softcap == model.cfg.final_softcap
    hf = transformers.AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32).eval()
    ids = torch.tensor([repetitive_prompts(4, 96, seed=1)[3]])
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    logits = out.hidden_states[-1][0] @ head.lm_head.T  # hidden_states[-1]: after the final norm
    if head.logit_softcap is not None:
        logits = torch.tanh(logits / head.logit_softcap) * head.logit_softcap
    torch.testing.assert_close(logits, out.logits[0], atol=1e-4, rtol=1e-4)


def test_tied_heads_read_the_embedding(tmp_path):
    target = save_tiny_target(tmp_path, arch="gemma2", layers=4, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(target.path / "model.safetensors"))
    t = load_head_tensors(target)
    assert t[LM_HEAD_TENSOR] is t[EMBED_TENSOR]
    assert torch.equal(t[LM_HEAD_TENSOR], LlamaModel.load(target, dtype=torch.float32).lm_head)


def test_a_multimodal_gemma3_checkpoint_gives_its_text_decoders_head_and_draft_shape(tmp_path):
    """Gemma 3 4B and up: the text decoder under `model.language_model.`, its config under
    `text_config`; the head and the draft's shape are the decoder's, its RoPE the global base."""
    text = save_tiny_target(tmp_path / "text", arch="gemma3", layers=4)
    state = load_file(str(text.path / "model.safetensors"))
    mm = tmp_path / "mm"
    mm.mkdir()
    save_file({("lm_head.weight" if k == "lm_head.weight" else "model.language_model." + k[len("model."):]): v
               for k, v in state.items()} | {"model.vision_tower.embed_tokens.weight": torch.zeros(3, 2)},
              str(mm / "model.safetensors"))
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": {**json.loads((text.path / "config.json").read_text()), "model_type": "gemma3_text"}}
    (mm / "config.json").write_text(json.dumps(cfg))
    target = TargetFiles("mm", mm)
    ref = load_head_tensors(text)
    t = load_head_tensors(target)
    assert all(torch.equal(t[k], ref[k]) for k in (EMBED_TENSOR, NORM_TENSOR, LM_HEAD_TENSOR))
    draft = Eagle3Config.for_target(cfg, draft_vocab_size=32)
    assert draft == Eagle3Config.for_target(text.config, draft_vocab_size=32)
    assert draft.rope_theta == 1e6 and draft.head_dim == 16 and draft.aux_layers == (1, 1, 0)

"""Greedy speculative decoding emits exactly plain decoding's tokens on every model family
(tide.engine.families), with chains and with trees, in fp32 and bf16.

The per-family counterpart of test_lossless_greedy.py and test_tree_greedy.py (which cover the
drafters, γ schedules and tree shapes in depth on the Llama tiny target): here each family's tiny
target (4 layers, the fewest an EAGLE-3 draft's captured layers allow) runs a scripted chain drafter
(right and wrong), the EAGLE-3 draft's chains, a scripted tree drafter and EAGLE-3's trees, at batch
4, over prompts and outputs longer than the tiny configs' 12-token sliding windows.
"""

from __future__ import annotations

import pytest
import torch
from support.engine import (
    FAMILY_TARGETS,
    CyclingGamma,
    ScriptedDrafter,
    ScriptedTreeDrafter,
    repetitive_prompts,
    save_tiny_target,
    tiny_eagle3_drafter,
)

from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.sequence import SamplingParams
from tide.policies import FixedTree

VOCAB = 96
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def _engine(model, drafter=None, policy=None) -> LLMEngine:
    return LLMEngine(model, EngineConfig(max_batch=4, max_seq_len=128, max_tokens_per_step=64),
                     drafter=drafter, policy=policy)


@pytest.fixture(scope="module")
def prompts():
    return [p for p in repetitive_prompts(8, VOCAB, seed=2) if len(p) >= 9][:4]  # 9-40 tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILY_TARGETS))
def test_chains_and_trees_equal_plain_decoding(tmp_path, prompts, family, dtype):
    model = LlamaModel.load(save_tiny_target(tmp_path, arch=family, layers=4), dtype=dtype)
    plain = [s.output_ids for s in _engine(model).generate(prompts, GREEDY)]
    assert len({tuple(o) for o in plain}) > 1, "outputs do not depend on the prompt: the test would prove little"
    script = {f"gen-0-{i}": o for i, o in enumerate(plain)}
    runs = {
        "chain-scripted": (ScriptedDrafter(script, VOCAB, corrupt_every=3), CyclingGamma([3, 1, 0, 5, 2])),
        "chain-eagle3": (tiny_eagle3_drafter(model, seed=1, max_batch=4), CyclingGamma([2, 4, 1])),
        "tree-scripted": (ScriptedTreeDrafter(script, VOCAB, corrupt_every=3), FixedTree(4, 3, 8)),
        "tree-eagle3": (tiny_eagle3_drafter(model, seed=2, max_batch=4), FixedTree(3, 2, 6)),
    }
    for name, (drafter, policy) in runs.items():
        seqs = _engine(model, drafter, policy).generate(prompts, GREEDY)
        assert [s.output_ids for s in seqs] == plain, (family, name)
        drafted, accepted = sum(s.draft_tokens for s in seqs), sum(s.accepted_tokens for s in seqs)
        assert drafted > 0, (family, name, "nothing was verified")
        if name.endswith("scripted"):
            assert 0 < accepted < drafted, (family, name)  # accepting and rejecting paths both ran


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "olmo2", "phi3"])
def test_quantized_weights_are_lossless_on_other_families(tmp_path, prompts, family, weights):
    """TIDE_WEIGHTS=int8 / int4 (tide.quant): lossless with respect to the quantized model's own
    plain decoding, on families with extra norms, soft-caps, windows, or fused checkpoint weights."""
    model = LlamaModel.load(save_tiny_target(tmp_path, arch=family, layers=4), dtype=torch.float32,
                            weight_format=weights)
    plain = [s.output_ids for s in _engine(model).generate(prompts, GREEDY)]
    script = {f"gen-0-{i}": o for i, o in enumerate(plain)}
    for drafter, policy in ((ScriptedDrafter(script, VOCAB, corrupt_every=3), CyclingGamma([3, 1, 0, 5, 2])),
                            (ScriptedTreeDrafter(script, VOCAB, corrupt_every=3), FixedTree(4, 3, 8))):
        seqs = _engine(model, drafter, policy).generate(prompts, GREEDY)
        assert [s.output_ids for s in seqs] == plain, (family, weights, type(drafter).__name__)
        assert 0 < sum(s.accepted_tokens for s in seqs) < sum(s.draft_tokens for s in seqs)

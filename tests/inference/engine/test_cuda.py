"""The engine's CUDA path: the same lossless guarantees as on the CPU (runs where a GPU exists).

Skipped, with the reason, on machines without CUDA (CI has none); run on a GPU machine with
`pytest tests/inference/engine/test_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch
from support.engine import ScriptedDrafter, ScriptedTreeDrafter, save_tiny_target, tiny_eagle3_drafter

from tide.engine.drafters import NgramDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.sequence import SamplingParams
from tide.policies import FixedGamma, FixedTree

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def cuda_model(request, tmp_path_factory):
    target = save_tiny_target(tmp_path_factory.mktemp("tiny-cuda"))
    return LlamaModel.load(target, dtype=request.param, device="cuda")


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(3, 96, (max(2, n // 3),), generator=g).tolist() * 3)[:n] for n in (5, 17, 9, 30)]


@pytest.mark.parametrize("kind", ["ngram", "eagle3", "good"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_cuda_greedy_speculative_equals_plain(cuda_model, kind, gamma):
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    cfg = EngineConfig(max_batch=4, max_seq_len=128)
    prompts = _prompts()
    plain = [s.output_ids for s in LLMEngine(cuda_model, cfg).generate(prompts, params)]
    drafter = {"ngram": NgramDrafter,
               "eagle3": lambda: tiny_eagle3_drafter(cuda_model, max_batch=4, max_len=160),
               "good": lambda: ScriptedDrafter({f"gen-0-{i}": o for i, o in enumerate(plain)}, 96, 3)}[kind]()
    spec = LLMEngine(cuda_model, cfg, drafter=drafter, policy=FixedGamma(gamma)).generate(prompts, params)
    assert [s.output_ids for s in spec] == plain
    assert sum(s.draft_tokens for s in spec) > 0


@pytest.mark.parametrize("policy", [FixedGamma(3), FixedTree(3, 2, 6)], ids=["chains", "trees"])
def test_cuda_sampling_runs_with_seeds(cuda_model, policy):
    """Sampled requests on CUDA: seeded runs repeat exactly, with drafted chains or trees."""
    params = [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True) for i in range(4)]
    cfg = EngineConfig(max_batch=4, max_seq_len=128)
    runs = [[s.output_ids for s in LLMEngine(cuda_model, cfg, drafter=tiny_eagle3_drafter(cuda_model, max_batch=4,
                                                                                           max_len=160),
                                             policy=policy).generate(_prompts(), params)] for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("kind", ["eagle3", "scripted"])
@pytest.mark.parametrize("shape", [(2, 2, 3), (4, 3, 8), (6, 4, 24)], ids=lambda s: "d{}k{}n{}".format(*s))
@pytest.mark.parametrize("batch", [1, 4])
def test_cuda_greedy_tree_decoding_equals_plain(cuda_model, kind, shape, batch):
    """Tree verification on the GPU: every node's row equals plain decoding's (bf16 cache included)."""
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    cfg = EngineConfig(max_batch=4, max_seq_len=128)
    prompts = _prompts()[:batch]
    plain = [s.output_ids for s in LLMEngine(cuda_model, cfg).generate(prompts, params)]
    drafter = {"eagle3": lambda: tiny_eagle3_drafter(cuda_model, max_batch=4, max_len=160),
               "scripted": lambda: ScriptedTreeDrafter({f"gen-0-{i}": o for i, o in enumerate(plain)}, 96, 3)}[kind]()
    spec = LLMEngine(cuda_model, cfg, drafter=drafter, policy=FixedTree(*shape)).generate(prompts, params)
    assert [s.output_ids for s in spec] == plain
    assert sum(s.draft_tokens for s in spec) > 0
    if kind == "scripted":
        assert sum(s.accepted_tokens for s in spec) > 0


"""Draft and verify ms of a fresh process's first speculative steps (batch 2, γ = 1).

Usage: .venv/bin/python benchmarks/experiments/first_steps.py DRAFT_DIR
"""

import sys

import torch

from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.sequence import SamplingParams
from tide.policies import FixedGamma
from tide.precision import resolve_dtype
from tide.prompts import encode_prompt, load_prompts
from tide.target import load_tokenizer, resolve_target


class RecordingGamma(FixedGamma):
    """γ = 1 always; keeps every step's feedback."""

    def __init__(self) -> None:
        super().__init__(1)
        self.feedback = []

    def observe(self, feedback) -> None:
        self.feedback.append(feedback)


def main(draft_dir: str) -> None:
    torch.set_num_threads(1)
    target = resolve_target("ref")
    model = LlamaModel.load(target, dtype=resolve_dtype("auto"))
    prompts = [encode_prompt(load_tokenizer(target), p) for p in load_prompts("spec_bench_questions.jsonl", limit=2)]
    policy = RecordingGamma()
    drafter = Eagle3Drafter.from_checkpoint(draft_dir, model, "draft", 16, 1200)
    engine = LLMEngine(model, EngineConfig(max_batch=16, max_seq_len=1024), drafter=drafter, policy=policy)
    engine.generate(prompts, SamplingParams(max_tokens=40))
    for i, f in enumerate(policy.feedback[:8]):
        print(f"step {i}: batch {f.batch_size} draft {f.draft_ms:.1f} ms, verify {f.verify_ms:.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1])

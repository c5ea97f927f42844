"""Engine test support: tiny random Llama-family targets saved as real HF checkpoints, test drafters.

Tiny configs keep each forward under a millisecond, so lossless and statistical tests can run
thousands of steps; the reference model is used by the few tests marked `slow`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tide.engine.drafters.base import DraftAlgorithm, Proposal
from tide.target import TargetFiles


def save_tiny_target(path: Path, vocab: int = 96, layers: int = 8, arch: str = "llama", seed: int = 0,
                     init_std: float = 0.15, **overrides) -> TargetFiles:
    """A random HF checkpoint. init_std well above HF's 0.02 makes logits peaked enough that
    greedy outputs vary with the context instead of repeating one token."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=init_std, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    common.update(overrides)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(head_dim=16, **common))
    model.save_pretrained(path, safe_serialization=True)
    return TargetFiles(model_id=f"tiny-{arch}-{seed}", path=path)



class ScriptedDrafter:
    """Test drafter proposing from a known continuation per request (a "good" draft), corrupting
    every `corrupt_every`-th proposal so that rejections happen too. Weightless; for tests only."""

    algorithm = DraftAlgorithm.NGRAM
    version = "scripted"

    def __init__(self, continuations: dict[str, list[int]], vocab: int, corrupt_every: int = 0) -> None:
        self.continuations = continuations
        self.vocab = vocab
        self.corrupt_every = corrupt_every
        self.calls = 0

    def add_sequence(self, seq) -> None: ...
    def remove_sequence(self, seq) -> None: ...
    def lag(self, seq) -> int:
        return 0

    def propose(self, seqs, gammas, features=None, generators=None) -> Proposal:
        out = []
        for seq, g in zip(seqs, gammas, strict=True):
            self.calls += 1
            cont = self.continuations.get(seq.request_id, [])
            toks = list(cont[seq.num_output:seq.num_output + g])
            if toks and self.corrupt_every and self.calls % self.corrupt_every == 0:
                toks[len(toks) // 2] = (toks[len(toks) // 2] + 1) % self.vocab
            out.append(toks)
        return Proposal(tokens=out, probs=[None] * len(seqs))


class RandomDrafter:
    """Test drafter sampling proposals from a fixed random distribution q over the vocabulary
    (a useless draft with a non-trivial q, which exercises the p/q acceptance rule)."""

    algorithm = DraftAlgorithm.NGRAM
    version = "random"

    def __init__(self, vocab: int, seed: int = 0, sharpness: float = 3.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.q = torch.softmax(torch.randn(vocab, generator=g) * sharpness, dim=-1)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def add_sequence(self, seq) -> None: ...
    def remove_sequence(self, seq) -> None: ...
    def lag(self, seq) -> int:
        return 0

    def propose(self, seqs, gammas, features=None, generators=None) -> Proposal:
        tokens, probs = [], []
        for i, g in enumerate(gammas):
            gen = generators[i] if generators and generators[i] is not None else self.gen
            toks = torch.multinomial(self.q, g, replacement=True, generator=gen).tolist()
            tokens.append(toks)
            probs.append(None if seqs[i].params.greedy else self.q.expand(g, -1))
        return Proposal(tokens=tokens, probs=probs)


class CyclingGamma:
    """Policy cycling through a list of γ values step by step (γ changing mid-request, 0 included)."""

    name = "cycling"

    def __init__(self, gammas: list[int]) -> None:
        self.gammas = gammas
        self.i = 0

    def decide(self, ctx) -> list[int]:
        g = self.gammas[self.i % len(self.gammas)]
        self.i += 1
        return [g] * len(ctx.requests)

    def observe(self, feedback) -> None: ...


def tiny_eagle3_drafter(model, seed: int = 0, draft_vocab: int = 40, max_batch: int = 8, max_len: int = 320):
    """A random (useless) EAGLE-3 drafter that fits `model` (an engine LlamaModel)."""
    from tide.eagle3.testing import make_draft
    from tide.engine.drafters.eagle3 import Eagle3Drafter
    from tide.engine.profiling import target_config

    draft, _ = make_draft(dtype="float32", seed=seed, target=target_config(model.cfg), draft_vocab_size=draft_vocab)
    draft = draft.to(model.dtype)
    draft.set_embedding(model.embed)
    return Eagle3Drafter(draft, f"random-{seed}", max_batch, max_len)

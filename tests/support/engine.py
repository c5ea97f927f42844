"""Engine test support: tiny random Llama-family targets saved as real HF checkpoints, test drafters.

Tiny configs keep each forward under a millisecond, so lossless and statistical tests can run
thousands of steps; the reference model is used by the few tests marked `slow`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tide.engine.drafters.base import DraftAlgorithm, Proposal
from tide.target import TargetFiles

# Per family: transformers' (config class, model class) and what a tiny config of it sets beyond the
# common fields, so that every feature of the family is exercised: sliding windows shorter than
# the tests' sequences (12 tokens; longer than any test tree is deep), soft-caps, an attention
# scale other than head_dim ** -0.5, Gemma 3's two RoPE bases.
FAMILY_TARGETS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"head_dim": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 16, "sliding_window": 12}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 12,
                                                     "query_pre_attn_scalar": 24, "attn_logit_softcapping": 20.0,
                                                     "final_logit_softcapping": 15.0, "pad_token_id": 0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 12,
                                                         "query_pre_attn_scalar": 24, "pad_token_id": 0,
                                                         "sliding_window_pattern": 2}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"pad_token_id": 0}),
}


def save_tiny_target(path: Path, vocab: int = 96, layers: int = 8, arch: str = "llama", seed: int = 0,
                     init_std: float = 0.15, **overrides) -> TargetFiles:
    """A random HF checkpoint of a family in FAMILY_TARGETS. init_std well above HF's 0.02 makes
    logits peaked enough that greedy outputs vary with the context instead of repeating one token."""
    import transformers

    torch.manual_seed(seed)
    config_name, model_name, extra = FAMILY_TARGETS[arch]
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=init_std, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False, **extra)
    common.update(overrides)
    if arch == "gemma3" and "layer_types" not in common:  # sliding, full, sliding, full, ...
        n = common.pop("sliding_window_pattern")
        common["layer_types"] = ["full_attention" if (i + 1) % n == 0 else "sliding_attention"
                                 for i in range(common["num_hidden_layers"])]
    common.pop("sliding_window_pattern", None)
    config = getattr(transformers, config_name)(**common)
    model = getattr(transformers, model_name)(config)
    if arch in ("gemma2", "gemma3", "olmo2"):  # norm weights start at 0 (Gemma) or 1: make them random
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.2)
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


class ScriptedTreeDrafter(ScriptedDrafter):
    """ScriptedDrafter that also grows trees (tide.engine.drafters.TreeDrafter): along the known
    continuation, each path node gets `topk` children, the scripted token among decoys at a place
    that moves from call to call (so accepted paths run through first, middle and last children),
    until the tree holds `tokens` nodes. Every `corrupt_every`-th tree has a wrong token mid-path."""

    def propose_tree(self, seqs, shapes, features=None, generators=None) -> list:
        from tide.engine.tree import DraftTree

        trees = []
        for seq, shape in zip(seqs, shapes, strict=True):
            self.calls += 1
            cont = list(self.continuations.get(seq.request_id, [])[seq.num_output:seq.num_output + shape.depth])
            if cont and self.corrupt_every and self.calls % self.corrupt_every == 0:
                cont[len(cont) // 2] = (cont[len(cont) // 2] + 1) % self.vocab
            tokens, parents, node = [seq.token_ids[-1]], [-1], 0
            for d, tok in enumerate(cont):
                kids = [(tok + 1 + m) % self.vocab for m in range(shape.topk - 1)]
                kids.insert((self.calls + d) % shape.topk, tok)
                nxt = None
                for kid in kids:
                    if len(tokens) - 1 >= shape.tokens:
                        break
                    tokens.append(kid)
                    parents.append(node)
                    if kid == tok:
                        nxt = len(tokens) - 1
                if nxt is None:
                    break
                node = nxt
            trees.append(DraftTree(tuple(tokens), tuple(parents)))
        return trees


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


# ---- exact distributions for the sampling tests ----------------------------------------------

def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of observed `counts` under `probs`; categories expected < min_expected are pooled."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < min_expected
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def target_last_probs(model, ids: list[int], params) -> torch.Tensor:
    """The target's sampling distribution (float64) of the token after `ids`, from a fresh cache."""
    from tide.engine.llama import ForwardBatch
    from tide.engine.sampling import target_probs

    t = torch.tensor([ids])
    pos = torch.arange(len(ids))[None]
    mask = torch.arange(len(ids))[None, None, None, :] <= pos[:, None, :, None]
    logits, _, _ = model.forward(ForwardBatch(t, pos, torch.tensor([0]), len(ids), mask, slot_range=(0, 1)),
                                 model.new_cache(1, len(ids) + 1))
    return target_probs(logits[-1:], params)[0].double()


def exact_first_two(model, prompt: list[int], params) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact distributions of the 1st and 2nd sampled tokens, by enumerating the first token. In
    the engine's order: the prompt as a prefill forward, the first token as a decode step (with
    quantized weights the two take different projections: LlamaModel.prefill_linears)."""
    from tide.engine.llama import ForwardBatch
    from tide.engine.sampling import target_probs

    n = len(prompt)
    cache = model.new_cache(1, n + 2)
    pos = torch.arange(n)[None]
    mask = torch.arange(n)[None, None, None, :] <= pos[:, None, :, None]
    logits, _, _ = model.forward(ForwardBatch(torch.tensor([prompt]), pos, torch.tensor([0]), n, mask,
                                              slot_range=(0, 1), prefill=True), cache)
    p1 = target_probs(logits[-1:], params)[0].double()
    p2 = torch.zeros_like(p1)
    for tok in torch.nonzero(p1 > 0).flatten().tolist():
        logits, _, _ = model.forward(ForwardBatch(torch.tensor([[tok]]), torch.tensor([[n]]), torch.tensor([0]),
                                                  n + 1, None, slot_range=(0, 1)), cache)
        p2 += p1[tok] * target_probs(logits, params)[0].double()
    return p1, p2


def repetitive_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 3-40 tokens, each a short random run repeated (the n-gram drafter finds copies)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 9, 30, 12, 23, 3, 40][:n]
    return [(torch.randint(3, vocab, (max(2, L // 3),), generator=g).tolist() * 3)[:L] for L in lengths]


def sample_many(engine, prompt: list[int], params, n: int = 1000) -> list:
    """n sampled requests of one prompt, 64 at a time: their sequences. With the engine's unseeded
    requests coupled, seeds 0..n-1 (coupled draws keyed by them); with rejection sampling unseeded
    (a seeded request always couples), their generators seeded by the engine's fixed seed."""
    from tide.engine.sampling import SamplingScheme

    seeded = engine.config.unseeded_sampling is SamplingScheme.COUPLED
    seqs = []
    for start in range(0, n, 64):
        batch = [type(params)(**{**params.__dict__, "seed": i if seeded else None})
                 for i in range(start, min(n, start + 64))]
        seqs += engine.generate([prompt] * len(batch), batch)
    return seqs

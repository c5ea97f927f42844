"""A tiny random Llama target (transformers, saved to disk) and chunks generated from it with the
engine's forward (capture on), the way an inference worker produces them."""

from __future__ import annotations

import pytest
import torch

from tide.chunks import ChunkBuilder, encode_chunk
from tide.engine.llama import ForwardBatch, LlamaModel
from tide.target import TargetFiles

TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True}


def make_target(path, seed: int = 0, init: float = 0.02) -> TargetFiles:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY, initializer_range=init))
    model.save_pretrained(path)
    return TargetFiles(model_id="tiny-llama", path=path)


def generate(target: TargetFiles, n_seqs: int, prompt_len: int, gen_len: int, seed: int,
             chunk_tokens: int = 512, vocab: int | None = None) -> list[bytes]:
    """Greedy continuations of random prompts (tokens < `vocab`), all sequences decoded as one
    batch, exported as chunk blobs: every processed token becomes a row; rows whose next token was
    generated are learnable (loss_mask 1)."""
    model = LlamaModel.load(target, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    B, n = n_seqs, prompt_len + gen_len
    cache = model.new_cache(B, n)
    ids = torch.randint(0, vocab or model.cfg.vocab_size, (B, prompt_len), generator=g)
    mask = torch.ones(prompt_len, prompt_len, dtype=torch.bool).tril().expand(B, 1, prompt_len, prompt_len)
    fb = ForwardBatch(ids, torch.arange(prompt_len).expand(B, prompt_len), torch.arange(B), prompt_len, mask,
                      slot_range=(0, B), logits_rows=torch.arange(B) * prompt_len + prompt_len - 1, capture=True)
    logits, final, aux = model.forward(fb, cache)
    tokens, finals, auxs = [ids], [final], [aux]
    for t in range(prompt_len, n):
        tok = logits.argmax(-1).view(B, 1)
        fb = ForwardBatch(tok, torch.full((B, 1), t), torch.arange(B), t + 1, None, slot_range=(0, B), capture=True)
        logits, final, aux = model.forward(fb, cache)
        tokens.append(tok)
        finals.append(final)
        auxs.append(aux)
    tokens, finals, auxs = torch.cat(tokens, 1), torch.cat(finals, 1), torch.cat(auxs, 1)
    positions = torch.arange(n)
    learn = (positions >= prompt_len - 1).to(torch.uint8)  # the next token was generated
    builder = ChunkBuilder(chunk_tokens, model.cfg.hidden_size, target.model_id, worker_id="test")
    blobs: list[bytes] = []
    for s in range(B):
        done = 0
        while done < n:
            done += builder.append(s, tokens[s, done:], positions[done:], auxs[s, done:], finals[s, done:],
                                   learn[done:])
            if builder.free == 0:
                blobs.append(encode_chunk(builder.flush(workload="test", chunk_id=f"test-{seed}-{len(blobs)}")))
    if builder.num_tokens:
        blobs.append(encode_chunk(builder.flush(workload="test", chunk_id=f"test-{seed}-{len(blobs)}")))
    return blobs


@pytest.fixture(scope="session")
def copy_target(tmp_path_factory) -> TargetFiles:
    """Near-zero layers (init 0.005): the residual stream is the token's embedding, the tied head
    picks the current token again, so greedy continuations repeat the last prompt token."""
    return make_target(tmp_path_factory.mktemp("copy-target"), init=0.005)


@pytest.fixture(scope="session")
def copy_chunks(copy_target) -> list[bytes]:
    """Repetitive data: 32 sequences of 8 prompt tokens from an 8-token alphabet + 32 repeats."""
    return generate(copy_target, n_seqs=32, prompt_len=8, gen_len=32, seed=1, vocab=8, chunk_tokens=256)


@pytest.fixture(scope="session")
def wide_target(tmp_path_factory) -> TargetFiles:
    """Wide init (0.2): peaked, context-dependent logits; continuations look random."""
    return make_target(tmp_path_factory.mktemp("wide-target"), init=0.2)


@pytest.fixture(scope="session")
def wide_chunks(wide_target) -> list[bytes]:
    return generate(wide_target, n_seqs=24, prompt_len=8, gen_len=40, seed=2, chunk_tokens=256)

"""Bootstrap test support: a tiny random target with a character-level tokenizer (so prompts go
through the real `encode_prompt` path) and small prompt files."""

from __future__ import annotations

import json
import string
from pathlib import Path

from tests.support.engine import save_tiny_target
from tide.target import TargetFiles

# ids 0..2 are <unk>, <s>, </s> (the tiny config's bos = 1, eos = 2), then printable ASCII
CHARS = string.ascii_lowercase + string.ascii_uppercase + string.digits + " .,;:!?'\"()-+*/=<>\n"


def save_tiny_chat_target(path: Path, seed: int = 0, layers: int = 8, **overrides) -> TargetFiles:
    """`save_tiny_target` plus a character-level HF tokenizer (no chat template: prompts are encoded
    as raw text) in the same directory, loadable with `tide.target.load_tokenizer`."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in CHARS:
        vocab.setdefault(c, len(vocab))
    size = overrides.pop("vocab", 128)
    assert len(vocab) <= size
    target = save_tiny_target(path, vocab=size, layers=layers, seed=seed, **overrides)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return target


def write_prompt_file(path: Path, n: int, seed: int = 0, words: int = 6) -> Path:
    """`n` distinct short prompts as JSONL with a `prompt` field (tide.prompts' generic format)."""
    import random

    rng = random.Random(seed)
    vocab = ["add", "the", "sum", "of", "two", "cats", "dogs", "list", "sort", "print", "x", "y", "is", "a", "loop"]
    lines = []
    for i in range(n):
        text = " ".join(rng.choice(vocab) for _ in range(words)) + f" {i}?"
        lines.append(json.dumps({"prompt": text}))
    path.write_text("\n".join(lines) + "\n")
    return path

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


_CACHE: dict = {}


def tiny_bootstrap(tmp_path_factory, **overrides):
    """One small bootstrap per test session (shared by the test modules that need a trained draft):
    returns (BootstrapConfig, report, paths) with paths = {"target", "prompts", "heldout", "out"}."""
    if "run" in _CACHE:
        return _CACHE["run"]
    from tools.draft.bootstrap import BootstrapConfig, bootstrap

    root = tmp_path_factory.mktemp("bootstrap")
    save_tiny_chat_target(root / "target", layers=4, init_std=0.05)
    paths = {"target": root / "target", "prompts": write_prompt_file(root / "prompts.jsonl", 56),
             "heldout": write_prompt_file(root / "heldout.jsonl", 16, seed=7), "out": root / "out"}
    cfg = BootstrapConfig(**{**TINY_BOOTSTRAP, "target": str(paths["target"]), "prompts": [str(paths["prompts"])],
                             "out": str(paths["out"]), **overrides})
    _CACHE["run"] = (cfg, bootstrap(cfg), paths)
    return _CACHE["run"]


# Settings sized for the tiny target: a few seconds of generation, training capped by epochs.
TINY_BOOTSTRAP = dict(minutes=0.3, gen_fraction=0.4, eval_prompts=8, batch=16, max_tokens=40, draft_vocab=64,
                      evals=3, max_len=256, batch_rows=4, warmup_steps=10, max_epochs=12, dtype="fp32", threads=1,
                      progress=False)

"""The target's tokenizer in the gateway: chat template rendering and prompt token ids.

The gateway tokenizes every prompt itself (GenerateRequest.prompt_token_ids is the preferred
form): it has to count prompt tokens anyway, to refuse prompts longer than the context and to
report usage, and it keeps tokenizer work off the workers' engine threads.

Tokenizing is CPU work that grows with the prompt, so a hostile prompt must not cost much:
- `check_size` refuses, before tokenizing, a text whose UTF-8 size alone proves it cannot fit:
  no token of the vocabulary covers more than `max_token_bytes` bytes of input, so a text of more
  than limit x max_token_bytes bytes has more than `limit` tokens. This never refuses a prompt that
  fits. The bound is used only for tokenizers where it holds (`_size_bounded`: byte-level or
  byte-fallback BPE/Unigram, no normalizer that can shrink text, no pre-tokenizer that drops any,
  no added token that swallows whitespace); for others `max_token_bytes` is None and only the
  body size cap and the time budget apply.
- `run` tokenizes on a dedicated thread pool (never on the event loop) within a time budget; over
  it, the request gets a 503 (`tokenize_timeout`) and work that has not started is dropped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

from services.gateway.errors import SERVER_ERROR, OpenAIError, context_length_exceeded, invalid_request

log = logging.getLogger(__name__)
T = TypeVar("T")
# Tokenizing threads, shared by the gateways of a process (HF fast tokenizers release the GIL).
_POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 2), thread_name_prefix="tide-tokenize")
_SHRINK_SAFE_NORMALIZERS = frozenset({"Prepend", "ByteLevel"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts"})


def _parts(component: dict | None) -> list[dict]:
    """A normalizer or pre-tokenizer spec as the list of its steps (Sequences flattened)."""
    if not component:
        return []
    if component.get("type") == "Sequence":
        inner = component.get("normalizers") or component.get("pretokenizers") or []
        return [p for c in inner for p in _parts(c)]
    return [component]


def _expands(normalizer: dict) -> bool:
    """Whether a normalizer step can only keep or lengthen text (never shrink it)."""
    kind = normalizer.get("type")
    if kind in _SHRINK_SAFE_NORMALIZERS:
        return True
    if kind == "Replace":
        pattern = (normalizer.get("pattern") or {}).get("String")
        return pattern is not None and len(normalizer.get("content", "").encode()) >= len(pattern.encode())
    return False


def _size_bounded(spec: dict) -> bool:
    """Whether every input byte ends up in some token and no token covers more input than its own
    text: then len(text in UTF-8) / max_token_bytes is a lower bound on the token count."""
    model = spec.get("model") or {}
    pre = _parts(spec.get("pre_tokenizer"))
    normalizers = _parts(spec.get("normalizer"))
    byte_level = any(p.get("type") == "ByteLevel" for p in pre + normalizers)
    if model.get("type") not in ("BPE", "Unigram") or not (byte_level or model.get("byte_fallback")):
        return False
    if not all(_expands(n) for n in normalizers):
        return False
    if any(p.get("type") not in _KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed" for p in pre):
        return False
    return not any(a.get("lstrip") or a.get("rstrip") for a in spec.get("added_tokens") or ())


def max_token_bytes(tokenizer: Any) -> int | None:
    """The most bytes of input text one token can cover, or None when no such bound is known (see
    `_size_bounded`). Byte-level vocabularies spell each byte as one character; other tokens are
    counted in UTF-8 (at least what they cover: a SentencePiece "▁" is 3 bytes for 1 space)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    if not _size_bounded(spec):
        return None
    steps = _parts(spec.get("pre_tokenizer")) + _parts(spec.get("normalizer"))
    byte_level = any(p.get("type") == "ByteLevel" for p in steps)
    vocab = backend.get_vocab(with_added_tokens=False)
    longest = max((len(t) if byte_level else len(t.encode()) for t in vocab), default=0)
    added = max((len(a.get("content", "").encode()) for a in spec.get("added_tokens") or ()), default=0)
    return max(longest, added) or None


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How the chat template renders (vLLM's request fields): the assistant generation prompt after
    the messages, or the last (assistant) message left open to be continued; `kwargs`: more
    variables for the template (`chat_template_kwargs`, e.g. {"enable_thinking": false})."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)


def tokenize_timeout(timeout_s: float) -> OpenAIError:
    return OpenAIError(
        503,
        f"Tokenizing the prompt took longer than {timeout_s:g} s (the server is busy or the prompt is very "
        "long); retry later or send a shorter prompt.",
        type=SERVER_ERROR,
        code="tokenize_timeout",
    )


@dataclass(frozen=True)
class TargetTokenizer:
    """A HF tokenizer plus what the gateway needs to know about the model behind it."""

    tokenizer: Any
    model_id: str
    path: Path
    max_model_len: int

    @classmethod
    def load(cls, target: str, max_model_len: int | None = None) -> TargetTokenizer:
        """Load from a target name (see `tide.target.resolve_target`); the context length defaults
        to the model's `max_position_embeddings`."""
        from tide.target import load_tokenizer, resolve_target

        files = resolve_target(target)
        tokenizer = load_tokenizer(files)
        if max_model_len is None:
            config = json.loads((files.path / "config.json").read_text())
            max_model_len = int(config.get("max_position_embeddings") or 2048)
        loaded = cls(tokenizer, files.model_id, files.path, max_model_len)
        log.info(
            "tokenizer loaded",
            extra={
                "model_id": files.model_id,
                "max_model_len": max_model_len,
                "max_token_bytes": loaded.max_token_bytes,
            },
        )
        return loaded

    @cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes of text one token covers (None: unknown, no size check); see `max_token_bytes`."""
        return max_token_bytes(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def check_size(self, text: str, limit: int | None, param: str) -> None:
        """Refuse (context_length_exceeded), without tokenizing it, a text whose UTF-8 size alone proves
        that it has at least `limit` tokens. Never refuses a text that fits."""
        per_token = self.max_token_bytes
        if limit is None or per_token is None:
            return
        bound = limit * per_token
        if len(text) * 4 <= bound:  # fast path: at most 4 bytes per character
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > bound:
            raise context_length_exceeded(
                f"This model's maximum context length is {limit} tokens, but the prompt is {size} bytes of text, "
                f"which is more than {limit} tokens (no token of this model covers more than {per_token} bytes).",
                param,
            )

    def encode(self, text: str, limit: int | None = None, param: str = "prompt") -> list[int]:
        """Token ids of a raw prompt (the tokenizer's usual special tokens, e.g. a BOS, included);
        with `limit`, a text too big for `limit` tokens is refused before tokenizing (`check_size`)."""
        self.check_size(text, limit, param)
        return list(self.tokenizer(text)["input_ids"])

    def encode_chat(self, messages: list[dict[str, str]], limit: int | None = None,
                    template: ChatTemplateOptions | None = None) -> list[int]:
        """Render the chat template (by default with the assistant generation prompt; `template`:
        vLLM's options) and tokenize the result; with `limit`, a rendering too big for `limit` tokens
        is refused before tokenizing.

        The template writes the special tokens itself, so none are added on top."""
        if not self.has_chat_template:
            raise invalid_request("This model has no chat template; use /v1/completions.", "messages")
        template = template or ChatTemplateOptions()
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=template.add_generation_prompt,
                continue_final_message=template.continue_final_message, **template.kwargs,
            )
        except Exception as err:  # jinja2 errors, including a template's raise_exception()
            raise invalid_request(f"The chat template could not render these messages: {err}", "messages") from None
        self.check_size(text, limit, "messages")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def run(self, work: Callable[[], T], timeout_s: float) -> T:
        """`work()` (tokenizing) on the tokenizer threads, within `timeout_s` seconds (waiting for a
        thread included); over it, a 503 `tokenize_timeout` (work not yet started never runs)."""
        future = asyncio.get_running_loop().run_in_executor(_POOL, work)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            log.warning("tokenizing timed out", extra={"timeout_s": timeout_s})
            raise tokenize_timeout(timeout_s) from None

    async def aencode(self, text: str, limit: int | None = None, timeout_s: float = 10.0) -> list[int]:
        return await self.run(lambda: self.encode(text, limit), timeout_s)

    async def aencode_chat(
        self, messages: list[dict[str, str]], limit: int | None = None, timeout_s: float = 10.0,
        template: ChatTemplateOptions | None = None,
    ) -> list[int]:
        return await self.run(lambda: self.encode_chat(messages, limit, template), timeout_s)

    def check_ids(self, ids: list[int], param: str = "prompt") -> None:
        """Refuse token ids outside the vocabulary."""
        size = self.vocab_size
        bad = next((i for i in ids if not 0 <= i < size), None)
        if bad is not None:
            raise OpenAIError(
                400,
                f"Invalid value for '{param}': token id {bad} is outside the vocabulary [0, {size}).",
                param=param,
                code="invalid_value",
            )

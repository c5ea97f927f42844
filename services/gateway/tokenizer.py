"""The target's tokenizer in the gateway: chat template rendering and prompt token ids.

The gateway tokenizes every prompt itself (GenerateRequest.prompt_token_ids is the preferred
form): it has to count prompt tokens anyway, to refuse prompts longer than the context and to
report usage, and it keeps tokenizer work off the workers' engine threads.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.gateway.errors import OpenAIError, invalid_request

log = logging.getLogger(__name__)


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
        from transformers import AutoTokenizer

        from tide.target import resolve_target

        files = resolve_target(target)
        tokenizer = AutoTokenizer.from_pretrained(str(files.path))
        if max_model_len is None:
            config = json.loads((files.path / "config.json").read_text())
            max_model_len = int(config.get("max_position_embeddings") or 2048)
        log.info("tokenizer loaded", extra={"model_id": files.model_id, "max_model_len": max_model_len})
        return cls(tokenizer, files.model_id, files.path, max_model_len)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Token ids of a raw prompt (the tokenizer's usual special tokens, e.g. a BOS, included)."""
        return list(self.tokenizer(text)["input_ids"])

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Render the chat template with the assistant generation prompt and tokenize the result.

        The template writes the special tokens itself, so none are added on top."""
        if not self.has_chat_template:
            raise invalid_request("This model has no chat template; use /v1/completions.", "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # jinja2 errors, including a template's raise_exception()
            raise invalid_request(f"The chat template could not render these messages: {err}", "messages") from None
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def aencode(self, text: str) -> list[int]:
        return await asyncio.to_thread(self.encode, text)

    async def aencode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return await asyncio.to_thread(self.encode_chat, messages)

    def check_ids(self, ids: list[int], param: str = "prompt") -> None:
        """Refuse token ids outside the vocabulary."""
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise OpenAIError(
                400,
                f"Token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}).",
                param=param,
                code="invalid_value",
            )

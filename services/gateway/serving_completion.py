"""/v1/completions: raw prompt(s) -> token ids -> n requests per prompt -> a response or an SSE stream.

`prompt` may be a string, a list of strings, a list of token ids or a list of token-id lists;
choice index = prompt index * n + i (OpenAI's order). Streams follow the chat endpoint's rules
(exactly one finish_reason per choice, optional usage chunk, [DONE] last, `speculation` on the
last chunk) with `text` instead of `delta`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from services.gateway.errors import invalid_request
from services.gateway.protocol import MAX_PROMPTS, CompletionChoice, CompletionRequest, CompletionResponse
from services.gateway.serving_engine import OpenAIServing


class OpenAIServingCompletion(OpenAIServing):
    endpoint = "/v1/completions"

    async def _tokenize(self, request: CompletionRequest, limit: int) -> list[list[int]]:
        """Token ids of every prompt. Id lists are checked (length, then vocabulary) before any text
        is tokenized; texts are tokenized together, in one job within the request's time budget."""
        prompts = request.prompts()
        if not prompts:
            raise invalid_request("The prompt is empty.", "prompt", "invalid_value")
        if len(prompts) > MAX_PROMPTS:
            raise invalid_request(f"At most {MAX_PROMPTS} prompts per request.", "prompt", "invalid_value")
        if len(prompts) * request.n > self.max_n * MAX_PROMPTS:
            raise invalid_request("Too many choices in one request.", "n", "invalid_value")
        for p in prompts:
            if not isinstance(p, str):
                self.check_length(len(p), None, "prompt", "max_tokens", limit)
                self.tokenizer.check_ids(p, "prompt")
        texts = [p for p in prompts if isinstance(p, str)]
        if texts:
            encoded = iter(
                await self.tokenizer.run(
                    lambda: [self.tokenizer.encode(t, limit) for t in texts], self.tokenize_timeout_s
                )
            )
        return [next(encoded) if isinstance(p, str) else list(p) for p in prompts]

    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """A full response, or (stream=True) an iterator of SSE lines (see the chat endpoint)."""
        arrival = time.perf_counter()
        self.check_common(request)
        limit = self.models.max_model_len
        prompts = await self._tokenize(request, limit)
        max_tokens = [self.check_length(len(p), request.max_tokens, "prompt", "max_tokens", limit) for p in prompts]
        response_id = f"cmpl-{uuid.uuid4().hex}"
        return await self.respond(
            request,
            CompletionResponse,
            response_id,
            self.fan_out(response_id, request, prompts, max_tokens),
            sum(len(p) for p in prompts),
            arrival,
            choice=lambda i, s: CompletionChoice(index=i, text=s.text, finish_reason=s.final.finish_reason),
            delta_choice=lambda i, text: CompletionChoice(index=i, text=text),
            finish_choice=lambda i, reason: CompletionChoice(index=i, text="", finish_reason=reason),
        )

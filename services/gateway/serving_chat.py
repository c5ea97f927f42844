"""/v1/chat/completions: chat template -> token ids -> n worker requests -> a response or an SSE stream.

Stream format (OpenAI's): one chunk per choice with `{"role": "assistant", "content": ""}` first,
then `{"content": ...}` deltas, then per choice exactly one chunk with `delta: {}` and its
`finish_reason`; with `stream_options.include_usage`, every chunk has `"usage": null` and a last
chunk with `choices: []` carries the usage; then `data: [DONE]`. The last chunk before [DONE]
carries TIDE's `speculation` object. A failure after the stream started is sent as an
`{"error": {...}}` event and the stream ends without [DONE].
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from services.gateway.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
    ResponseMessage,
)
from services.gateway.serving_engine import OpenAIServing


class OpenAIServingChat(OpenAIServing):
    endpoint = "/v1/chat/completions"

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """A full response, or (stream=True) an iterator of SSE lines whose first event has
        already arrived: errors before any output raise `OpenAIError` here, not inside the stream."""
        arrival = time.perf_counter()
        self.check_common(request)
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in request.messages
        ]
        limit = self.models.max_model_len
        prompt = await self.tokenizer.aencode_chat(messages, limit, self.tokenize_timeout_s)
        requested = request.max_completion_tokens or request.max_tokens
        param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        max_tokens = self.check_length(len(prompt), requested, "messages", param, limit)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        return await self.respond(
            request,
            ChatCompletionResponse,
            response_id,
            self.fan_out(response_id, request, [prompt], [max_tokens]),
            len(prompt),
            arrival,
            choice=lambda i, s: ChatCompletionChoice(
                index=i, message=ResponseMessage(content=s.text), finish_reason=s.final.finish_reason
            ),
            delta_choice=lambda i, text: ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=text)),
            finish_choice=lambda i, reason: ChatCompletionStreamChoice(
                index=i, delta=DeltaMessage(), finish_reason=reason
            ),
            role_choice=lambda i: ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")),
            chunk_cls=ChatCompletionStreamResponse,
        )

"""/v1/chat/completions: chat template -> token ids -> n worker requests -> a response or an SSE stream.

Stream format (OpenAI's): one chunk per choice with `{"role": "assistant", "content": ""}` first,
then `{"content": ...}` deltas, then per choice exactly one chunk with `delta: {}` and its
`finish_reason`; with `stream_options.include_usage`, every chunk has `"usage": null` and a last
chunk with `choices: []` carries the usage; then `data: [DONE]`. The last chunk before [DONE]
carries TIDE's `speculation` object. A failure after the stream started is sent as an
`{"error": {...}}` event and the stream ends without [DONE].

`logprobs: true` (with `top_logprobs` 0..20 alternatives; `top_logprobs` > 0 without it is a 400, as
OpenAI answers) gives each choice `logprobs: {"content": [{"token", "logprob", "bytes",
"top_logprobs": [...]}], "refusal": null}`, one entry per token of its content; streamed, each
chunk's choice carries the entries of its tokens.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from services.gateway.engine_client import TokenDelta, TokenLogprob
from services.gateway.errors import invalid_request
from services.gateway.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTokenLogprob,
    ChoiceLogprobs,
    DeltaMessage,
    ResponseMessage,
    TopLogprob,
)
from services.gateway.serving_engine import OpenAIServing


class OpenAIServingChat(OpenAIServing):
    endpoint = "/v1/chat/completions"

    def logprob_counts(self, request: ChatCompletionRequest) -> tuple[int | None, int | None]:
        return (request.top_logprobs or 0) if request.logprobs else None, None

    def top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        text, raw = self.token_text(token_id)
        return TopLogprob(token=text, logprob=self.logprob_value(logprob), bytes=raw)

    def choice_logprobs(self, request: ChatCompletionRequest, entries: list[TokenLogprob]) -> ChoiceLogprobs | None:
        """The `logprobs` of a choice (or of a streamed chunk's tokens); None when not requested."""
        if not request.logprobs:
            return None
        content = [
            ChatCompletionTokenLogprob(
                **self.top_logprob(e.token_id, e.logprob).model_dump(),
                top_logprobs=[self.top_logprob(t, v) for t, v in e.top],
            )
            for e in entries
        ]
        return ChoiceLogprobs(content=content)

    def delta_choice(self, request: ChatCompletionRequest, index: int, event: TokenDelta) -> ChatCompletionStreamChoice:
        return ChatCompletionStreamChoice(
            index=index, delta=DeltaMessage(content=event.text), logprobs=self.choice_logprobs(request, event.logprobs)
        )

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """A full response, or (stream=True) an iterator of SSE lines whose first event has
        already arrived: errors before any output raise `OpenAIError` here, not inside the stream."""
        arrival = time.perf_counter()
        self.check_common(request)
        if request.top_logprobs and not request.logprobs:
            raise invalid_request(
                "Invalid value for 'top_logprobs': top_logprobs requires logprobs to be set to true.",
                "top_logprobs",
                "invalid_value",
            )
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
                index=i,
                message=ResponseMessage(content=s.text),
                logprobs=self.choice_logprobs(request, s.logprobs),
                finish_reason=s.final.finish_reason,
            ),
            delta_choice=lambda i, event: self.delta_choice(request, i, event),
            finish_choice=lambda i, reason: ChatCompletionStreamChoice(
                index=i, delta=DeltaMessage(), finish_reason=reason
            ),
            role_choice=lambda i: ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")),
            chunk_cls=ChatCompletionStreamResponse,
        )

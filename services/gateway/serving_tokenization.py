"""vLLM's /tokenize and /detokenize: the token ids a prompt (or a chat's messages) becomes here, and the
text of token ids; no worker is involved. A prompt is tokenized as /v1/completions tokenizes it, messages
are rendered as /v1/chat/completions renders them (chat template options included), so `count` is the
`usage.prompt_tokens` those endpoints would report. No context limit applies (counting a prompt that is
too long is what a client asks this for); the body size and the tokenize timeout bound the work."""

from __future__ import annotations

from services.gateway.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from services.gateway.serving_chat import template_options
from services.gateway.serving_models import OpenAIServingModels
from services.gateway.tokenizer import TargetTokenizer
from services.gateway.tool_calls import render_messages


class OpenAIServingTokenization:
    def __init__(self, models: OpenAIServingModels, tokenizer: TargetTokenizer, tokenize_timeout_s: float) -> None:
        self.models = models
        self.tokenizer = tokenizer
        self.tokenize_timeout_s = tokenize_timeout_s

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.models.check(request.model)
        if request.messages is not None:
            options = template_options(request)
            messages = render_messages(request.messages, None)
            ids = await self.tokenizer.aencode_chat(messages, None, self.tokenize_timeout_s, options)
        else:
            ids = await self.tokenizer.aencode(request.prompt, None, self.tokenize_timeout_s)
        return TokenizeResponse(count=len(ids), max_model_len=self.models.max_model_len, tokens=ids)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.models.check(request.model)
        self.tokenizer.check_ids(request.tokens, "tokens")
        decode = self.tokenizer.tokenizer.decode
        text = await self.tokenizer.run(lambda: decode(request.tokens), self.tokenize_timeout_s)
        return DetokenizeResponse(prompt=text)

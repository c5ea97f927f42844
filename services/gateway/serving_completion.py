"""/v1/completions: raw prompt(s) -> token ids -> n requests per prompt -> a response or an SSE stream.

`prompt` may be a string, a list of strings, a list of token ids or a list of token-id lists;
choice index = prompt index * n + i (OpenAI's order). Streams follow the chat endpoint's rules
(exactly one finish_reason per choice, optional usage chunk, [DONE] last, `speculation` on the
last chunk) with `text` instead of `delta`.

`logprobs: N` (0..5) gives each choice `logprobs: {"text_offset", "token_logprobs", "tokens",
"top_logprobs"}` over the tokens of its text (top_logprobs: the N most likely tokens' text ->
logprob, and the token's own, so `logprobs: 0` gives the sampled token's: OpenAI's up to N + 1);
`echo: true` puts the prompt before the completion, in the text and (with logprobs) in those
lists, the first prompt token's logprob and top_logprobs null. Streamed, each chunk carries its
tokens' lists (offsets continuing), the prompt's with the choice's first chunk.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from services.gateway.engine_client import TokenDelta, TokenLogprob
from services.gateway.errors import invalid_request
from services.gateway.protocol import (
    MAX_PROMPTS,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from services.gateway.serving_engine import ChoiceState, OpenAIServing, guided_constraint


class OpenAIServingCompletion(OpenAIServing):
    endpoint = "/v1/completions"

    def logprob_counts(self, request: CompletionRequest) -> tuple[int | None, int | None]:
        # echo's logprobs and vLLM's prompt_logprobs share the worker's prompt entries: the larger count
        counts = [n for n in (request.logprobs if request.echo else None, request.prompt_logprobs) if n is not None]
        return request.logprobs, max(counts) if counts else None

    def completion_logprobs(
        self,
        entries: list[TokenLogprob],
        offset: int,
        first_prompt_token: int | None = None,
        prompt_entries: tuple[TokenLogprob, ...] = (),
    ) -> tuple[CompletionLogprobs, int]:
        """The lists over `entries` (after the prompt's, with echo: its first token without a logprob),
        text offsets from `offset`; and the offset after them."""
        out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])

        def add(token_id: int, logprob: float | None, top) -> None:
            nonlocal offset
            text, _ = self.token_text(token_id)
            out.text_offset.append(offset)
            out.tokens.append(text)
            out.token_logprobs.append(None if logprob is None else self.logprob_value(logprob))
            alternatives = None
            if top is not None:  # the N most likely, and the token itself (OpenAI: up to N + 1 entries)
                alternatives = {self.token_text(t)[0]: self.logprob_value(v) for t, v in top}
                alternatives.setdefault(text, self.logprob_value(logprob))
            out.top_logprobs.append(alternatives)
            offset += len(text)

        if first_prompt_token is not None:
            add(first_prompt_token, None, None)
        for e in (*prompt_entries, *entries):
            add(e.token_id, e.logprob, e.top)
        return out, offset

    def choice(self, request: CompletionRequest, index: int, state: ChoiceState, prompt: tuple[str, list[int]]):
        echo_text, prompt_ids = prompt
        logprobs = None
        if request.logprobs is not None:
            entries = tuple(TokenLogprob(e.token_id, e.logprob, e.top[:request.logprobs])
                            for e in state.prompt_logprobs or ())
            head = (prompt_ids[0], entries) if request.echo else (None, ())
            logprobs, _ = self.completion_logprobs(state.logprobs, 0, *head)
        text = echo_text + state.text if request.echo else state.text
        prompt_logprobs = None
        if request.prompt_logprobs is not None:
            top = request.prompt_logprobs
            prompt_logprobs = self.prompt_logprobs(
                tuple(TokenLogprob(e.token_id, e.logprob, e.top[:top]) for e in state.prompt_logprobs or ())
            )
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=state.final.finish_reason,
                                prompt_logprobs=prompt_logprobs)

    def stream_choices(self, request: CompletionRequest, prompts: list[tuple[str, list[int]]]):
        """`delta_choice` and `finish_choice` of a stream: the prompt (echo) goes with a choice's first
        chunk (its finish chunk if it had no other); offsets run on."""
        offsets: dict[int, int] = {}

        def delta(index: int, event: TokenDelta) -> CompletionChoice:
            echo_text, prompt_ids = prompts[index // request.n]
            first = index not in offsets
            text = echo_text + event.text if first and request.echo else event.text
            logprobs = None
            if request.logprobs is not None:
                head = (prompt_ids[0], event.prompt_logprobs or ()) if first and request.echo else (None, ())
                logprobs, offsets[index] = self.completion_logprobs(event.logprobs, offsets.get(index, 0), *head)
            else:
                offsets[index] = 0
            return CompletionChoice(index=index, text=text, logprobs=logprobs)

        def finish(index: int, reason: str) -> CompletionChoice:
            if request.echo and index not in offsets:
                choice = delta(index, TokenDelta((), ""))
                choice.finish_reason = reason
                return choice
            return CompletionChoice(index=index, text="", finish_reason=reason)

        return delta, finish

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
        truncate = request.truncate_prompt_tokens is not None
        # A prompt to be truncated may be longer than the context: only the body size bounds it then.
        size_limit = None if truncate else limit
        for p in prompts:
            if not isinstance(p, str):
                if not truncate:
                    self.check_length(len(p), None, "prompt", "max_tokens", limit)
                self.tokenizer.check_ids(p, "prompt")
        texts = [p for p in prompts if isinstance(p, str)]
        if texts:
            encoded = iter(
                await self.tokenizer.run(
                    lambda: [self.tokenizer.encode(t, size_limit) for t in texts], self.tokenize_timeout_s
                )
            )
        return [self.truncated(next(encoded) if isinstance(p, str) else list(p), request) for p in prompts]

    async def create_completion(
        self, request: CompletionRequest, key_id: str = ""
    ) -> CompletionResponse | AsyncIterator[str]:
        """A full response, or (stream=True) an iterator of SSE lines (see the chat endpoint)."""
        arrival = time.perf_counter()
        self.check_common(request)
        constraint, constraint_param = guided_constraint(request)
        limit = self.models.max_model_len
        prompts = await self._tokenize(request, limit)
        max_tokens = [self.check_length(len(p), request.max_tokens, "prompt", "max_tokens", limit) for p in prompts]
        response_id = f"cmpl-{uuid.uuid4().hex}"
        echoed = [("", ids) for ids in prompts]
        if request.echo:
            texts = request.prompts()
            echoed = [
                # a truncated prompt is echoed as what was kept
                (t if isinstance(t, str) and request.truncate_prompt_tokens is None
                 else self.tokenizer.tokenizer.decode(ids), ids)
                for t, ids in zip(texts, prompts, strict=True)
            ]
        delta_choice, finish_choice = self.stream_choices(request, echoed)
        return await self.respond(
            request,
            CompletionResponse,
            response_id,
            self.fan_out(response_id, request, prompts, max_tokens, constraint, key_id),
            sum(len(p) for p in prompts),
            arrival,
            choice=lambda i, s: self.choice(request, i, s, echoed[i // request.n]),
            delta_choice=delta_choice,
            finish_choice=finish_choice,
            constraint_param=constraint_param,
        )

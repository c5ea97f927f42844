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

`response_format` constrains the output (tide.v1 SamplingParams.constraint): `json_object` to a
JSON object, `json_schema` to its `schema` (a worker that cannot compile it answers a 400 naming
`response_format`). `tools` follow tool_calls.py: with `tool_choice` "auto" the calls the model
wrote are parsed out of its text; "required" and a named function constrain the output to calls.
A choice with calls has `message.tool_calls` (ids `call_...`, arguments as JSON text), its content
null unless the model also wrote text, and `finish_reason: "tool_calls"`; streamed, each call
comes as OpenAI's deltas: `{index, id, type, function: {name, arguments: ""}}`, then
`{index, function: {arguments: <more>}}`. Without `parallel_tool_calls` (true by default) a choice
has at most one call. With tools, `logprobs` cover every generated token (tool-call text included).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from services.gateway.engine_client import Constraint, TokenDelta, TokenLogprob
from services.gateway.errors import invalid_request
from services.gateway.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTokenLogprob,
    ChoiceLogprobs,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    ResponseMessage,
    ToolCall,
    TopLogprob,
)
from services.gateway.serving_engine import ChoiceState, OpenAIServing, guided_constraint
from services.gateway.tokenizer import ChatTemplateOptions
from services.gateway.tool_calls import (
    CallArguments,
    CallStart,
    Content,
    Event,
    ToolCallParser,
    collect,
    forced_call_schema,
    render_messages,
)


def constraint_of(request: ChatCompletionRequest) -> tuple[Constraint | None, str | None]:
    """The output constraint a request asks for, and the parameter it comes from: its tools'
    or response_format's, or vLLM's guided_* ones (a 400 when both are asked for)."""
    constraint, param = _openai_constraint(request)
    guided, guided_param = guided_constraint(request)
    if guided is None:
        return constraint, param
    if constraint is not None:
        raise invalid_request(f"{guided_param} cannot be combined with {param}'s output constraint.",
                              guided_param, "invalid_value")
    return guided, guided_param


def _openai_constraint(request: ChatCompletionRequest) -> tuple[Constraint | None, str | None]:
    mode = request.tool_mode()
    if mode in ("required", "named"):
        tools = request.tools or []
        name = request.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
        schema = forced_call_schema(tools, name, request.parallel_tool_calls is not False)
        return Constraint("json_schema", json.dumps(schema, ensure_ascii=False)), "tools"
    fmt = request.response_format
    if isinstance(fmt, ResponseFormatJsonObject):
        return Constraint("json_object"), "response_format"
    if isinstance(fmt, ResponseFormatJsonSchema):
        schema = fmt.json_schema.schema_
        if schema is None:
            return Constraint("json_object"), "response_format"
        return Constraint("json_schema", json.dumps(schema, ensure_ascii=False)), "response_format"
    return None, None


# apply_chat_template's own arguments: not template variables (chat_template_kwargs must not set them)
_RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def template_options(request: ChatCompletionRequest) -> ChatTemplateOptions:
    """vLLM's chat template fields, checked: continuing the final message needs an assistant's last and
    no generation prompt (which it turns off unless set explicitly)."""
    kwargs = dict(request.chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_ARGS & set(kwargs))
    if reserved:
        raise invalid_request(f"chat_template_kwargs cannot set {', '.join(reserved)}.", "chat_template_kwargs",
                              "invalid_value")
    add_prompt = request.add_generation_prompt
    if request.continue_final_message:
        if "add_generation_prompt" in request.model_fields_set and add_prompt:
            raise invalid_request("continue_final_message and add_generation_prompt cannot both be true.",
                                  "continue_final_message", "invalid_value")
        if request.messages[-1].role != "assistant":
            raise invalid_request("continue_final_message needs the last message to be an assistant's.",
                                  "continue_final_message", "invalid_value")
        add_prompt = False
    return ChatTemplateOptions(add_prompt, request.continue_final_message, kwargs)


class _ToolStream:
    """One choice's tool-call parsing while it streams: parser events as OpenAI's delta choices."""

    def __init__(self, request: ChatCompletionRequest, mode: str) -> None:
        names = frozenset(t.function.name for t in request.tools or ())
        self.parser = ToolCallParser("json" if mode in ("required", "named") else "tagged", names)
        self.single = request.parallel_tool_calls is False
        self.logprobs: list[TokenLogprob] = []  # entries not yet sent (their text is held back)
        self.called = False

    def kept(self, events: list[Event]) -> list[Event]:
        """Without parallel calls, only the first call."""
        out = [e for e in events if not (self.single and isinstance(e, CallStart | CallArguments) and e.index > 0)]
        self.called = self.called or any(isinstance(e, CallStart) for e in out)
        return out


def _delta(event: Event) -> DeltaMessage:
    if isinstance(event, Content):
        return DeltaMessage(content=event.text)
    if isinstance(event, CallStart):
        call = DeltaToolCall(
            index=event.index, id=event.id, type="function", function=DeltaFunctionCall(name=event.name, arguments="")
        )
    else:
        call = DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.text))
    return DeltaMessage(tool_calls=[call])


class OpenAIServingChat(OpenAIServing):
    endpoint = "/v1/chat/completions"

    def logprob_counts(self, request: ChatCompletionRequest) -> tuple[int | None, int | None]:
        return (request.top_logprobs or 0) if request.logprobs else None, request.prompt_logprobs

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

    def tool_stream(self, request: ChatCompletionRequest, mode: str):
        """`delta_choice` and `finish_choice` of a stream whose choices' text is parsed for tool calls."""
        streams: dict[int, _ToolStream] = {}

        def choices(index: int, events: list[Event], finish: str | None) -> list[ChatCompletionStreamChoice]:
            state = streams[index]
            out = []
            for e in events:
                logprobs = self.choice_logprobs(request, state.logprobs) if state.logprobs else None
                state.logprobs = []
                out.append(ChatCompletionStreamChoice(index=index, delta=_delta(e), logprobs=logprobs))
            if finish is not None:
                logprobs = self.choice_logprobs(request, state.logprobs) if state.logprobs else None
                out.append(
                    ChatCompletionStreamChoice(
                        index=index, delta=DeltaMessage(), logprobs=logprobs, finish_reason=finish
                    )
                )
            return out

        def delta(index: int, event: TokenDelta) -> list[ChatCompletionStreamChoice]:
            state = streams.setdefault(index, _ToolStream(request, mode))
            state.logprobs.extend(event.logprobs)
            return choices(index, state.kept(state.parser.feed(event.text)), None)

        def finish(index: int, reason: str) -> list[ChatCompletionStreamChoice]:
            state = streams.setdefault(index, _ToolStream(request, mode))
            events = state.kept(state.parser.finish())
            return choices(index, events, "tool_calls" if state.called and reason == "stop" else reason)

        return delta, finish

    def message(self, request: ChatCompletionRequest, mode: str, state: ChoiceState) -> tuple[ResponseMessage, str]:
        """A finished choice's message and finish_reason (its tool calls parsed out, with tools)."""
        reason = state.final.finish_reason
        if mode == "none":
            return ResponseMessage(content=state.text), reason
        stream = _ToolStream(request, mode)
        parsed = collect(stream.kept(stream.parser.feed(state.text) + stream.parser.finish()))
        if not parsed.calls:
            return ResponseMessage(content=parsed.content if parsed.content is not None else state.text), reason
        calls = [ToolCall(id=i, function=FunctionCall(name=n, arguments=a)) for i, n, a in parsed.calls]
        return ResponseMessage(content=parsed.content, tool_calls=calls), "tool_calls" if reason == "stop" else reason

    async def create_chat_completion(
        self, request: ChatCompletionRequest, key_id: str = ""
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """A full response, or (stream=True) an iterator of SSE lines whose first event has
        already arrived: errors before any output raise `OpenAIError` here, not inside the stream."""
        arrival = time.perf_counter()
        self.check_common(request)
        request.check_tools()
        if request.top_logprobs and not request.logprobs:
            raise invalid_request(
                "Invalid value for 'top_logprobs': top_logprobs requires logprobs to be set to true.",
                "top_logprobs",
                "invalid_value",
            )
        mode = request.tool_mode()
        constraint, constraint_param = constraint_of(request)
        messages = render_messages(request.messages, request.tools if mode != "none" else None)
        limit = self.models.max_model_len
        # A prompt to be truncated may be longer than the context: only the body size bounds it then.
        size_limit = limit if request.truncate_prompt_tokens is None else None
        prompt = await self.tokenizer.aencode_chat(messages, size_limit, self.tokenize_timeout_s,
                                                   template_options(request))
        prompt = self.truncated(prompt, request)
        requested = request.max_completion_tokens or request.max_tokens
        param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        max_tokens = self.check_length(len(prompt), requested, "messages", param, limit)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        if mode == "none":
            delta_choice = lambda i, event: self.delta_choice(request, i, event)  # noqa: E731
            finish_choice = lambda i, reason: ChatCompletionStreamChoice(  # noqa: E731
                index=i, delta=DeltaMessage(), finish_reason=reason
            )
        else:
            delta_choice, finish_choice = self.tool_stream(request, mode)

        prompt_entries: list = []  # the worker's prompt logprob entries (every choice has the same)

        def choice(i: int, s: ChoiceState) -> ChatCompletionChoice:
            if i == 0:
                prompt_entries.append(s.prompt_logprobs)
            message, reason = self.message(request, mode, s)
            return ChatCompletionChoice(
                index=i, message=message, logprobs=self.choice_logprobs(request, s.logprobs), finish_reason=reason
            )

        result = await self.respond(
            request,
            ChatCompletionResponse,
            response_id,
            self.fan_out(response_id, request, [prompt], [max_tokens], constraint, key_id),
            len(prompt),
            arrival,
            choice=choice,
            delta_choice=delta_choice,
            finish_choice=finish_choice,
            role_choice=lambda i: ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")),
            chunk_cls=ChatCompletionStreamResponse,
            constraint_param=constraint_param,
        )
        if request.prompt_logprobs is not None:  # (never streamed: check_common refuses that)
            result.prompt_logprobs = self.prompt_logprobs(prompt_entries[0] or ())
        return result

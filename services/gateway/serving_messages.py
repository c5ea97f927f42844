"""/v1/messages: Anthropic's Messages API over the chat machinery.

A request becomes a chat request (`to_chat`): `system` a system message first, then the turns (a user
turn's `tool_result` blocks as tool messages, answering the calls by id, its text as a user message;
an assistant turn's text and `tool_use` blocks as an assistant message with tool calls), `tools` and
`tool_choice` (auto, any = required, tool = one named function, none) as chat's function tools,
`output_config.format` as a JSON-schema constraint, `stop_sequences` as stop strings. A last turn
that is the assistant's is a prefill: the model continues it (chat's continue_final_message) and the
answer holds what it added. One choice runs through `OpenAIServingChat.run`, so prompts, constraints,
tool-call parsing and speculation are exactly chat's.

The answer's content is a list of blocks in the order the model wrote them: `text` blocks and
`tool_use` blocks (`input` the call's arguments as an object). `stop_reason`: `end_turn`,
`stop_sequence` (with the matched `stop_sequence`), `max_tokens`, or `tool_use`. Streamed, the same
blocks come as Anthropic's events: `message_start`, `ping`, per block `content_block_start`,
`content_block_delta`s (`text_delta`, or `input_json_delta` with the arguments' JSON text as it comes)
and `content_block_stop`, then `message_delta` (stop reason, output tokens, and TIDE's
`speculation`) and `message_stop`. A failure after the stream started is an `error` event.
Errors are in Anthropic's shape (`anthropic_error_body`), by HTTP status.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator

from pydantic import ValidationError

from services.gateway.errors import OpenAIError, from_validation_error, internal_error
from services.gateway.governance import Decide, Eligibility, undecided
from services.gateway.protocol import ChatCompletionRequest, SpeculationInfo
from services.gateway.protocol_messages import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    MessagesUsage,
    OutputTextBlock,
    OutputToolUseBlock,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from services.gateway.serving_chat import OpenAIServingChat, ParamNames, RunEvent, RunFinish, template_options
from services.gateway.serving_engine import sse_event
from services.gateway.tool_calls import CallArguments, CallStart, Content, render_messages

NAMES = ParamNames(prompt="messages", max_tokens="max_tokens",
                   constraint={"response_format": "output_config.format", "tools": "tool_choice"})
_WS = " \t\r\n"
# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def anthropic_error_body(err: OpenAIError) -> dict:
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def chat_messages(request: CountTokensRequest | MessagesRequest) -> list[dict]:
    out: list[dict] = []
    if request.system is not None:
        out.append({"role": "system", "content": request.system_text()})
    for message in request.messages:
        blocks = message.blocks()
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if message.role == "user":
            results = [b for b in blocks if isinstance(b, ToolResultBlock)]
            out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()} for b in results]
            if text or not results:
                out.append({"role": "user", "content": text})
            continue
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                 for b in blocks if isinstance(b, ToolUseBlock)]
        assistant: dict = {"role": "assistant", "content": text or None}
        if calls:
            assistant["tool_calls"] = calls
        out.append(assistant)
    return out


def _prefill(messages: list[dict]) -> bool:
    """Whether the last turn is an assistant's text for the model to continue."""
    last = messages[-1]
    return last["role"] == "assistant" and bool(last["content"]) and "tool_calls" not in last


def to_chat(request: CountTokensRequest | MessagesRequest) -> ChatCompletionRequest:
    messages = chat_messages(request)
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                "parameters": t.input_schema}} for t in request.tools or ()]
    choice = request.tool_choice
    tool_choice = None if choice is None else {
        "auto": "auto", "any": "required", "none": "none",
        "tool": {"type": "function", "function": {"name": choice.name or ""}},
    }[choice.type]
    body: dict = {
        "model": request.model,
        "messages": messages,
        "tools": tools or None,
        "tool_choice": tool_choice,
        "parallel_tool_calls": False if choice is not None and choice.disable_parallel_tool_use else None,
        "continue_final_message": _prefill(messages),
    }
    if isinstance(request, MessagesRequest):
        fmt = request.output_config.format if request.output_config else None
        body.update(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            response_format=None if fmt is None else
            {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}},
            **request.model_dump(include={"speculative", "workload", "top_k", "ignore_eos", "stop_token_ids"}),
        )
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as err:
        raise from_validation_error(err) from None
    if isinstance(request, MessagesRequest):
        chat.stop = list(request.stop_sequences or ())  # (more than chat's 4 may be given here)
    return chat


class ContentBuilder:
    """A message's content blocks, built from a run's events; `feed` and `finish` also give the stream
    events each step makes, so a streamed message and a whole one have the same blocks."""

    def __init__(self) -> None:
        self.blocks: list[OutputTextBlock | OutputToolUseBlock] = []
        self.arguments: list[str] = []  # per block: a tool_use's arguments text ("" for text)
        self.open = False
        self.held = ""  # whitespace not yet given out: dropped if a call follows it (as chat drops it)

    def feed(self, event) -> list[dict]:
        if isinstance(event, Content):
            text = self.held + event.text
            is_text = self.open and isinstance(self.blocks[-1], OutputTextBlock)
            if not text.strip(_WS) and not is_text:
                self.held = text
                return []
            self.held = ""
            out = [] if is_text else self._start(OutputTextBlock(text=""))
            self.blocks[-1].text += text
            return out + [self._delta({"type": "text_delta", "text": text})]
        if isinstance(event, CallStart):
            self.held = ""
            block_id = "toolu_" + event.id.removeprefix("call_")
            return self._start(OutputToolUseBlock(id=block_id, name=event.name, input={}))
        if isinstance(event, CallArguments) and self.open and isinstance(self.blocks[-1], OutputToolUseBlock):
            self.arguments[-1] += event.text
            return [self._delta({"type": "input_json_delta", "partial_json": event.text})]
        return []

    def finish(self) -> list[dict]:
        out = []
        if self.held and not self.blocks:  # an answer of whitespace only is still the answer
            out = self._start(OutputTextBlock(text=self.held))
            out.append(self._delta({"type": "text_delta", "text": self.held}))
        return out + self._stop()

    def _start(self, block) -> list[dict]:
        out = self._stop()
        self.blocks.append(block)
        self.arguments.append("")
        self.open = True
        shown = block.model_dump()
        if isinstance(block, OutputTextBlock):
            shown["text"] = ""
        return out + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": shown}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _stop(self) -> list[dict]:
        if not self.open:
            return []
        self.open = False
        block = self.blocks[-1]
        if isinstance(block, OutputToolUseBlock):
            try:
                value = json.loads(self.arguments[-1] or "{}")
            except ValueError:  # cut by max_tokens: what parsed is not an object
                value = {}
            block.input = value if isinstance(value, dict) else {}
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def stop_reason(finish: RunFinish) -> str:
    if finish.finish_reason == "length":
        return "max_tokens"
    if finish.finish_reason == "tool_calls":
        return "tool_use"
    return "stop_sequence" if finish.stop_string else "end_turn"


def usage_of(finish: RunFinish) -> MessagesUsage:
    usage = finish.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return MessagesUsage(input_tokens=usage.prompt_tokens - cached, output_tokens=usage.completion_tokens,
                         cache_read_input_tokens=cached)


class AnthropicServingMessages:
    endpoint = "/v1/messages"

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat  # a chat server whose metrics count under this endpoint

    def _checked(self, request: CountTokensRequest | MessagesRequest) -> ChatCompletionRequest:
        err = request.unsupported()
        if err is not None:
            raise err
        self.chat.models.check(request.model)
        return to_chat(request)

    async def count_tokens(self, request: CountTokensRequest) -> CountTokensResponse:
        chat = self._checked(request)
        chat.check_tools()
        messages = render_messages(chat.messages, chat.tools if chat.tool_mode() != "none" else None)
        ids = await self.chat.tokenizer.aencode_chat(messages, None, self.chat.tokenize_timeout_s,
                                                     template_options(chat))
        return CountTokensResponse(input_tokens=len(ids))

    async def create(
        self, request: MessagesRequest, decide: Decide = undecided
    ) -> tuple[MessageResponse | AsyncIterator[str], Eligibility]:
        """The message (or its event stream) and the training decision it was served under (`decide`d
        on the chat request it runs as)."""
        chat = self._checked(request)
        caller = decide(chat)
        prompt_tokens, events = await self.chat.run(chat, NAMES, caller)
        message_id = f"msg_{uuid.uuid4().hex}"
        if request.stream:
            return self._stream(message_id, prompt_tokens, events), caller
        builder = ContentBuilder()
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, RunFinish):
                    builder.finish()
                    return MessageResponse(
                        id=message_id, model=self.chat.models.name, content=builder.blocks,
                        stop_reason=stop_reason(event), stop_sequence=event.stop_string or None,
                        usage=usage_of(event), speculation=SpeculationInfo(event.speculation),
                    ), caller
                builder.feed(event)
        raise internal_error("The generation ended without its last event.")

    async def _stream(self, message_id: str, prompt_tokens: int, events: AsyncIterator[RunEvent]) -> AsyncIterator[str]:
        builder = ContentBuilder()
        start = MessageResponse(id=message_id, model=self.chat.models.name, content=[], stop_reason=None,
                                usage=MessagesUsage(input_tokens=prompt_tokens, output_tokens=0))
        async with contextlib.aclosing(events):
            try:
                yield sse_event({"type": "message_start", "message": start.model_dump()})
                yield sse_event({"type": "ping"})
                async for item in events:
                    if not isinstance(item, RunFinish):
                        for payload in builder.feed(item):
                            yield sse_event(payload)
                        continue
                    for payload in builder.finish():
                        yield sse_event(payload)
                    usage = usage_of(item)
                    yield sse_event({
                        "type": "message_delta",
                        "delta": {"stop_reason": stop_reason(item), "stop_sequence": item.stop_string or None},
                        "usage": usage.model_dump(),
                        "speculation": SpeculationInfo(item.speculation).model_dump(),
                    })
                    yield sse_event({"type": "message_stop"})
            except Exception as err:  # after the stream started: Anthropic's error event ends it
                oe = err if isinstance(err, OpenAIError) else internal_error()
                self.chat.metrics.error(self.endpoint, oe)
                yield sse_event(anthropic_error_body(oe))

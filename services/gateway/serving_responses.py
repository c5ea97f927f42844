"""/v1/responses: OpenAI's Responses API over the chat machinery.

A request becomes a chat request (`to_chat`): `instructions` a system message first, the stored
conversation of `previous_response_id` next (its earlier turns' inputs and outputs), then the input
items (messages; `function_call`s as an assistant's tool calls; `function_call_output`s as tool
messages), `tools` and `tool_choice` as chat's function tools, `text.format` as `response_format`,
`max_output_tokens` as max_tokens. Its one choice runs through `OpenAIServingChat.run`, so prompts,
constraints, tool-call parsing and speculation are exactly chat's (greedy text equals chat's).

The output is a list of items, in the order the model wrote them: a `message` item (one `output_text`
part) for each stretch of text, a `function_call` item for each call (`call_id` is what a
`function_call_output` answers). A choice cut by `max_output_tokens` is `status: "incomplete"` with
`incomplete_details.reason: "max_output_tokens"`. Streamed (`stream: true`), the same items come as
OpenAI's events, each with a `sequence_number`: `response.created`, `response.in_progress`, per item
`response.output_item.added`, for text `response.content_part.added`, `response.output_text.delta`...,
`response.output_text.done`, `response.content_part.done`, for calls
`response.function_call_arguments.delta`..., `response.function_call_arguments.done`, then
`response.output_item.done`, and last `response.completed` (or `response.incomplete`) with the whole
response. A failure after the stream started is an `error` event followed by `response.failed`.
The finished response carries TIDE's `speculation` object, as chat's does.

With `store` (true by default) the response and its conversation are kept (response_store: bounded
and expiring), for `previous_response_id`, GET /v1/responses/{id} (and its input_items) and DELETE;
`store: false` keeps
nothing and is passed on to the chat request (so it is not collected for training either where the
stack honours that).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from services.gateway.errors import OpenAIError, from_validation_error, internal_error, invalid_request
from services.gateway.governance import Decide, Eligibility, undecided
from services.gateway.protocol import ChatCompletionRequest, SpeculationInfo
from services.gateway.protocol_responses import (
    DeletedResponse,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    IncompleteDetails,
    InputMessage,
    InputTokensDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from services.gateway.response_store import ResponseStore
from services.gateway.serving_chat import OpenAIServingChat, ParamNames, RunEvent, RunFinish
from services.gateway.serving_engine import sse_event
from services.gateway.tool_calls import CallArguments, CallStart, Content

NAMES = ParamNames(prompt="input", max_tokens="max_output_tokens",
                   constraint={"response_format": "text.format", "tools": "tool_choice"})
_WS = " \t\r\n"


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    shown = response_id if len(response_id) <= 64 else f"{response_id[:64]}..."
    if param == "previous_response_id":
        return OpenAIError(400, f"Previous response with id '{shown}' not found.", param=param,
                           code="previous_response_not_found")
    return OpenAIError(404, f"No response found with id '{shown}'.", type="invalid_request_error",
                       code="response_not_found")


def input_messages(request: ResponsesRequest) -> list[dict]:
    """The request's input items as chat messages (reasoning items dropped)."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    out: list[dict] = []
    for item in request.input:
        if isinstance(item, InputMessage):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":  # the same turn's text, or its other calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def listed_items(request: ResponsesRequest) -> list[dict]:
    """The request's input items as GET /v1/responses/{id}/input_items lists them (each with an id)."""
    items = [{"role": "user", "content": request.input}] if isinstance(request.input, str) else \
        [i.model_dump() for i in request.input]
    out = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item["content"]
            parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else content
            item = {"type": "message", "role": item["role"], "content": parts, "status": "completed"}
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(kind, "item")
        out.append({"id": f"{prefix}_{uuid.uuid4().hex}", **item})
    return out


def _tool_choice(request: ResponsesRequest) -> Any:
    choice = request.tool_choice
    if isinstance(choice, FunctionToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(request: ResponsesRequest) -> dict | None:
    fmt = request.text.format if request.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict,
              "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def to_chat(request: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat request that serves `request`, with `messages` (instructions, history, input)."""
    tools = [
        {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
        for t in request.tools or ()
    ]
    body = {
        "model": request.model,
        "messages": messages,
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tools": tools or None,
        "tool_choice": _tool_choice(request),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": _response_format(request),
        "store": None if request.store else False,
        **request.model_dump(include={"speculative", "workload", "top_k", "ignore_eos", "stop_token_ids"}),
    }
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as err:
        bad = from_validation_error(err)
        raise invalid_request(bad.message.replace("'messages", "'input"), "input", bad.code) from None


class OutputBuilder:
    """A response's output items, built from a run's events; `feed` and `finish` also give the stream
    events each step makes (without sequence numbers), so a streamed response and a whole one are
    the same items."""

    def __init__(self) -> None:
        self.items: list[OutputMessage | OutputFunctionCall] = []
        self.open: OutputMessage | OutputFunctionCall | None = None
        self.held = ""  # whitespace not yet given out: dropped if a call follows it (as chat drops it)

    def feed(self, event) -> list[dict]:
        if isinstance(event, Content):
            text = self.held + event.text
            if not text.strip(_WS) and not isinstance(self.open, OutputMessage):
                self.held = text
                return []
            self.held = ""
            out = [] if isinstance(self.open, OutputMessage) else self._open_message()
            return out + self._text(text)
        if isinstance(event, CallStart):
            self.held = ""
            out = self._close("completed")
            self.open = OutputFunctionCall(id=f"fc_{uuid.uuid4().hex}", call_id=event.id, name=event.name,
                                           arguments="", status="in_progress")
            self.items.append(self.open)
            return out + [self._added()]
        if isinstance(event, CallArguments) and isinstance(self.open, OutputFunctionCall):
            self.open.arguments += event.text
            return [{"type": "response.function_call_arguments.delta", "item_id": self.open.id,
                     "output_index": len(self.items) - 1, "delta": event.text}]
        return []

    def finish(self, status: str) -> list[dict]:
        """Close the last item (`status`: "completed", or "incomplete" when cut by max_output_tokens)."""
        out = []
        if self.held and not self.items:  # an output of whitespace only is still the output
            out = self._open_message() + self._text(self.held)
        return out + self._close(status)

    def _open_message(self) -> list[dict]:
        out = self._close("completed")
        self.open = OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress", content=[OutputText(text="")])
        self.items.append(self.open)
        part = {"type": "response.content_part.added", "item_id": self.open.id, "output_index": len(self.items) - 1,
                "content_index": 0, "part": OutputText(text="").model_dump()}
        return out + [self._added(empty=True), part]

    def _text(self, text: str) -> list[dict]:
        self.open.content[0].text += text
        return [{"type": "response.output_text.delta", "item_id": self.open.id, "output_index": len(self.items) - 1,
                 "content_index": 0, "delta": text, "logprobs": []}]

    def _added(self, empty: bool = False) -> dict:
        item = self.open.model_dump()
        if empty:
            item["content"] = []
        return {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": item}

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        index = len(self.items) - 1
        if isinstance(item, OutputMessage):
            part = item.content[0].model_dump()
            out = [
                {"type": "response.output_text.done", "item_id": item.id, "output_index": index, "content_index": 0,
                 "text": part["text"], "logprobs": []},
                {"type": "response.content_part.done", "item_id": item.id, "output_index": index, "content_index": 0,
                 "part": part},
            ]
        else:
            out = [{"type": "response.function_call_arguments.done", "item_id": item.id, "output_index": index,
                    "name": item.name, "arguments": item.arguments}]
        return out + [{"type": "response.output_item.done", "output_index": index, "item": item.model_dump()}]

    def assistant_message(self) -> dict:
        """The output as one chat assistant message (what the next turn's conversation holds)."""
        text = "".join(i.content[0].text for i in self.items if isinstance(i, OutputMessage))
        calls = [{"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.arguments}}
                 for i in self.items if isinstance(i, OutputFunctionCall)]
        message: dict = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        return message


class OpenAIServingResponses:
    endpoint = "/v1/responses"

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat  # a chat server whose metrics count under this endpoint
        self.store = store

    def retrieve(self, response_id: str) -> dict:
        entry = self.store.get(response_id)
        if entry is None:
            raise not_found(response_id)
        return entry.response

    def input_items(self, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None) -> dict:
        """The stored response's input items (OpenAI's list page: newest first unless order=asc)."""
        entry = self.store.get(response_id)
        if entry is None:
            raise not_found(response_id)
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        if after is not None:
            ids = [i["id"] for i in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    def delete(self, response_id: str) -> DeletedResponse:
        if not self.store.delete(response_id):
            raise not_found(response_id)
        return DeletedResponse(id=response_id)

    def _skeleton(self, request: ResponsesRequest, response_id: str) -> ResponseObject:
        """The response as it stands before any output (status in_progress)."""
        fmt = request.text.format.model_dump(by_alias=True, exclude_none=True) if request.text and request.text.format \
            else {"type": "text"}
        return ResponseObject(
            id=response_id,
            created_at=int(time.time()),
            status="in_progress",
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            model=self.chat.models.name,
            parallel_tool_calls=request.parallel_tool_calls is not False,
            previous_response_id=request.previous_response_id,
            reasoning={"effort": None, "summary": None, **(request.reasoning or {})},
            store=request.store,
            temperature=1.0 if request.temperature is None else request.temperature,
            text={"format": fmt},
            tool_choice=request.tool_choice.model_dump() if isinstance(request.tool_choice, FunctionToolChoice)
            else request.tool_choice or "auto",
            tools=[t.model_dump(exclude_none=True) for t in request.tools or ()],
            top_p=1.0 if request.top_p is None else request.top_p,
            truncation=request.truncation,
            user=request.user,
            metadata=request.metadata or {},
        )

    async def _start(
        self, request: ResponsesRequest, decide: Decide
    ) -> tuple[list[dict], AsyncIterator[RunEvent], Eligibility]:
        """Checks, the conversation, the started run (its first output arrived) and whether it may be
        trained on (`decide`d on the chat request it runs as)."""
        err = request.unsupported()
        if err is not None:
            raise err
        self.chat.models.check(request.model)
        history: list[dict] = []
        if request.previous_response_id is not None:
            entry = self.store.get(request.previous_response_id)
            if entry is None:
                raise not_found(request.previous_response_id, "previous_response_id")
            history = list(entry.conversation)
        conversation = history + input_messages(request)
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        while True:
            chat = to_chat(request, system + conversation)
            caller = decide(chat)
            try:
                _, events = await self.chat.run(chat, NAMES, caller)
                return conversation, events, caller
            except OpenAIError as err:
                # truncation "auto": drop the oldest turns until the prompt fits (the last message stays)
                if request.truncation != "auto" or err.code != "context_length_exceeded" or err.param != "input" \
                        or len(conversation) <= 1:
                    raise
                conversation = conversation[1:]
                while len(conversation) > 1 and conversation[0]["role"] == "tool":  # no result without its call
                    conversation = conversation[1:]

    async def create(
        self, request: ResponsesRequest, decide: Decide = undecided
    ) -> tuple[ResponseObject | AsyncIterator[str], Eligibility]:
        """The response (or its event stream) and the training decision it was served under."""
        response_id = f"resp_{uuid.uuid4().hex}"
        conversation, events, caller = await self._start(request, decide)
        response = self._skeleton(request, response_id)
        if request.stream:
            return self._stream(request, response, conversation, events), caller
        builder = OutputBuilder()
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, RunFinish):
                    self._finish(request, response, builder, event, conversation)
                else:
                    builder.feed(event)
        return response, caller

    def _finish(self, request: ResponsesRequest, response: ResponseObject, builder: OutputBuilder,
                finish: RunFinish, conversation: list[dict]) -> list[dict]:
        """Complete `response` from the run's end (and store it); the stream events closing the output."""
        cut = finish.finish_reason == "length"
        closing = builder.finish("incomplete" if cut else "completed")
        response.output = builder.items
        response.status = "incomplete" if cut else "completed"
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens") if cut else None
        usage = finish.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        response.usage = ResponseUsage(
            input_tokens=usage.prompt_tokens, input_tokens_details=InputTokensDetails(cached_tokens=cached),
            output_tokens=usage.completion_tokens, output_tokens_details=OutputTokensDetails(),
            total_tokens=usage.total_tokens,
        )
        response.speculation = SpeculationInfo(finish.speculation)
        if request.store:
            self.store.put(response.id, response.model_dump(), [*conversation, builder.assistant_message()],
                           listed_items(request))
        return closing

    async def _stream(self, request: ResponsesRequest, response: ResponseObject, conversation: list[dict],
                      events: AsyncIterator[RunEvent]) -> AsyncIterator[str]:
        sequence = 0

        def event(payload: dict) -> str:
            nonlocal sequence
            payload["sequence_number"] = sequence
            sequence += 1
            return sse_event(payload)

        builder = OutputBuilder()
        async with contextlib.aclosing(events):
            try:
                yield event({"type": "response.created", "response": response.model_dump()})
                yield event({"type": "response.in_progress", "response": response.model_dump()})
                async for item in events:
                    if isinstance(item, RunFinish):
                        for payload in self._finish(request, response, builder, item, conversation):
                            yield event(payload)
                        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
                        yield event({"type": kind, "response": response.model_dump()})
                    else:
                        for payload in builder.feed(item):
                            yield event(payload)
            except Exception as err:  # after the stream started: an error event, then the failed response
                oe = err if isinstance(err, OpenAIError) else internal_error()
                self.chat.metrics.error(self.endpoint, oe)
                code = oe.code or oe.type
                yield event({"type": "error", "code": code, "message": oe.message, "param": oe.param})
                response.status = "failed"
                response.output = builder.items
                response.error = ResponseError(code=code, message=oe.message)
                yield event({"type": "response.failed", "response": response.model_dump()})

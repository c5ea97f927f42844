"""Request and response models of OpenAI's Responses API (`POST /v1/responses`), as far as a server
without hosted tools can serve it.

The request is strict like the completion endpoints' (protocol.StrictRequest): unknown parameters are a
400 naming them, parameters for what a local server does not have (hosted tools' `background`, stored
`conversation`s and `prompt` templates, `top_logprobs`, image inputs) are a 400 unless set to their
no-op value, hints are accepted and ignored (`user`, `service_tier`, `prompt_cache_key`,
`safety_identifier`, `max_tool_calls`: a limit on *hosted* tool calls), and `reasoning` is accepted and
echoed (a no-op: the served models do not reason separately). TIDE's extensions (`speculative`,
`workload`, `top_k`, `ignore_eos`, `stop_token_ids`) are taken as on chat.

Input is a string (one user message) or a list of items: messages (`type` may be left out) with text
content (`input_text`, `output_text`, `refusal` parts), `function_call`s the model made earlier,
`function_call_output`s answering them, and `reasoning` items (dropped: nothing to feed back).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from services.gateway.protocol import (
    MAX_TOOLS,
    NAME_PATTERN,
    U32_MAX,
    SpeculationInfo,
    StrictRequest,
    TideExtensions,
    Unsupported,
)

_NONE: dict[str, Any] = {"type": "null"}
TEXT_PARTS = ("input_text", "output_text", "text")  # content parts whose `text` is taken


def _none(v: Any) -> bool:
    return v is None


def _no_logprobs(include: Any) -> bool:
    return "message.output_text.logprobs" not in (include or ())


# ------------------------------------------------------------------------------------ input items


class ContentPart(BaseModel):
    """A content part of an input message: text (`input_text`, `output_text`, `text`) or a refusal."""

    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None
    refusal: str | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, value):
        if value not in (*TEXT_PARTS, "refusal"):
            raise ValueError(f"content part type {value[:64]!r} is not supported (text parts only)")
        return value

    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.value() for p in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made in an earlier turn (an output item sent back as input)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    """The result of a call, for the model's next turn."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.value() for p in self.output)


class ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]


_ITEMS = {"message": InputMessage, "function_call": FunctionCallItem,
          "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


def _item_tag(value: Any) -> str | None:
    """A message item may leave out its `type` (OpenAI's EasyInputMessage); errors._loc drops the tags."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return f"tagged-union-{kind}" if isinstance(kind, str) and kind in _ITEMS else None


InputItem = Annotated[
    Union[tuple(Annotated[m, Tag(f"tagged-union-{k}")] for k, m in _ITEMS.items())],  # noqa: UP007 - a union built from a tuple
    Discriminator(_item_tag, custom_error_type="invalid_value",
                  custom_error_message="type must be one of " + ", ".join(repr(k) for k in _ITEMS)),
]


# ------------------------------------------------------------------------------------ tools and formats


class FunctionTool(BaseModel):
    """A function the model may call (Responses' flat form: no `function` wrapper)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = Field(description="function tools only (hosted tools are not served)")
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON following `schema`."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint


# ------------------------------------------------------------------------------------ the request


class ResponsesRequest(StrictRequest, TideExtensions):
    model: str
    input: Annotated[str, Field(min_length=1)] | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=U32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: Any = None  # `include_obfuscation`: a hint
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    # hints that do not change the output
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    max_tool_calls: int | None = Field(None, ge=1, description="limits hosted tools' calls: there are none")

    # fmt: off
    unsupported_params: ClassVar[dict[str, Unsupported]] = {
        "background": (lambda v: not v, "background responses are not supported", {"const": False}),
        "conversation": (_none, "stored conversations are not supported; use previous_response_id", _NONE),
        "prompt": (_none, "prompt templates are not supported", _NONE),
        "context_management": (_none, "context management is not supported", _NONE),
        "top_logprobs": (lambda v: not v, "log probabilities are served by /v1/chat/completions", {"const": 0}),
        "include": (_no_logprobs, "log probabilities are served by /v1/chat/completions",
                    {"type": "array", "items": {"type": "string", "not": {"const": "message.output_text.logprobs"}}}),
    }
    # fmt: on


# ------------------------------------------------------------------------------------ the response


def _absent(value: Any) -> bool:
    return value is None


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A response (what `responses.create` returns, `response.*` stream events carry, GET retrieves)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float = 1.0
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    speculation: SpeculationInfo | None = Field(None, exclude_if=_absent)  # TIDE's, once finished


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True

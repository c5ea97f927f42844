"""Request and response models of Anthropic's Messages API (`POST /v1/messages`,
`POST /v1/messages/count_tokens`), as served by a local model.

Strict as the other endpoints (protocol.StrictRequest): unknown parameters are a 400 naming them; what a
local server does not have (`container`, `mcp_servers`, image and document blocks, server tools) is
a 400 unless absent; hints are accepted and ignored (`metadata`, `service_tier`, `inference_geo`,
`speed`, `cache_control` here and on blocks, `output_config.effort`); `thinking` is accepted and a
no-op (the served models write no separate thinking). `temperature` (0..1), `top_p` and `top_k`, which
Anthropic's newest models no longer take, are taken as older clients send them. TIDE's extensions
(`speculative`, `workload`, `ignore_eos`, `stop_token_ids`) are taken as on chat.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

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
MAX_STOP_SEQUENCES = 16  # a bound of ours (Anthropic states none): each is matched on every commit


def _none(v: Any) -> bool:
    return v is None


# ------------------------------------------------------------------------------------ content blocks


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    """A call the model made (an assistant turn's block)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    """The result of call `tool_use_id` (a user turn's block)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or ())
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(BaseModel):
    """An earlier turn's thinking, sent back by clients: dropped (nothing of it reaches the prompt)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["thinking", "redacted_thinking"]


_BLOCKS = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
           "thinking": ThinkingBlock, "redacted_thinking": ThinkingBlock}


def _block_tag(value: Any) -> str | None:
    """The tag of a block's model (errors._loc drops such tags from error locations)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"tagged-union-{kind}" if isinstance(kind, str) and kind in _BLOCKS else None


Block = Annotated[
    Union[tuple(Annotated[m, Tag(f"tagged-union-{k}")] for k, m in _BLOCKS.items())],  # noqa: UP007 - a union built from a tuple
    Discriminator(_block_tag, custom_error_type="invalid_value",
                  custom_error_message="content block type must be one of 'text', 'tool_use', 'tool_result', "
                                       "'thinking' (text only: no images or documents)"),
]


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


# ------------------------------------------------------------------------------------ tools


class Tool(BaseModel):
    """A client tool (server tools such as web search are not served)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["custom"] | None = None
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class JsonOutputFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    effort: str | None = None  # a hint
    format: JsonOutputFormat | None = None


# ------------------------------------------------------------------------------------ requests


class _Conversation(StrictRequest):
    """What a prompt is made of (both endpoints)."""

    model: str
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None  # a no-op
    mcp_servers: Any = None

    unsupported_params: ClassVar[dict[str, Unsupported]] = {
        "mcp_servers": (_none, "MCP servers are not supported", _NONE),
    }

    def system_text(self) -> str:
        if self.system is None:
            return ""
        return self.system if isinstance(self.system, str) else "\n\n".join(b.text for b in self.system)


class MessagesRequest(_Conversation, TideExtensions):
    max_tokens: int = Field(ge=1, le=U32_MAX)
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None
    container: Any = None
    # hints that do not change the output
    service_tier: Any = None
    inference_geo: Any = None
    speed: Any = None
    cache_control: Any = None

    unsupported_params: ClassVar[dict[str, Unsupported]] = {
        **_Conversation.unsupported_params,
        "container": (_none, "code execution containers are not supported", _NONE),
    }


class CountTokensRequest(_Conversation):
    """`POST /v1/messages/count_tokens`: the prompt's size, without generating."""


# ------------------------------------------------------------------------------------ responses


def _absent(value: Any) -> bool:
    return value is None


class OutputTextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class OutputToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessagesUsage(BaseModel):
    """Anthropic's counts: `input_tokens` are the prompt tokens not read from the cache (the prefix
    cache's hits are `cache_read_input_tokens`; TIDE writes no explicit cache entries)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutputTextBlock | OutputToolUseBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: MessagesUsage
    speculation: SpeculationInfo | None = Field(None, exclude_if=_absent)  # TIDE's


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error's body on /v1/messages (serving_messages.anthropic_error_body)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail

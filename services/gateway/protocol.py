"""Request and response models of the OpenAI-compatible API (fields in the order of OpenAI's docs).

Unknown fields are handled deliberately, in three groups:
- supported: validated here (types and ranges) and by the serving layer (limits that depend on
  the model, such as the context length and the largest `n`);
- known but unsupported *and semantics-changing* (`logprobs`, `tools`, `response_format` other
  than text, `logit_bias`, penalties, ...): declared, and refused with a 400 naming the parameter
  by `unsupported()` unless the value is a no-op (`logprobs: false`, `tools: []`, ...);
- harmless (`user`, `metadata`, `store`, `service_tier`, `prediction`, ...) and unknown fields:
  accepted and ignored (unknown ones are logged).
TIDE extensions (sent with the client's `extra_body`): `speculative` (false = plain decode),
`workload` (a tag carried into telemetry), `top_k`, `ignore_eos`, `stop_token_ids`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, field_validator, model_serializer, model_validator

from services.gateway.errors import OpenAIError, unsupported_parameter
from tide.speculation import SpeculationStats

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
TIDE_EXTENSIONS = ("speculative", "workload", "top_k", "ignore_eos", "stop_token_ids")
# vLLM extensions a client may send that we do not implement and that change the output.
# fmt: off
_FOREIGN_SEMANTIC = ("min_tokens", "repetition_penalty", "min_p", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "structured_outputs", "use_beam_search", "prompt_logprobs", "length_penalty",
                     "bad_words", "allowed_token_ids")
# fmt: on


class _Request(BaseModel):
    """Common request behaviour: unknown fields kept aside (and ignored), semantic ones refused."""

    model_config = ConfigDict(extra="allow")
    # field -> (is the value harmless?, why it is refused otherwise)
    unsupported_params: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        """OpenAI treats `"param": null` as "not given"; so do we (defaults apply, required ones are missing)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def unsupported(self) -> OpenAIError | None:
        """The first set parameter we cannot honour without changing the result, as a 400."""
        for name, (harmless, why) in self.unsupported_params.items():
            if name in self.model_fields_set and not harmless(getattr(self, name)):
                return unsupported_parameter(name, why)
        for name in _FOREIGN_SEMANTIC:
            if self.model_extra and self.model_extra.get(name) not in (None, [], {}, False):
                return unsupported_parameter(name, "not implemented by this server")
        return None

    def ignored_fields(self) -> list[str]:
        """Unknown fields the request carried (ignored)."""
        return sorted(self.model_extra or ())


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False


def _no(v: Any) -> bool:
    return not v


_COMMON_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "frequency_penalty": (_no, "only 0 is supported"),
    "logit_bias": (_no, "logit biases are not supported"),
    "presence_penalty": (_no, "only 0 is supported"),
}


class ChatMessage(BaseModel):
    """One input message. Text content only; tool and function messages are refused."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: Any = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value):
        if isinstance(value, list):
            for part in value:
                kind = part.get("type")
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"content part type {kind!r} is not supported (text parts only)")
        return value

    @model_validator(mode="after")
    def _plain_message(self):
        if self.tool_calls:
            raise ValueError("tool calls are not supported")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    model: str
    audio: Any = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    function_call: Any = None
    functions: Any = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    metadata: Any = None
    modalities: list[str] | None = None
    n: int = Field(default=1, ge=1)
    parallel_tool_calls: Any = None
    prediction: Any = None  # a latency hint only: ignoring it does not change the output
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    reasoning_effort: Any = None
    response_format: dict[str, Any] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    service_tier: Any = None
    stop: str | list[str] | None = None
    store: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    tool_choice: Any = None
    tools: list[Any] | None = None
    top_logprobs: int | None = None
    top_p: float | None = Field(default=None, ge=0, le=1)
    user: str | None = None
    web_search_options: Any = None
    # TIDE extensions
    speculative: bool | None = None
    workload: str = ""
    top_k: int = Field(default=0, ge=-1)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)

    unsupported_params: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        **_COMMON_UNSUPPORTED,
        "audio": (lambda v: v is None, "audio output is not supported"),
        "function_call": (lambda v: v in (None, "none"), "function calling is not supported"),
        "functions": (_no, "function calling is not supported"),
        "logprobs": (_no, "log probabilities are not supported"),
        "modalities": (lambda v: v is None or list(v) == ["text"], "only the text modality is supported"),
        "response_format": (lambda v: v is None or v.get("type") == "text", "only {'type': 'text'} is supported"),
        "tool_choice": (lambda v: v in (None, "none", "auto"), "tool calling is not supported"),
        "tools": (_no, "tool calling is not supported"),
        "top_logprobs": (lambda v: v in (None, 0), "log probabilities are not supported"),
        "web_search_options": (lambda v: v is None, "web search is not supported"),
    }

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value):
        if not value:
            raise ValueError("messages must contain at least one message")
        return value


class CompletionRequest(_Request):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    max_tokens: int = Field(default=16, ge=1)
    n: int = Field(default=1, ge=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    user: str | None = None
    # TIDE extensions
    speculative: bool | None = None
    workload: str = ""
    top_k: int = Field(default=0, ge=-1)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)

    unsupported_params: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        **_COMMON_UNSUPPORTED,
        "best_of": (lambda v: v in (None, 1), "only best_of=1 is supported"),
        "echo": (_no, "echo is not supported"),
        "logprobs": (lambda v: v is None, "log probabilities are not supported"),
        "suffix": (_no, "suffix (insertion) is not supported"),
    }

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: strings or token id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


# ------------------------------------------------------------------------------------ responses


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SpeculationInfo(RootModel[SpeculationStats]):
    """TIDE's per-response field: what speculative decoding did (totals over all choices), the fields
    of `tide.speculation.SpeculationStats`. A response field of this type takes the stats as they are."""


class _Choice(BaseModel):
    """What every choice starts with; a choice type adds its content, then OpenAI's `logprobs`
    (always null here) and `finish_reason`."""

    index: int


class _Response(BaseModel):
    """What every completion object starts with (in OpenAI's order); a response type narrows
    `object` and `choices`, then adds its own fields and TIDE's `speculation`."""

    id: str
    object: str
    created: int
    model: str
    choices: list[_Choice]


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None


class ChatCompletionChoice(_Choice):
    message: ResponseMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    speculation: SpeculationInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _drop_unset(self) -> dict:  # OpenAI sends {"role": ..., "content": ""}, {"content": ...}, {}
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatCompletionStreamChoice(_Choice):
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionStreamChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    speculation: SpeculationInfo | None = None


class CompletionChoice(_Choice):
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    speculation: SpeculationInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tide"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

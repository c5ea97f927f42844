"""Request and response models of the OpenAI-compatible API (fields in the order of OpenAI's docs).

Unknown fields are handled deliberately, in three groups:
- supported: validated here (types and ranges) and by the serving layer (limits that depend on
  the model, such as the context length and the largest `n`);
- known but unsupported *and semantics-changing* (`tools`, `response_format` other than text,
  `logit_bias`, penalties, ...): declared, and refused with a 400 naming the parameter by
  `unsupported()` unless the value is a no-op (`tools: []`, ...);
- harmless (`user`, `metadata`, `store`, `service_tier`, `prediction`, ...) and unknown fields:
  accepted and ignored (unknown ones are logged).
TIDE extensions (sent with the client's `extra_body`): `speculative` (false = plain decode),
`workload` (a tag carried into telemetry), `top_k`, `ignore_eos`, `stop_token_ids`.

Every number that reaches the worker's protobuf request (tide.v1.SamplingParams, TokenIds) is
bounded here to what its field holds (uint32 token ids, max_tokens and top_k; the seed taken mod
2^64 for its uint64), so out-of-range values are a 400 naming the parameter, and /openapi.json
documents the bounds. `decode_json_body` turns the raw body into the dict the models validate:
UTF-8 JSON, no NaN/Infinity, at most MAX_JSON_DEPTH levels deep (checked on the raw bytes before
parsing) and no string that is not valid Unicode (a lone surrogate escape such as \\ud800).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, RootModel, field_validator, model_serializer, model_validator

from services.gateway.errors import OpenAIError, invalid_request, unsupported_parameter
from tide.speculation import SpeculationStats

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # taken mod 2^64 for SamplingParams.seed (uint64)
U32_MAX = 2**32 - 1  # SamplingParams.max_tokens, top_k, stop_token_ids and TokenIds are uint32
MAX_JSON_DEPTH = 64  # nesting levels of a request body, the body object being level 1
TokenId = Annotated[int, Field(ge=0, le=U32_MAX)]
TIDE_EXTENSIONS = ("speculative", "workload", "top_k", "ignore_eos", "stop_token_ids")
# vLLM extensions a client may send that we do not implement and that change the output.
# fmt: off
_FOREIGN_SEMANTIC = ("min_tokens", "repetition_penalty", "min_p", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "structured_outputs", "use_beam_search", "prompt_logprobs", "length_penalty",
                     "bad_words", "allowed_token_ids")
# fmt: on


# A refused parameter: (is this value harmless?, why other values are refused, JSON schema of the harmless values)
Unsupported = tuple[Callable[[Any], bool], str, dict[str, Any]]


def _request_schema(schema: dict[str, Any], cls: type) -> None:
    """JSON schema of a request as the server takes it: a refused parameter documents the only values
    it accepts (`unsupported_params`), and since `"param": null` means "not given" (see `_Request`),
    every optional parameter also admits null."""
    properties = schema.get("properties", {})
    for name, (_, why, accepted) in getattr(cls, "unsupported_params", {}).items():
        kept = {k: properties[name][k] for k in ("title", "default") if k in properties.get(name, {})}
        properties[name] = {**kept, "description": f"Not supported ({why}); only this value is accepted.", **accepted}
    required = set(schema.get("required", ()))
    for name, prop in properties.items():
        types = (prop.get("type"), *(p.get("type") for p in prop.get("anyOf", ())))
        if name in required or not prop or "null" in types:
            continue
        outer = {k: prop[k] for k in ("title", "description", "default") if k in prop}
        inner = {k: v for k, v in prop.items() if k not in outer}
        properties[name] = {**outer, "anyOf": [inner, {"type": "null"}]}


class _Request(BaseModel):
    """Common request behaviour: unknown fields kept aside (and ignored), semantic ones refused."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_request_schema)
    unsupported_params: ClassVar[dict[str, Unsupported]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        """OpenAI treats `"param": null` as "not given"; so do we (defaults apply, required ones are missing)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def unsupported(self) -> OpenAIError | None:
        """The first set parameter we cannot honour without changing the result, as a 400."""
        for name, (harmless, why, _) in self.unsupported_params.items():
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


_ZERO: dict[str, Any] = {"type": "number", "const": 0}
_NONE: dict[str, Any] = {"type": "null"}
_EMPTY_LIST: dict[str, Any] = {"type": "array", "maxItems": 0}
_COMMON_UNSUPPORTED: dict[str, Unsupported] = {
    "frequency_penalty": (_no, "only 0 is supported", _ZERO),
    "logit_bias": (_no, "logit biases are not supported", {"type": "object", "maxProperties": 0}),
    "presence_penalty": (_no, "only 0 is supported", _ZERO),
}
MAX_PROMPTS = 64  # prompts in one completion request
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}


def _message_schema(schema: dict[str, Any]) -> None:
    """A message as the server takes it: text parts only, no tool calls, content unless an assistant's."""
    properties = schema["properties"]
    properties["content"]["anyOf"][1]["items"] = _TEXT_PART
    properties["tool_calls"] = {"anyOf": [_EMPTY_LIST, _NONE], "description": "Not supported: only empty or null."}
    schema["if"] = {"properties": {"role": {"const": "assistant"}}}
    schema["else"] = {"required": ["content"], "properties": {"content": {"not": _NONE}}}


class ChatMessage(BaseModel):
    """One input message. Text content only; tool and function messages are refused."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_message_schema)
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
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    model: str
    audio: Any = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    function_call: Any = None
    functions: Any = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    logprobs: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1, le=U32_MAX)
    max_tokens: int | None = Field(default=None, ge=1, le=U32_MAX)
    metadata: Any = None
    modalities: list[str] | None = None
    n: int = Field(default=1, ge=1, le=U32_MAX)
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
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    top_p: float | None = Field(default=None, ge=0, le=1)
    user: str | None = None
    web_search_options: Any = None
    # TIDE extensions
    speculative: bool | None = None
    workload: str = ""
    top_k: int = Field(default=0, ge=-1, le=U32_MAX)  # -1 and 0: disabled
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list)

    # fmt: off
    unsupported_params: ClassVar[dict[str, Unsupported]] = {
        **_COMMON_UNSUPPORTED,
        "audio": (lambda v: v is None, "audio output is not supported", _NONE),
        "function_call": (lambda v: v in (None, "none"), "function calling is not supported", {"const": "none"}),
        "functions": (_no, "function calling is not supported", _EMPTY_LIST),
        "modalities": (lambda v: v is None or list(v) == ["text"], "only the text modality is supported",
                       {"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1}),
        "response_format": (lambda v: v is None or v.get("type") == "text", "only {'type': 'text'} is supported",
                            {"type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"]}),
        "tool_choice": (lambda v: v in (None, "none", "auto"), "tool calling is not supported",
                        {"enum": ["none", "auto"]}),
        "tools": (_no, "tool calling is not supported", _EMPTY_LIST),
        "web_search_options": (lambda v: v is None, "web search is not supported", _NONE),
    }
    # fmt: on

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value):
        if not value:
            raise ValueError("messages must contain at least one message")
        return value


class CompletionRequest(_Request):
    model: str
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    best_of: int | None = Field(default=None, ge=1, le=20)
    echo: bool | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)
    max_tokens: int = Field(default=16, ge=1, le=U32_MAX)
    n: int = Field(default=1, ge=1, le=U32_MAX)
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
    top_k: int = Field(default=0, ge=-1, le=U32_MAX)  # -1 and 0: disabled
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list)

    unsupported_params: ClassVar[dict[str, Unsupported]] = {
        **_COMMON_UNSUPPORTED,
        "best_of": (lambda v: v in (None, 1), "only best_of=1 is supported", {"type": "integer", "const": 1}),
        "suffix": (_no, "suffix (insertion) is not supported", {"type": "string", "maxLength": 0}),
    }

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: strings or token id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


# ------------------------------------------------------------------------------------ raw bodies

_STRUCTURE_ONLY = bytes(b for b in range(256) if b not in b'[]{}"')  # the bytes json_depth drops
_BRACKET_STEP = np.zeros(256, np.int8)
_BRACKET_STEP[list(b"[{")] = 1
_BRACKET_STEP[list(b"]}")] = -1
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text, without parsing it; brackets inside
    strings do not count. Vectorised passes over the bytes (about 20 ms for 4 MB whatever they are):
    drop the escaped backslashes and quotes, keep only brackets and quotes, mark what lies between
    an odd and an even quote as string, and take the maximum running sum of +1 per opening and -1
    per closing bracket outside strings."""
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = raw.translate(None, _STRUCTURE_ONLY)
    if not structure:
        return 0
    chars = np.frombuffer(structure, np.uint8)
    in_string = np.bitwise_xor.accumulate(chars == ord('"'))
    steps = _BRACKET_STEP[chars]
    steps[in_string] = 0
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


def _path(parent: str | None, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent or ''}[{key}]"
    return f"{parent}.{key}" if parent else key


def _invalid_unicode(value: Any, path: str | None) -> tuple[str | None, bool] | None:
    """Where the first string that is not valid Unicode is: (param, whether it is an object key), or None."""
    if isinstance(value, str):
        return (path, False) if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if _SURROGATE.search(key):
                return (path, True)
            if (found := _invalid_unicode(item, _path(path, key))) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := _invalid_unicode(item, _path(path, i))) is not None:
                return found
    return None


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def decode_json_body(raw: bytes) -> dict:
    """A request body as the JSON object it must be, or an OpenAIError (400) saying what is wrong."""
    invalid_json = (
        "We could not parse the JSON body of your request. The body must be valid JSON "
        "(Content-Type: application/json)."
    )
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise invalid_request(
            f"The request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep.", code="invalid_json"
        )
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise invalid_request(invalid_json, code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object.", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw) and (where := _invalid_unicode(data, None)) is not None:
        param, is_key = where
        why = "is not valid Unicode: it has a lone UTF-16 surrogate (such as \\ud800), which UTF-8 cannot encode."
        if param is None:
            raise invalid_request(f"A parameter name {why}", None, "invalid_value")
        what = "a key of the object" if is_key else "the string"
        raise invalid_request(f"Invalid value for '{param}': {what} {why}", param, "invalid_value")
    return data


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
    (null unless requested) and `finish_reason`."""

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


class TopLogprob(BaseModel):
    """One of the most likely tokens at a position: its text (the token decoded alone), logprob and
    UTF-8 bytes (the token's own bytes: a piece of a multi-byte character has its partial bytes)."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """A chat choice's `logprobs` (with `logprobs: true`): one entry per token of the content."""

    content: list[ChatCompletionTokenLogprob] | None
    refusal: list[ChatCompletionTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """A completion choice's `logprobs` (with `logprobs: N`): parallel lists over the tokens of the
    text (with `echo`, the prompt's first: its first token has no logprob); `top_logprobs` maps token
    text -> logprob for the N most likely tokens; `text_offset` is each token's character offset."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class ChatCompletionChoice(_Choice):
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
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
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionStreamChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    speculation: SpeculationInfo | None = None


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    speculation: SpeculationInfo | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error's body (errors.OpenAIError.body)."""

    error: ErrorDetail


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

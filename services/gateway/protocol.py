"""Request and response models of the OpenAI-compatible API (fields in the order of OpenAI's docs).

Request fields are handled as OpenAI handles them:
- every parameter of OpenAI's API is declared; the supported ones are validated here (types and
  OpenAI's ranges: `stop` at most 4 strings, `top_logprobs` 0..20, `logit_bias` token-id keys with
  values in [-100, 100], penalties in [-2, 2], ...) and by the serving layer (limits that depend on
  the model: the context length, the vocabulary, the largest `n`);
- known but unsupported parameters (`audio`, `functions`, `suffix`, ...) are refused with a 400
  naming the parameter by `unsupported()`, unless the value is a no-op (`modalities: ["text"]`, ...);
- hints that do not change the output (`user`, `metadata`, `service_tier`, `prediction`,
  `prompt_cache_key`, ...) are accepted and ignored;
- `store` (chat, and completions as a TIDE extension): false = never train on this request (it is
  not captured; services/gateway/governance.py, docs/data-handling.md); absent or true = eligible;
- anything else is a 400 "Unrecognized request argument supplied: <name>" naming it, except the
  TIDE extensions (sent with the client's `extra_body`), declared once in `TideExtensions`:
  `speculative` (false = plain decode), `workload` (a tag carried into telemetry), `top_k`,
  `ignore_eos`, `stop_token_ids`, and vLLM's extensions that OpenAI-compatible clients send, declared
  in `VllmExtensions` (`min_tokens`, `repetition_penalty`, `min_p`, `include_stop_str_in_output`, ...)
  with vLLM's meaning; `skip_special_tokens` and `spaces_between_special_tokens` take only `true`.

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
from typing import Annotated, Any, ClassVar, Literal, Union

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    RootModel,
    Tag,
    field_validator,
    model_validator,
)

from services.gateway.errors import OpenAIError, invalid_request, unrecognized_argument, unsupported_parameter
from tide.speculation import SpeculationStats

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # taken mod 2^64 for SamplingParams.seed (uint64)
U32_MAX = 2**32 - 1  # SamplingParams.max_tokens, top_k, stop_token_ids and TokenIds are uint32
MAX_JSON_DEPTH = 64  # nesting levels of a request body, the body object being level 1
MAX_STOP = 4  # OpenAI: up to 4 stop sequences
MAX_TOOLS = 128  # OpenAI: at most 128 functions
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # function and json_schema names (OpenAI)
TokenId = Annotated[int, Field(ge=0, le=U32_MAX)]
Bias = Annotated[float, Field(ge=-100, le=100)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Stop = str | Annotated[list[str], Field(max_length=MAX_STOP)]


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


class TideExtensions(BaseModel):
    """TIDE's request parameters beyond OpenAI's (the client's `extra_body`), on both endpoints; the
    one declared list of them (`TIDE_EXTENSIONS`)."""

    speculative: bool | None = Field(
        None,
        description="TIDE: false = plain decoding; true = speculate even "
        "where the policy would not; unset = the worker's policy",
    )
    workload: str = Field("", description="TIDE: a workload tag carried into telemetry")
    top_k: int = Field(default=0, ge=-1, le=U32_MAX, description="TIDE: keep the k most likely tokens; 0 or -1: off")
    ignore_eos: bool = Field(False, description="TIDE: keep generating past the end-of-sequence token")
    stop_token_ids: list[TokenId] = Field(default_factory=list, description="TIDE: token ids that end the output")


TIDE_EXTENSIONS = tuple(TideExtensions.model_fields)


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of a JSON Schema, a regex, a list of choices, a grammar, or any JSON object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON Schema (object or JSON text)")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


class VllmExtensions(BaseModel):
    """vLLM's sampling parameters beyond OpenAI's (sent with `extra_body`), on both endpoints, with
    vLLM's meaning and defaults; the one declared list of them (`VLLM_EXTENSIONS`)."""

    min_tokens: int = Field(
        default=0, ge=0, le=U32_MAX,
        description="vLLM: EOS and stop_token_ids cannot end the output before it has this many tokens",
    )
    repetition_penalty: float = Field(  # bounds: tide.engine.sequence's, which keep the logits finite
        default=1.0, ge=1e-3, le=1e3,
        description="vLLM: 0.001..1000; the logit of every token in the prompt or the output so far is divided by it "
        "when positive, multiplied by it when negative; 1 = off",
    )
    min_p: float = Field(
        default=0.0, ge=0, le=1,
        description="vLLM: drop tokens less probable than min_p times the most probable one (after temperature)",
    )
    include_stop_str_in_output: bool = Field(False, description="vLLM: the matched stop string ends the text")
    # The worker decodes with skip_special_tokens=True and no spaces added between special tokens
    # (what vLLM's defaults give for the target's tokenizers); only those values are taken.
    skip_special_tokens: bool = Field(True, description="vLLM: only true (special tokens are left out of the text)")
    spaces_between_special_tokens: bool = Field(True, description="vLLM: only true")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, le=U32_MAX,
        description="vLLM: keep only the last k prompt tokens; -1: as many as the context holds",
    )
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20,
        description="vLLM: the target's logprob of every prompt token after the first, with this many alternatives",
    )
    # vLLM's structured outputs, as the engine's output constraints (at most one per request).
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM: a JSON Schema the output follows")
    guided_regex: str | None = Field(None, description="vLLM: a regular expression the whole output matches")
    guided_choice: list[str] | None = Field(None, min_length=1, description="vLLM: the output is one of these")
    guided_grammar: str | None = Field(
        None, description="vLLM: a context-free grammar (the engine's dialect: llguidance's Lark syntax)"
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description='vLLM: one of {"json", "regex", "choice", "grammar", "json_object"}'
    )


    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_a_token(cls, value):
        if value == 0:
            raise ValueError("must be -1 or at least 1")
        return value


VLLM_EXTENSIONS = tuple(VllmExtensions.model_fields)


class VllmChatExtensions(BaseModel):
    """vLLM's chat-only parameters: how the chat template renders the messages (`VLLM_CHAT_EXTENSIONS`)."""

    add_generation_prompt: bool = Field(True, description="vLLM: end the prompt with the assistant's turn opening")
    continue_final_message: bool = Field(
        False, description="vLLM: leave the last (assistant) message open, for the model to continue it"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM: more variables for the chat template")


class VllmChatEcho(BaseModel):
    """vLLM's `echo` on chat (not a template option: /tokenize does not take it)."""

    echo: bool = Field(
        False, description="vLLM: the answer starts with the last message's content when that is the assistant's"
    )


VLLM_CHAT_EXTENSIONS = (*VllmChatExtensions.model_fields, *VllmChatEcho.model_fields)


class StrictRequest(BaseModel):
    """A request body whose every parameter is declared: an unknown one is a 400 naming it
    (`unsupported()`), and so is a declared one set to a value the server cannot honour
    (`unsupported_params`); `"param": null` means "not given"."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_request_schema)
    unsupported_params: ClassVar[dict[str, Unsupported]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        """OpenAI treats `"param": null` as "not given"; so do we (defaults apply, required ones are missing)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def unsupported(self) -> OpenAIError | None:
        """The first unknown parameter, or the first set parameter we cannot honour, as a 400."""
        if self.model_extra:
            return unrecognized_argument(next(iter(self.model_extra)))
        for name, (harmless, why, _) in self.unsupported_params.items():
            if name in self.model_fields_set and not harmless(getattr(self, name)):
                return unsupported_parameter(name, why)
        return None


class _Request(StrictRequest, TideExtensions, VllmExtensions):
    """The completion endpoints' common request behaviour: strict, with TIDE's and vLLM's extensions."""

    def unsupported(self) -> OpenAIError | None:
        err = super().unsupported()
        if err is not None:
            return err
        for name in ("skip_special_tokens", "spaces_between_special_tokens"):
            if not getattr(self, name):
                return unsupported_parameter(name, f"only {name}=true is supported (the workers' decoding)")
        return None

    def stops(self) -> list[str]:
        stop = getattr(self, "stop", None)
        return stop if isinstance(stop, list) else [stop] if stop else []

    @field_validator("logit_bias", check_fields=False)
    @classmethod
    def _token_id_keys(cls, value):
        """OpenAI's logit_bias keys are token ids written as strings ("50256"); kept as ints."""
        if value is None:
            return value
        out = {}
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()) or int(key) > U32_MAX:
                raise ValueError(f'keys must be token ids (decimal strings such as "50256"), got {key[:32]!r}')
            out[int(key)] = bias
        return out


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False


def _no(v: Any) -> bool:
    return not v


def _tagged(*members: type[BaseModel], what: str = "type") -> Any:
    """A union of models told apart by their `type` literal, whose validation errors name the
    parameter (the union's tags are dropped from error locations, see errors._loc)."""
    tags = {m.model_fields["type"].annotation.__args__[0]: m for m in members}

    def tag(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return f"tagged-union-{kind}" if isinstance(kind, str) and kind in tags else None

    union = tuple(Annotated[m, Tag(f"tagged-union-{k}")] for k, m in tags.items())
    expected = ", ".join(repr(k) for k in tags)
    return Annotated[
        Union[union],  # noqa: UP007 - a union built from a tuple
        Discriminator(tag, custom_error_type="invalid_value", custom_error_message=f"{what} must be one of {expected}"),
    ]


_NONE: dict[str, Any] = {"type": "null"}
_EMPTY_LIST: dict[str, Any] = {"type": "array", "maxItems": 0}
MAX_PROMPTS = 64  # prompts in one completion request
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}


# ------------------------------------------------------------------------------------ tools


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object; absent = no parameters
    strict: bool | None = None


class ChatCompletionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    """A call as the model made it: the function's name and its arguments as JSON text."""

    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# ------------------------------------------------------------------------------------ response_format


class ResponseFormatText(BaseModel):
    type: Literal["text"]


class ResponseFormatJsonObject(BaseModel):
    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON Schema object")
    strict: bool | None = None


class ResponseFormatJsonSchema(BaseModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = _tagged(ResponseFormatText, ResponseFormatJsonObject, ResponseFormatJsonSchema)


# ------------------------------------------------------------------------------------ messages


def _message_schema(schema: dict[str, Any]) -> None:
    """A message as the server takes it: text parts only; content unless an assistant's; a tool
    message's tool_call_id."""
    properties = schema["properties"]
    properties["content"]["anyOf"][1]["items"] = _TEXT_PART
    schema["allOf"] = [
        {
            "if": {"properties": {"role": {"const": "assistant"}}},
            "else": {"required": ["content"], "properties": {"content": {"not": _NONE}}},
        },
        {
            "if": {"properties": {"role": {"const": "tool"}}},
            "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}},
        },
    ]


class ChatMessage(BaseModel):
    """One input message. Text content only; an assistant's may carry `tool_calls` (its content may
    then be null), a tool's answers the call `tool_call_id`."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_message_schema)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

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
    def _well_formed(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)


class ChatCompletionRequest(_Request, VllmChatExtensions, VllmChatEcho):
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    model: str
    audio: Any = None
    frequency_penalty: Penalty | None = None
    function_call: Any = None
    functions: Any = None
    logit_bias: dict[str, Bias] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    logprobs: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1, le=U32_MAX)
    max_tokens: int | None = Field(default=None, ge=1, le=U32_MAX)
    metadata: Any = None
    modalities: list[str] | None = None
    moderation: Any = None
    n: int = Field(default=1, ge=1, le=U32_MAX)
    parallel_tool_calls: bool | None = None
    prediction: Any = None  # a latency hint only: ignoring it does not change the output
    presence_penalty: Penalty | None = None
    prompt_cache_key: Any = None  # caching hints: ignoring them does not change the output
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    reasoning_effort: Any = None
    response_format: ResponseFormat | None = None
    safety_identifier: str | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    service_tier: Any = None
    stop: Stop | None = None
    store: bool | None = Field(None, description="false: never capture this request for training "
                               "(docs/data-handling.md); absent or true: eligible")
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    tools: Annotated[list[ChatCompletionTool], Field(max_length=MAX_TOOLS)] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    top_p: float | None = Field(default=None, ge=0, le=1)
    user: str | None = None
    verbosity: Any = None
    web_search_options: Any = None

    # fmt: off
    unsupported_params: ClassVar[dict[str, Unsupported]] = {
        "audio": (lambda v: v is None, "audio output is not supported", _NONE),
        "function_call": (lambda v: v in (None, "none"), "the deprecated function calling is not supported; "
                          "use tools and tool_choice", {"const": "none"}),
        "functions": (_no, "the deprecated function calling is not supported; use tools", _EMPTY_LIST),
        "modalities": (lambda v: v is None or list(v) == ["text"], "only the text modality is supported",
                       {"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1}),
        "moderation": (lambda v: v is None, "moderation is not supported", _NONE),
        "verbosity": (lambda v: v in (None, "medium"), "only the default verbosity is supported", {"const": "medium"}),
        "web_search_options": (lambda v: v is None, "web search is not supported", _NONE),
    }
    # fmt: on

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value):
        if not value:
            raise ValueError("messages must contain at least one message")
        return value

    def check_tools(self) -> None:
        """OpenAI: `required` or a named function needs `tools`, and the name must be one of them."""
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto"):
            return
        names = [t.function.name for t in self.tools or ()]
        if not names:
            raise invalid_request(
                "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
                "tool_choice",
                "invalid_value",
            )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise invalid_request(
                f"Invalid value for 'tool_choice': no function named {choice.function.name[:64]!r} in 'tools'.",
                "tool_choice",
                "invalid_value",
            )

    def tool_mode(self) -> str:
        """How tools are used: "none" (no tools offered, no parsing), "auto" (offered; calls parsed
        from the output), "required" (at least one call, the output constrained to calls) or
        "named" (one call of `tool_choice.function.name`)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"


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
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    logprobs: int | None = Field(default=None, ge=0, le=5)
    max_tokens: int = Field(default=16, ge=1, le=U32_MAX)
    n: int = Field(default=1, ge=1, le=U32_MAX)
    presence_penalty: Penalty | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = Field(None, description="TIDE (OpenAI's chat parameter): false = never capture this "
                               "request for training; absent or true: eligible")
    suffix: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    user: str | None = None

    unsupported_params: ClassVar[dict[str, Unsupported]] = {
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


# ------------------------------------------------------------------------------------ tokenization


class TokenizeRequest(VllmChatExtensions):
    """vLLM's POST /tokenize: a raw `prompt` (tokenized as /v1/completions tokenizes it) or chat
    `messages` (rendered with the chat template as /v1/chat/completions renders them), exactly one."""

    model_config = ConfigDict(extra="forbid")
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages is required")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize: token ids -> their text."""

    model_config = ConfigDict(extra="forbid")
    model: str
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


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


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens an earlier request's cache entries served (the prefix cache)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


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


def _absent(value: Any) -> bool:
    return value is None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_absent)  # only when the model called tools


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


class PromptLogprob(BaseModel):
    """vLLM's entry of a prompt position (`prompt_logprobs`): the token's logprob, its rank among the
    position's most likely tokens (1 = the most likely; null when outside the returned ones) and text."""

    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's `prompt_logprobs`: per prompt token, null for the first, else token id (as a string) -> entry for
# the prompt's token and the requested number of most likely ones.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    speculation: SpeculationInfo
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=_absent)  # vLLM's, when asked


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(None, exclude_if=_absent)
    arguments: str | None = Field(None, exclude_if=_absent)


class DeltaToolCall(BaseModel):
    """A streamed piece of a tool call: its first has `id`, `type` and the function's name (arguments
    ""), the next ones more of the arguments; `index` says which call of the choice."""

    index: int
    id: str | None = Field(None, exclude_if=_absent)
    type: Literal["function"] | None = Field(None, exclude_if=_absent)
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    # OpenAI sends {"role": ..., "content": ""}, {"content": ...}, {"tool_calls": [...]}, {}
    role: Literal["assistant"] | None = Field(None, exclude_if=_absent)
    content: str | None = Field(None, exclude_if=_absent)
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=_absent)


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
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=_absent)  # vLLM's, when asked


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

"""Tool calling for models whose chat template knows nothing of tools (SmolLM2's): how tools and
calls are written into the prompt, the schema that forces a call, and the parser that finds calls
in the output.

Prompt (Hermes / Qwen style, through the model's own template): the tools' signatures go into the
system message (appended to the first system or developer message, else a new first one), inside
`<tools></tools>`, with the instruction to answer a call as

    <tool_call>
    {"name": "<function name>", "arguments": {<arguments>}}
    </tool_call>

An assistant message's `tool_calls` are written back in that form after its content; consecutive
`role: "tool"` messages become one user turn of `<tool_response>` blocks (the results, in order).

Output:
- `tool_choice: "auto"` (the default with tools): `ToolCallParser("tagged")` reads the text as it
  streams: text outside `<tool_call>` blocks is content; a block whose JSON names one of the tools
  is a call (its `arguments` streamed as they come, the model's JSON text as it wrote it); a block
  that names no known tool stays content. Whitespace next to a call is dropped.
- `"required"` / a named function: the output is constrained (tide.v1 `json_schema`) by
  `forced_call_schema` to a call object, or to a non-empty array of them when parallel calls are
  allowed with `required`; `ToolCallParser("json")` reads it. The call then always parses (unless
  max_tokens cuts it).
- `"none"`: no tools in the prompt, no parsing.

The same parser serves streaming and non-streaming responses (a non-streamed choice is the sum of
the events its whole text gives), so both report the same calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.protocol import ChatCompletionTool, ChatMessage

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_WS = " \t\r\n"

TOOLS_PROMPT = """# Tools

You may call one or more of the functions below to help with the user's request. Their signatures are \
given as JSON inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object holding its name and its arguments inside \
<tool_call></tool_call> tags, one block per call:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}
</tool_call>"""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ------------------------------------------------------------------------------------ the prompt


def _tool_json(tool: ChatCompletionTool) -> str:
    return json.dumps({"type": "function", "function": tool.function.model_dump(exclude_none=True)}, ensure_ascii=False)


def _call_text(name: str, arguments: str) -> str:
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments  # as the client sent it
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CALL_CLOSE}"


def render_messages(messages: list[ChatMessage], tools: list[ChatCompletionTool] | None) -> list[dict[str, str]]:
    """The conversation as plain {role, content} messages for the model's chat template: developer as
    system, tool signatures in the system message (when `tools`), calls and results written in."""
    out: list[dict[str, str]] = []
    for m in messages:
        if m.role == "tool":
            block = f"<tool_response>\n{m.text()}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": "1"})
            continue
        content = m.text()
        if m.role == "assistant" and m.tool_calls:
            calls = "\n".join(_call_text(c.function.name, c.function.arguments) for c in m.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    for m in out:
        m.pop("tool_results", None)
    if tools:
        block = TOOLS_PROMPT.format(tools="\n".join(_tool_json(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


# ------------------------------------------------------------------------------------ forcing a call


def _call_schema(tool: ChatCompletionTool) -> dict[str, Any]:
    parameters = tool.function.parameters or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_call_schema(tools: list[ChatCompletionTool], name: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON Schema the output must match when a call is required: one call of function `name`;
    else one call of any tool, or (`parallel`) a non-empty array of them."""
    if name is not None:
        return _call_schema(next(t for t in tools if t.function.name == name))
    calls = [_call_schema(t) for t in tools]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": one, "minItems": 1} if parallel else one


# ------------------------------------------------------------------------------------ parsing


@dataclass
class CallStart:
    """A call begins: its index among the choice's calls, id and function name."""

    index: int
    id: str
    name: str


@dataclass
class CallArguments:
    """More of call `index`'s arguments text."""

    index: int
    text: str


@dataclass
class Content:
    text: str


Event = Content | CallStart | CallArguments


class _CallScanner:
    """Reads one JSON call object, {"name": ..., "arguments": ...}, a character at a time: the name once
    its string is complete, the arguments' text as it comes (an object or array as written; a string
    value, as some models write arguments, decoded once complete). Keys other than name/arguments are
    skipped. `failed` once the text cannot be such an object; `done` after its closing brace."""

    def __init__(self) -> None:
        self.state = "start"  # start, key_or_end, key, colon, value, after_value
        self.in_string = self.escape = False
        self.depth = 0  # nesting inside the current value
        self.key = ""
        self.value = ""  # the current value's text so far
        self.name: str | None = None
        self.arguments: list[str] = []  # arguments text not yet taken
        self.had_arguments = False
        self.done = self.failed = False

    def feed(self, text: str) -> int:
        """Consume characters of `text` up to the end of the object; returns how many were used."""
        for i, c in enumerate(text):
            if self.done or self.failed:
                return i
            self._char(c)
        return len(text)

    def take_arguments(self) -> str:
        out = "".join(self.arguments)
        self.arguments.clear()
        return out

    def _string_char(self, c: str) -> bool:
        """Track a JSON string; True when `c` closed it."""
        if self.escape:
            self.escape = False
        elif c == "\\":
            self.escape = True
        elif c == '"':
            self.in_string = False
            return True
        return False

    def _end_value(self) -> None:
        value, self.value = self.value, ""
        if self.key == "name":
            try:
                name = json.loads(value)
            except ValueError:
                name = None
            if not isinstance(name, str):
                self.failed = True
                return
            self.name = name
        elif self.key == "arguments":
            if value.startswith('"'):
                try:
                    self.arguments.append(json.loads(value))
                except ValueError:
                    self.failed = True
            elif not value.startswith(("{", "[")):
                self.arguments.append(value.strip(_WS))

    def _char(self, c: str) -> None:
        state = self.state
        if state == "key":
            self.key += c
            if self._string_char(c):
                try:
                    self.key = json.loads(self.key)
                except ValueError:
                    self.failed = True
                self.state = "colon"
            return
        if state == "value":
            self._value_char(c)
            return
        if c in _WS:
            return
        if state == "start":
            if c != "{":
                self.failed = True
            self.state = "key_or_end"
        elif state in ("key_or_end", "after_value"):
            if c == "}":
                self.done = True
            elif c == "," and state == "after_value":
                self.state = "key_or_end"
            elif c == '"' and state == "key_or_end":
                self.key, self.in_string, self.state = '"', True, "key"
            else:
                self.failed = True
        elif state == "colon":
            if c != ":":
                self.failed = True
            self.state = "value"
            self.value, self.depth = "", 0

    def _value_char(self, c: str) -> None:
        if not self.value and c in _WS:
            return
        if self.key == "arguments":
            self.had_arguments = True
        if self.in_string:
            self.value += c
            self._stream(c)
            if self._string_char(c) and self.depth == 0:
                self._end_value()
                self.state = "after_value"
            return
        if self.depth == 0 and self.value and c in ",}":  # the end of a number, true, false or null
            self._end_value()
            self.state = "after_value"
            self._char(c)
            return
        self.value += c
        self._stream(c)
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 0:
                self._end_value()
                self.state = "after_value"
            elif self.depth < 0:
                self.failed = True

    def _stream(self, c: str) -> None:
        """An object or array argument streams as it is written."""
        if self.key == "arguments" and self.value[0] in "{[":
            self.arguments.append(c)


@dataclass
class ToolCallParser:
    """Events (content, call starts, argument fragments) from a choice's text as it streams; see the
    module docstring. `mode`: "tagged" (calls in <tool_call> blocks among content) or "json" (the whole
    output is a call object or an array of them). `names`: the functions a call may name."""

    mode: str
    names: frozenset[str]
    calls: int = 0
    _buffer: str = ""
    _scanner: _CallScanner | None = None
    _block: str = ""  # a tagged block's text while its name is unknown (content if it never names a tool)
    _started: bool = False  # the current call's CallStart was sent
    _after_call: bool = False  # drop whitespace that follows a call
    _expect_close: bool = False  # a tagged call ended: its </tool_call> may follow
    _ws: str = ""  # whitespace before the open block
    _raw: str = ""  # json mode: the whole output (content if it never became a call)
    _json_state: str = "start"  # json mode: start, array, element, after_element, done
    _events: list[Event] = field(default_factory=list)

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        if self.mode == "json":
            self._raw += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        """The end of the output: what was held back, and the open call (if any) closed."""
        self._run(final=True)
        if self._scanner is not None:
            self._end_call(final=True)
        if self.mode == "tagged" and self._buffer:
            self._content(self._buffer, final=True)
            self._buffer = ""
        if self.mode == "json" and not self.calls and self._raw:
            self._events.append(Content(self._raw))  # never a call (cut short): the text as it is
        return self._take()

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        merged: list[Event] = []
        for e in events:  # adjacent fragments of one kind as one event
            last = merged[-1] if merged else None
            same_kind = type(e) is type(last) and isinstance(e, (Content, CallArguments))
            if same_kind and (isinstance(e, Content) or last.index == e.index):
                last.text += e.text
            else:
                merged.append(e)
        return [e for e in merged if not (isinstance(e, (Content, CallArguments)) and not e.text)]

    # ---- content

    def _content(self, text: str, final: bool) -> None:
        """Content, except whitespace right after a call and (until more text comes) trailing whitespace."""
        if self._after_call:
            text = text.lstrip(_WS)
            if not text:
                return
            self._after_call = False
        self._events.append(Content(text))

    def _run(self, final: bool) -> None:
        if self.mode == "json":
            self._run_json()
            return
        while self._buffer:
            if self._scanner is not None:
                if not self._feed_call():
                    return
                continue
            if self._expect_close:
                rest = self._buffer.lstrip(_WS)
                if rest.startswith(CALL_CLOSE):
                    self._buffer = rest[len(CALL_CLOSE) :]
                elif CALL_CLOSE.startswith(rest) and not final:
                    return  # more may complete it
                self._expect_close = False
                continue
            at = self._buffer.find(CALL_OPEN)
            if at < 0:
                keep = 0 if final else _held_back(self._buffer)
                out, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
                if out:
                    self._content(out, final)
                return
            before = self._buffer[:at].rstrip(_WS)
            if before:
                self._content(before, final)
            self._ws = self._buffer[len(before) : at]  # content again if the block is no call
            self._buffer = self._buffer[at + len(CALL_OPEN) :]
            self._scanner, self._block, self._started = _CallScanner(), CALL_OPEN, False

    def _feed_call(self) -> bool:
        """Feed the buffer to the open call; True when the call ended (the loop goes on)."""
        scanner = self._scanner
        assert scanner is not None
        used = scanner.feed(self._buffer)
        self._block += self._buffer[:used]
        self._buffer = self._buffer[used:]
        self._emit_call(scanner)
        if scanner.failed and not self._started:  # not a call: its text is content
            self._scanner = None
            self._buffer = self._block[len(CALL_OPEN) :] + self._buffer
            self._content(self._ws + CALL_OPEN, final=False)
            return True
        if scanner.done or scanner.failed:
            self._end_call(final=False)
            return True
        return False

    def _emit_call(self, scanner: _CallScanner) -> None:
        if not self._started and scanner.name is not None:
            if scanner.name not in self.names:
                scanner.failed = True
                return
            self._events.append(CallStart(self.calls, new_call_id(), scanner.name))
            self._started = True
        if self._started:
            self._events.append(CallArguments(self.calls, scanner.take_arguments()))

    def _end_call(self, final: bool) -> None:
        scanner = self._scanner
        assert scanner is not None
        self._scanner = None
        if not self._started:
            if self.mode == "tagged":
                self._content(self._ws + self._block, final)
            return
        if not scanner.had_arguments and not scanner.arguments:
            self._events.append(CallArguments(self.calls, "{}"))
        self.calls += 1
        self._after_call = self._expect_close = True

    def _run_json(self) -> None:
        while self._buffer:
            if self._scanner is not None:
                used = self._scanner.feed(self._buffer)
                self._buffer = self._buffer[used:]
                self._emit_call(self._scanner)
                if not (self._scanner.done or self._scanner.failed):
                    return
                failed = self._scanner.failed and not self._started
                self._end_call(final=False)
                self._json_state = "done" if failed or self._json_state == "element" else "after_element"
                continue
            c, self._buffer = self._buffer[0], self._buffer[1:]
            if c in _WS or self._json_state == "done":
                continue
            if self._json_state == "start" and c == "[":
                self._json_state = "array"
            elif self._json_state in ("start", "array") and c == "{":
                self._json_state = "element" if self._json_state == "start" else "array_element"
                self._scanner, self._started, self._block = _CallScanner(), False, ""
                self._buffer = c + self._buffer
            elif self._json_state == "after_element" and c == ",":
                self._json_state = "array"
            else:
                self._json_state = "done"


def _held_back(text: str) -> int:
    """How many trailing characters could still turn out to be the start of a call (a prefix of
    CALL_OPEN, or whitespace before one): held until more text says."""
    keep = 0
    for n in range(min(len(CALL_OPEN), len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            keep = n
            break
    stripped = text[: len(text) - keep]
    return keep + len(stripped) - len(stripped.rstrip(_WS))


@dataclass
class ParsedChoice:
    """A whole output's content (None when only calls) and calls [(id, name, arguments)]."""

    content: str | None
    calls: list[tuple[str, str, str]]


def collect(events: list[Event]) -> ParsedChoice:
    """The sum of a choice's events (what a client reassembles from the stream)."""
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: list[list[str]] = []
    for e in events:
        if isinstance(e, CallStart):
            calls.append([e.id, e.name, ""])
        elif isinstance(e, CallArguments):
            calls[e.index][2] += e.text
    if calls and not content.strip(_WS):
        return ParsedChoice(None, [(i, n, a) for i, n, a in calls])
    return ParsedChoice(content, [(i, n, a) for i, n, a in calls])

"""Generation requests as the worker sees them: validation, per-request events and statistics.

No gRPC: `server.py` maps `tide.v1.GenerateRequest` onto `GenerationRequest` and the events below
onto `GenerateResponse` messages. A request's events arrive, in order, on its handle's queue:
zero or more `TokenEvent`s, then exactly one `FinalEvent` or `ErrorEvent`.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from dataclasses import dataclass, field

from tide.engine.constraints import CompiledGrammar
from tide.engine.sequence import FinishReason, GrammarSpec, SamplingParams, Sequence, TokenLogprob
from tide.speculation import SpeculationStats

MAX_REQUEST_ID_LEN = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256


class ErrorKind(enum.Enum):
    """Why a request was refused or failed (mirrors tide.v1.ErrorCode)."""

    INVALID_ARGUMENT = "invalid_argument"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    DUPLICATE_ID = "duplicate_id"
    OVERLOADED = "overloaded"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


class RequestRejected(Exception):
    """`Worker.submit` refused a request before it started; `kind` says why."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate. Exactly one of prompt_ids / prompt_text. max_tokens 0 = up to the
    context window. temperature 0 = greedy."""

    request_id: str
    prompt_ids: tuple[int, ...] | None = None
    prompt_text: str | None = None
    max_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    speculative: bool | None = None  # None = the policy decides; False = never; True = always
    workload: str = ""
    no_memory: bool = False  # True: not added to the speculation memory
    logprobs: int | None = None  # top alternatives per generated token's logprob entry; None = off
    prompt_logprobs: int | None = None  # the same for prompt tokens 1..n-1
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    grammar: GrammarSpec | None = None  # output constraint; None = unconstrained
    capture: bool = True  # False: opted out of training, never captured (the gateway decides)
    # the API key's id (a hash, never the key; "" without keys): recorded with captured rows, and the
    # request's speculation-memory scope
    key_id: str = ""


def _invalid(message: str) -> RequestRejected:
    return RequestRejected(ErrorKind.INVALID_ARGUMENT, message)


def prepare(req: GenerationRequest, tokenizer, vocab_size: int, max_seq_len: int) -> tuple[list[int], SamplingParams]:
    """Validate `req` and return (prompt token ids, engine sampling params); raises RequestRejected."""
    if not req.request_id or len(req.request_id) > MAX_REQUEST_ID_LEN:
        raise _invalid(f"request_id must be 1..{MAX_REQUEST_ID_LEN} characters")
    if (req.prompt_ids is None) == (req.prompt_text is None):
        raise _invalid("exactly one of prompt_token_ids and prompt_text is required")
    if req.prompt_text is not None:
        if tokenizer is None:
            raise _invalid("prompt_text needs a tokenizer and this worker's target has none; send prompt_token_ids")
        prompt = list(tokenizer(req.prompt_text)["input_ids"])
    else:
        prompt = list(req.prompt_ids)
    if not prompt:
        raise _invalid("the prompt is empty")
    bad = [t for t in (*prompt, *req.stop_token_ids, *(t for t, _ in req.logit_bias)) if not 0 <= t < vocab_size]
    if bad:
        raise _invalid(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(req.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_LEN for s in req.stop):
        raise _invalid(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_STRING_LEN} characters")
    stop = tuple(s for s in req.stop if s)
    if stop and tokenizer is None:
        raise _invalid("stop strings need a tokenizer and this worker's target has none; use stop_token_ids")
    if len(prompt) >= max_seq_len:
        raise RequestRejected(ErrorKind.CONTEXT_LENGTH_EXCEEDED,
                              f"the prompt has {len(prompt)} tokens; this worker's context is {max_seq_len}")
    room = max_seq_len - len(prompt)
    if req.max_tokens > room:
        raise RequestRejected(ErrorKind.CONTEXT_LENGTH_EXCEEDED,
                              f"prompt ({len(prompt)} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                              f"context of {max_seq_len} tokens")
    try:  # the sampling values are checked once, by the engine's SamplingParams
        params = SamplingParams(max_tokens=req.max_tokens or room, temperature=float(req.temperature),
                                top_p=float(req.top_p), top_k=req.top_k, seed=req.seed, stop=stop,
                                stop_token_ids=tuple(req.stop_token_ids), ignore_eos=req.ignore_eos,
                                logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs,
                                logit_bias=req.logit_bias, presence_penalty=req.presence_penalty,
                                frequency_penalty=req.frequency_penalty, min_tokens=req.min_tokens,
                                repetition_penalty=float(req.repetition_penalty), min_p=float(req.min_p),
                                grammar=req.grammar)
    except ValueError as e:
        raise _invalid(str(e)) from None
    return prompt, params


@dataclass(frozen=True)
class TokenEvent:
    """New tokens and text; `logprobs`: entries of the tokens whose text is out (see
    tide.engine.engine.RequestOutput); `prompt_logprobs`: on the first event of a request that asked."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class FinalEvent:
    """End of a request. Times in milliseconds from arrival at the worker."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    speculation: SpeculationStats
    time_to_first_token_ms: float
    total_ms: float
    stop_string: str | None = None
    stop_token_id: int | None = None
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache served (tide.engine.prefix_cache)


@dataclass(frozen=True)
class ErrorEvent:
    kind: ErrorKind
    message: str


Event = TokenEvent | FinalEvent | ErrorEvent


@dataclass(eq=False)
class RequestHandle:
    """A submitted request: its event queue (thread-safe) and the worker's bookkeeping for it.

    Fields other than `events` and `ended` are written by the worker's loop thread only.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculative: bool | None
    workload: str
    arrival_s: float = field(default_factory=time.monotonic)  # monotonic seconds
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    # set once the last event (final or error) is queued: a stream holding tokens back to send
    # several in one message waits on this, so the end of a request is never held back
    ended: threading.Event = field(default_factory=threading.Event)
    seq: Sequence | None = None
    first_token_s: float | None = None
    spec_steps: int = 0
    plain_steps: int = 0
    drafter: str = "none"
    draft_version: str = ""
    done: bool = False
    grammar: CompiledGrammar | None = None  # params.grammar compiled by `Worker.submit` (off the loop)
    memory_scope: str = ""  # the speculation memory it reads and, with `remember`, is added to
    remember: bool = True
    key_id: str = ""  # the API key id that sent it: its memory document's owner, for forget

    def speculation(self) -> SpeculationStats:
        s = self.seq
        draft, acc = (s.draft_tokens, s.accepted_tokens) if s is not None else (0, 0)
        length = (acc + self.spec_steps) / self.spec_steps if self.spec_steps else 0.0
        return SpeculationStats(length, draft, acc, self.spec_steps, self.plain_steps, self.draft_version,
                                self.drafter)

    def final(self, reason: FinishReason, tokenizer, eos_ids: set[int]) -> FinalEvent:
        now = time.monotonic()
        s = self.seq
        out = s.output_ids if s is not None else []
        stop_string = stop_token = None
        if reason is FinishReason.STOP and out:
            last = out[-1]
            if (last in eos_ids and not self.params.ignore_eos) or last in self.params.stop_token_ids:
                stop_token = last
            elif isinstance(s.matched_stop, str):  # the engine's record (min_tokens may skip earlier occurrences)
                stop_string = s.matched_stop
            elif self.params.stop and tokenizer is not None:
                stop_string = matched_stop_string(tokenizer.decode(out, skip_special_tokens=True), self.params.stop)
        ttft = (self.first_token_s - self.arrival_s) * 1e3 if self.first_token_s is not None else 0.0
        return FinalEvent(reason, len(self.prompt_ids), len(out), self.speculation(), ttft,
                          (now - self.arrival_s) * 1e3, stop_string, stop_token,
                          s.num_reused if s is not None else 0)


def matched_stop_string(text: str, stops: tuple[str, ...]) -> str | None:
    """The stop string that occurs first in `text` (the one the engine cut the output at)."""
    hits = [(i, n, s) for n, s in enumerate(stops) if s and (i := text.find(s)) >= 0]
    return min(hits)[2] if hits else None

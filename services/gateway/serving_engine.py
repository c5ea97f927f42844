"""What /v1/chat/completions and /v1/completions share: request checks, sampling options, the `n`
fan-out, merging the choices' streams, the response or SSE stream built from them, and error mapping.

`n` (times the number of prompts, for completions) fans out to one worker request per choice,
with ids `<response id>-<choice index>`; with a `seed`, choice i samples with seed + i (mod 2^64),
so choice 0 reproduces a single-choice request with the same seed.

Log probabilities are the target's, computed by the worker (tide.v1.SamplingParams.logprobs); their
entries follow the text (a token gets one once its text is out, none if its text never is), so they
match the returned text token for token, stop strings and max_tokens included. A token's string is
the token decoded alone (`token_text`), with its own UTF-8 bytes.

Every response and chunk has a `system_fingerprint` naming what produced it: the TIDE build, the
drafter and the draft version (`tide-<version>-<drafter>-<draft version or none>`). A response's
(and a stream's last chunk's) come from the speculation stats of its generations; the chunks before
the last use the draft the healthy workers serve when the stream starts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from typing import Any

from services.gateway.engine_client import (
    Constraint,
    EngineClient,
    EngineError,
    ErrorKind,
    GenerationFinal,
    GenerationRequest,
    SamplingOptions,
    TokenDelta,
    TokenLogprob,
)
from services.gateway.errors import (
    OpenAIError,
    bad_gateway,
    context_length_exceeded,
    internal_error,
    invalid_request,
    service_unavailable,
)
from services.gateway.fanout import Event, aggregate_speculation, merged
from services.gateway.governance import Eligibility
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import PromptLogprob, PromptTokensDetails, SpeculationInfo, UsageInfo
from services.gateway.serving_models import OpenAIServingModels
from services.gateway.tokenizer import TargetTokenizer
from tide.speculation import SpeculationStats

log = logging.getLogger(__name__)
_U64 = 2**64
LOGPROB_FLOOR = -9999.0  # JSON has no -inf: lower logprobs are reported as this (vLLM does the same)
_CONSTRAINT_WORDS = re.compile(r"schema|grammar|constraint|regex|json", re.IGNORECASE)


_REGEX_META = re.compile(r"[\\.^$|?*+()\[\]{}]")


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices` (vLLM's guided_choice): their alternation, each with
    the regex metacharacters escaped (only those: the constraint engine's regex syntax need not accept
    other escapes)."""
    return "(" + "|".join(_REGEX_META.sub(lambda m: "\\" + m.group(), c) for c in choices) + ")"


def guided_constraint(request) -> tuple[Constraint | None, str | None]:
    """vLLM's guided_json / guided_regex / guided_choice / guided_grammar / structured_outputs as an
    output constraint, and the parameter it came from; a 400 when more than one is set."""
    so = request.structured_outputs
    given = [
        (param, kind, value)
        for param, kind, value in (
            ("guided_json", "json_schema", request.guided_json),
            ("guided_regex", "regex", request.guided_regex),
            ("guided_choice", "choice", request.guided_choice),
            ("guided_grammar", "grammar", request.guided_grammar),
            ("structured_outputs.json", "json_schema", so and so.json_),
            ("structured_outputs.regex", "regex", so and so.regex),
            ("structured_outputs.choice", "choice", so and so.choice),
            ("structured_outputs.grammar", "grammar", so and so.grammar),
            ("structured_outputs.json_object", "json_object", so and so.json_object or None),
        )
        if value is not None
    ]
    if not given:
        return None, None
    if len(given) > 1:
        names = ", ".join(p for p, _, _ in given)
        raise invalid_request(f"At most one output constraint may be set, got {names}.", given[1][0], "invalid_value")
    param, kind, value = given[0]
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise invalid_request(f"{param} must be a JSON Schema: an object or its JSON text.", param,
                                      "invalid_value") from None
        if not isinstance(value, dict):
            raise invalid_request(f"{param} must be a JSON Schema object.", param, "invalid_value")
        return Constraint("json_schema", json.dumps(value, ensure_ascii=False)), param
    if kind == "choice":
        return Constraint("regex", choice_regex(value)), param
    if kind == "json_object":
        return Constraint("json_object"), param
    return Constraint(kind, value), param


@lru_cache(maxsize=1)
def build_version() -> str:
    try:
        return metadata.version("tide")
    except metadata.PackageNotFoundError:
        return "dev"


def fingerprint(drafter: str, draft_version: str) -> str:
    """`system_fingerprint`: tide-<build>-<drafter>-<draft version>, "none" for what is not there."""
    return f"tide-{build_version()}-{drafter or 'none'}-{draft_version or 'none'}"


def to_openai_error(err: EngineError, constraint_param: str | None = None) -> OpenAIError:
    """Map an engine failure to the HTTP status and body the client gets. An invalid-argument answer
    about the request's output constraint (a schema the grammar engine cannot compile) names
    `constraint_param`, the request parameter it came from."""
    if err.kind is ErrorKind.INVALID:
        param = constraint_param if constraint_param and _CONSTRAINT_WORDS.search(err.message) else None
        return invalid_request(err.message, param, "invalid_value" if param else None)
    if err.kind is ErrorKind.CONTEXT_LENGTH:
        return context_length_exceeded(err.message)
    if err.kind is ErrorKind.LOST:
        return bad_gateway(err.message)
    if err.kind is ErrorKind.INTERNAL:
        return internal_error(f"The inference worker failed: {err.message}")
    code = {ErrorKind.OVERLOADED: "overloaded", ErrorKind.CANCELLED: "cancelled"}.get(err.kind, "service_unavailable")
    return service_unavailable(err.message, code)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: character -> the byte it stands for (printable bytes stand
    for themselves, the others for chr(256 + k) in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(others)}}


def _byte_level(hf) -> bool:
    """Whether a HF fast tokenizer decodes with the ByteLevel decoder (GPT-2 style byte-level BPE)."""
    backend = getattr(hf, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    return type(decoder).__name__ == "ByteLevel" or "ByteLevel" in repr(decoder)


def sse(payload: dict | str) -> str:
    """One server-sent event carrying `payload` (a dict as JSON, or a literal like [DONE])."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


def sse_event(payload: dict) -> str:
    """One server-sent event named by its payload's `type` (the Responses and Messages APIs' streams)."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _choices(value: Any) -> list:
    """What a `delta_choice` / `finish_choice` gave, as a list of choices."""
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


@dataclass
class ChoiceState:
    """What one choice produced so far."""

    text: str = ""
    final: GenerationFinal | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


class OpenAIServing:
    """Base of the chat and completion handlers."""

    endpoint = ""

    def __init__(
        self,
        engine: EngineClient,
        models: OpenAIServingModels,
        tokenizer: TargetTokenizer,
        max_n: int,
        metrics: GatewayMetrics,
        tokenize_timeout_s: float = 10.0,
        endpoint: str | None = None,
    ) -> None:
        if endpoint is not None:
            self.endpoint = endpoint  # the metrics label (an API served through this class)
        self.engine = engine
        self.models = models
        self.tokenizer = tokenizer
        self.max_n = max_n
        self.metrics = metrics
        self.tokenize_timeout_s = tokenize_timeout_s
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    def _token_text(self, token_id: int) -> tuple[str, list[int]]:
        """A token's string and UTF-8 bytes, decoded alone. Byte-level BPE tokens map back to their
        exact bytes (a piece of a multi-byte character included: its string then has U+FFFD);
        other tokenizers' tokens are decoded alone and encoded."""
        hf = self.tokenizer.tokenizer
        piece = hf.convert_ids_to_tokens(token_id)
        decoder = _byte_decoder() if _byte_level(hf) else None
        if decoder is not None and piece is not None and all(c in decoder for c in piece):
            raw = bytes(decoder[c] for c in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = hf.decode([token_id])
        return text, list(text.encode("utf-8"))

    def logprob_counts(self, request) -> tuple[int | None, int | None]:
        """(top alternatives per generated token, per prompt token) the request asks for; None = off."""
        return None, None

    @staticmethod
    def logprob_value(value: float) -> float:
        return max(float(value), LOGPROB_FLOOR)

    # ---- checks -------------------------------------------------------------------------------

    def prompt_logprobs(self, entries: tuple[TokenLogprob, ...] | None) -> list | None:
        """vLLM's `prompt_logprobs` list from the worker's entries (one per prompt token after the first)."""
        if entries is None:
            return None
        out: list = [None]
        for e in entries:
            ranked = {t: (rank, v) for rank, (t, v) in enumerate(e.top, 1)}
            position = {e.token_id: ranked.get(e.token_id, (None, e.logprob))}
            position.update(ranked)
            out.append({
                str(t): PromptLogprob(logprob=self.logprob_value(v), rank=rank, decoded_token=self.token_text(t)[0])
                for t, (rank, v) in position.items()
            })
        return out

    def check_common(self, request) -> None:
        """Model name, unknown and unsupported parameters, n, logit_bias ids, stream_options; in that order."""
        self.models.check(request.model)
        err = request.unsupported()
        if err is not None:
            raise err
        if request.prompt_logprobs is not None and request.stream:
            raise invalid_request("prompt_logprobs is not supported with stream: true.", "prompt_logprobs",
                                  "invalid_value")
        if request.n > self.max_n:
            raise invalid_request(f"n must be at most {self.max_n}, got {request.n}.", "n", "invalid_value")
        if request.logit_bias:
            self.tokenizer.check_ids(list(request.logit_bias), "logit_bias")
        if request.stream_options is not None and not request.stream:
            raise invalid_request(
                "stream_options is only allowed when stream is true.", "stream_options", "invalid_value"
            )

    def truncated(self, ids: list[int], request) -> list[int]:
        """vLLM's truncate_prompt_tokens: the last k tokens of a prompt (-1: the context's size - 1,
        the most a prompt may have); unchanged when unset."""
        k = request.truncate_prompt_tokens
        if k is None:
            return ids
        k = self.models.max_model_len - 1 if k == -1 else k
        return ids[-k:] if len(ids) > k else ids

    def check_length(
        self, prompt_len: int, max_tokens: int | None, prompt_param: str, tokens_param: str, limit: int | None = None
    ) -> int:
        """The max_tokens to send; 400 when over the context (`limit`, by default the served model's:
        the workers' limit). Without one, 0: "up to the context", which the worker resolves against its
        own window."""
        limit = limit or self.models.max_model_len
        if prompt_len == 0:
            raise invalid_request("The prompt is empty.", prompt_param, "invalid_value")
        if prompt_len >= limit:
            raise context_length_exceeded(
                f"This model's maximum context length is {limit} tokens, but the prompt has {prompt_len} tokens "
                "(at least one token must be left for the completion).",
                prompt_param,
            )
        if max_tokens is None:
            return 0
        if prompt_len + max_tokens > limit:
            raise context_length_exceeded(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
                f"Please reduce the prompt or {tokens_param}.",
                tokens_param,
            )
        return max_tokens

    def sampling(self, request, max_tokens: int, choice: int, constraint: Constraint | None = None) -> SamplingOptions:
        temperature = 1.0 if request.temperature is None else request.temperature
        top_p = 1.0 if request.top_p is None else request.top_p
        if top_p == 0:  # a nucleus of mass 0 keeps only the most likely token: greedy
            temperature, top_p = 0.0, 1.0
        stop = request.stops()
        seed = None if request.seed is None else (request.seed + choice) % _U64
        self.tokenizer.check_ids(request.stop_token_ids, "stop_token_ids")
        logprobs, prompt_logprobs = self.logprob_counts(request)
        if max_tokens and request.min_tokens > max_tokens:  # (max_tokens 0: up to the context, the worker checks)
            raise invalid_request(f"min_tokens ({request.min_tokens}) must be at most max_tokens ({max_tokens}).",
                                  "min_tokens", "invalid_value")
        return SamplingOptions(
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=max(0, request.top_k),
            seed=seed,
            stop=tuple(s for s in stop if s),
            stop_token_ids=tuple(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            logit_bias=tuple(sorted((request.logit_bias or {}).items())),
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            min_tokens=request.min_tokens,
            repetition_penalty=request.repetition_penalty,
            min_p=request.min_p,
            constraint=constraint,
        )

    # ---- fan-out ------------------------------------------------------------------------------

    def fan_out(
        self,
        response_id: str,
        request,
        prompts: list[list[int]],
        max_tokens: list[int],
        constraint: Constraint | None = None,
        caller: Eligibility | None = None,
    ) -> list[GenerationRequest]:
        """One engine request per (prompt, choice); choice index = prompt index * n + i. `caller`
        says whether the rows may be captured for training (None: a caller of this class that
        decided nothing, e.g. a test: not captured)."""
        caller = caller if caller is not None else Eligibility(False, "undecided")
        out = []
        for p, ids in enumerate(prompts):
            for i in range(request.n):
                index = p * request.n + i
                out.append(
                    GenerationRequest(
                        f"{response_id}-{index}",
                        ids,
                        self.sampling(request, max_tokens[p], index, constraint),
                        request.speculative,
                        request.workload,
                        capture=caller.eligible,
                        key_id=caller.key_id,
                        no_memory=not caller.may_remember,
                    )
                )
        return out

    # ---- the answer ---------------------------------------------------------------------------

    async def respond(
        self,
        request,
        response_cls: type,
        response_id: str,
        requests: list[GenerationRequest],
        prompt_tokens: int,
        arrival: float,
        *,
        choice: Callable[[int, ChoiceState], Any],
        delta_choice: Callable[[int, TokenDelta], Any],
        finish_choice: Callable[[int, str], Any],
        role_choice: Callable[[int], Any] | None = None,
        chunk_cls: type | None = None,
        constraint_param: str | None = None,
    ):
        """Run `requests` (one per choice) and answer with a `response_cls` whose choices are
        `choice(index, state)`, or (stream=True) an iterator of SSE lines of `chunk_cls` chunks
        (default: `response_cls`; see `relay`) whose first event has already arrived: errors before
        any output raise `OpenAIError` here, not inside the stream. `delta_choice` and `finish_choice`
        may give a list of choices (one chunk each) or None (no chunk); `constraint_param` names the
        parameter a worker's refusal of the output constraint is about (see `to_openai_error`)."""
        created = int(time.time())
        if request.stream:
            events = merged(self.engine, requests)
            first = await self.prime(events, constraint_param)
            served = self.served_fingerprint()
            self.first_token(arrival)
            include_usage = bool(request.stream_options and request.stream_options.include_usage)

            def chunk(
                choices: list, usage: UsageInfo | None = None, speculation: SpeculationStats | None = None
            ) -> str:
                cls = chunk_cls or response_cls
                body = self.response(cls, response_id, created, choices, usage, speculation, served).model_dump()
                if not include_usage:
                    body.pop("usage")
                if speculation is None:
                    body.pop("speculation")
                return sse(body)

            return self.relay(
                response_id,
                first,
                events,
                len(requests),
                prompt_tokens,
                include_usage,
                chunk,
                delta_choice,
                finish_choice,
                role_choice,
                request.include_stop_str_in_output,
            )
        states = await self.collect(requests, constraint_param, request.include_stop_str_in_output)
        usage, speculation = self.totals(response_id, prompt_tokens, [s.final for s in states])
        choices = [choice(i, s) for i, s in enumerate(states)]
        return self.response(response_cls, response_id, created, choices, usage, speculation)

    def response(
        self,
        response_cls: type,
        response_id: str,
        created: int,
        choices: list,
        usage: UsageInfo | None,
        speculation: SpeculationStats | None,
        served: str | None = None,
    ):
        """One response (or stream chunk) object; the stats become its `speculation` field and its
        `system_fingerprint` here (without stats, `served`: the workers' current draft)."""
        return response_cls(
            id=response_id,
            created=created,
            model=self.models.name,
            choices=choices,
            usage=usage,
            system_fingerprint=served
            if speculation is None
            else fingerprint(speculation.drafter, speculation.draft_version),
            speculation=None if speculation is None else SpeculationInfo(speculation),
        )

    def served_fingerprint(self) -> str:
        """The fingerprint of what the healthy workers serve now (distinct drafters and versions joined)."""
        workers = [w for w in self.engine.workers() if w.healthy] or self.engine.workers()
        drafters = ",".join(sorted({w.drafter for w in workers if w.drafter}))
        versions = ",".join(sorted({w.draft_version for w in workers if w.draft_version}))
        return fingerprint(drafters, versions)

    async def prime(
        self, events: AsyncIterator[tuple[int, Event]], constraint_param: str | None = None
    ) -> tuple[int, Event]:
        """The first event, so that failures before any output (no worker, invalid request) become
        a proper HTTP status instead of an error inside a 200 stream."""
        try:
            return await anext(events)
        except EngineError as err:
            await events.aclose()
            raise to_openai_error(err, constraint_param) from None
        except BaseException:
            await events.aclose()
            raise

    async def collect(
        self, requests: list[GenerationRequest], constraint_param: str | None = None, include_stop: bool = False
    ) -> list[ChoiceState]:
        """Run every choice to the end (non-streaming); `include_stop`: the matched stop string ends
        the text (vLLM's include_stop_str_in_output)."""
        states = [ChoiceState() for _ in requests]
        try:
            async with contextlib.aclosing(merged(self.engine, requests)) as events:
                async for index, event in events:
                    if isinstance(event, TokenDelta):
                        state = states[index]
                        state.text += event.text
                        state.logprobs.extend(event.logprobs)
                        if event.prompt_logprobs is not None:
                            state.prompt_logprobs = event.prompt_logprobs
                    else:
                        states[index].final = event
                        if include_stop and event.stop_string:
                            states[index].text += event.stop_string
        except EngineError as err:
            raise to_openai_error(err, constraint_param) from None
        return states

    # ---- accounting ---------------------------------------------------------------------------

    def totals(
        self, response_id: str, prompt_tokens: int, finals: list[GenerationFinal]
    ) -> tuple[UsageInfo, SpeculationStats]:
        """Usage and speculation over a finished response's choices; counted and logged (`record`)."""
        completion = sum(f.completion_tokens for f in finals)
        # `prompt_tokens` counts each prompt once and a prompt's n choices ran as n sequences, each
        # with its own cache hit: scale the choices' cached tokens to the prompts' count (with one
        # choice a prompt, their sum; with n, the mean over each prompt's choices).
        fed = sum(f.prompt_tokens for f in finals)
        cached = sum(f.cached_prompt_tokens for f in finals) * prompt_tokens // fed if fed else 0
        usage = UsageInfo(
            prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )
        speculation = aggregate_speculation([f.speculation for f in finals])
        self.record(response_id, usage, speculation, finals)
        return usage, speculation

    def record(
        self, response_id: str, usage: UsageInfo, speculation: SpeculationStats, finals: list[GenerationFinal]
    ) -> None:
        """Count a finished response in the metrics and log one line about it."""
        log.info(
            "completion",
            extra={
                "request_id": response_id,
                "endpoint": self.endpoint,
                "choices": len(finals),
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "finish_reasons": [f.finish_reason for f in finals],
                "workers": sorted({f.worker for f in finals}),
                "accept_length": round(speculation.accept_length, 3),
                "draft_version": speculation.draft_version,
            },
        )
        self.metrics.prompt_tokens.labels(self.endpoint).inc(usage.prompt_tokens)
        self.metrics.completion_tokens.labels(self.endpoint).inc(usage.completion_tokens)
        self.metrics.draft_tokens.inc(speculation.draft_tokens)
        self.metrics.accepted_tokens.inc(speculation.accepted_tokens)

    def first_token(self, arrival: float) -> None:
        self.metrics.ttft.labels(self.endpoint).observe(time.perf_counter() - arrival)

    async def relay(
        self,
        response_id: str,
        first: tuple[int, Event],
        events: AsyncIterator[tuple[int, Event]],
        n_choices: int,
        prompt_tokens: int,
        include_usage: bool,
        chunk: Callable[..., str],
        delta_choice: Callable[[int, TokenDelta], Any],
        finish_choice: Callable[[int, str], Any],
        role_choice: Callable[[int], Any] | None = None,
        include_stop: bool = False,
    ) -> AsyncIterator[str]:
        """The SSE lines of a stream: a `role_choice` chunk per choice (when given), text deltas (with
        `include_stop`, the matched stop string as a last one), one finish chunk per choice, the usage
        chunk when asked, [DONE]; or an error event (and no [DONE]) if anything fails.
        `chunk(choices, usage=None, speculation=None)` renders one chunk of the endpoint's type."""
        finals: dict[int, GenerationFinal] = {}
        try:
            if role_choice is not None:
                for i in range(n_choices):
                    yield chunk([role_choice(i)])
            pending = [first]
            while len(finals) < n_choices:
                index, event = pending.pop() if pending else await anext(events)
                if isinstance(event, TokenDelta):
                    if event.text or event.logprobs or event.prompt_logprobs:
                        for choice in _choices(delta_choice(index, event)):
                            yield chunk([choice])
                    continue
                finals[index] = event
                if include_stop and event.stop_string:
                    for choice in _choices(delta_choice(index, TokenDelta((), event.stop_string))):
                        yield chunk([choice])
                *before, last = _choices(finish_choice(index, event.finish_reason))
                for choice in before:
                    yield chunk([choice])
                if len(finals) < n_choices:
                    yield chunk([last])
                    continue
                usage, speculation = self.totals(response_id, prompt_tokens, list(finals.values()))
                if include_usage:
                    yield chunk([last])
                    yield chunk([], usage=usage, speculation=speculation)
                else:
                    yield chunk([last], speculation=speculation)
            yield sse("[DONE]")
        except Exception as err:
            yield self.stream_error(err, response_id)
        finally:
            await events.aclose()

    def stream_error(self, err: Exception, request_id: str) -> str:
        """The SSE error event for a failure after the stream started (no [DONE] follows it)."""
        if isinstance(err, EngineError):
            oe = to_openai_error(err)
        elif isinstance(err, OpenAIError):
            oe = err
        else:
            log.error("stream failed", exc_info=err, extra={"request_id": request_id})
            oe = internal_error()
        log.warning(
            "stream ended with an error", extra={"request_id": request_id, "status": oe.status, "reason": oe.message}
        )
        self.metrics.error(self.endpoint, oe)
        return sse(oe.body())

"""What the serving layer needs from the inference fleet (`EngineClient`), and its gRPC implementation.

The serving layer sees plain dataclasses (`GenerationRequest` in; `TokenDelta`s then one
`GenerationFinal` out, or an `EngineError`), never protobuf. `GrpcEngineClient` sends each request
to the least-loaded healthy worker of its `WorkerPool` and:
- retries on another worker while nothing has been yielded yet (connection refused, worker
  overloaded or shutting down), so a dead worker costs a retry, not an error;
- once tokens were yielded, a failure is `EngineError(LOST)`: the client must see an error,
  never a normal end;
- when the consumer stops early (client disconnect: the task is cancelled or the generator
  closed), cancels the gRPC stream and sends `Cancel(request_id)` to the worker.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from services.gateway.worker_pool import Worker, WorkerInfo, WorkerPool
from tide.proto.tide.v1 import common_pb2, inference_pb2
from tide.speculation import SpeculationStats, stats_from_pb

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # uint64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives per generated token's logprob; None = off
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (echo); None = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) pairs
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    min_tokens: int = 0  # EOS and stop_token_ids masked while the output is shorter
    repetition_penalty: float = 1.0  # > 0; 1 = off
    min_p: float = 0.0  # [0, 1]; 0 = off
    constraint: Constraint | None = None  # the language the output must belong to; None = any text


@dataclass(frozen=True)
class Constraint:
    """tide.v1.SamplingParams.constraint: `kind` names the oneof field ("json_object", "json_schema",
    "regex", "grammar"), `value` its text (a JSON Schema as JSON text, ...; unused for json_object)."""

    kind: str
    value: str = ""


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    speculative: bool | None = None  # None = the worker's policy decides
    workload: str = ""
    capture: bool = False  # may be captured for training (services/gateway/governance.py)
    key_id: str = ""  # the caller's API key id, recorded with captured rows
    no_memory: bool = False  # not added to the workers' speculation memory (`store: false`, a no-train key)


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of `token_id` given its prefix, and the `top` (token id, logprob)
    pairs there, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenDelta:
    """New tokens and text. `logprobs`: entries of the tokens whose text is out (they follow the text,
    not `token_ids`; see tide.v1.TokenChunk); `prompt_logprobs`: prompt tokens 1..n-1, first delta only."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class GenerationFinal:
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    time_to_first_token_ms: float = 0.0
    total_ms: float = 0.0
    worker: str = ""
    cached_prompt_tokens: int = 0  # of prompt_tokens, served by the worker's prefix cache
    stop_string: str | None = None  # the stop string that ended the output (not in its text)


class ErrorKind(enum.Enum):
    INVALID = "invalid"  # the worker refused the request (HTTP 400)
    CONTEXT_LENGTH = "context_length"  # prompt + max_tokens over the window (HTTP 400)
    OVERLOADED = "overloaded"  # every worker tried was full (HTTP 503)
    UNAVAILABLE = "unavailable"  # no healthy worker could take it (HTTP 503)
    CANCELLED = "cancelled"  # the worker cancelled it (HTTP 503)
    INTERNAL = "internal"  # a worker bug (HTTP 500)
    LOST = "lost"  # the worker died or failed after output started (HTTP 502 / SSE error)


RETRYABLE = frozenset({ErrorKind.OVERLOADED, ErrorKind.UNAVAILABLE, ErrorKind.CANCELLED})


class EngineError(Exception):
    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class EngineClient(abc.ABC):
    """The inference fleet as the serving layer sees it."""

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Called once the event loop runs (app start-up)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Called at app shutdown."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta | GenerationFinal]:
        """Token deltas, then exactly one `GenerationFinal`; raises `EngineError` on failure."""

    @abc.abstractmethod
    def is_ready(self) -> bool:
        """True when at least one worker can serve."""

    @abc.abstractmethod
    def workers(self) -> list[WorkerInfo]:
        """A snapshot of the workers, for /ready and metrics."""

    def max_model_len(self) -> int | None:
        """The context the workers serve (prompt + completion tokens), None when unknown."""
        return None


_ERROR_KINDS = {
    common_pb2.ERROR_CODE_INVALID_ARGUMENT: ErrorKind.INVALID,
    common_pb2.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED: ErrorKind.CONTEXT_LENGTH,
    common_pb2.ERROR_CODE_OVERLOADED: ErrorKind.OVERLOADED,
    common_pb2.ERROR_CODE_CANCELLED: ErrorKind.CANCELLED,
    common_pb2.ERROR_CODE_UNAVAILABLE: ErrorKind.UNAVAILABLE,
}
_STATUS_KINDS = {
    grpc.StatusCode.UNAVAILABLE: ErrorKind.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorKind.UNAVAILABLE,
    grpc.StatusCode.CANCELLED: ErrorKind.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorKind.OVERLOADED,
    grpc.StatusCode.INVALID_ARGUMENT: ErrorKind.INVALID,
    grpc.StatusCode.OUT_OF_RANGE: ErrorKind.CONTEXT_LENGTH,
}
# A worker that refuses a request before streaming ends the call with a status and names the
# tide.v1.ErrorCode in this trailing-metadata entry (e.g. ERROR_CODE_CONTEXT_LENGTH_EXCEEDED).
ERROR_CODE_METADATA = "tide-error-code"
_FINISH = {inference_pb2.FINISH_REASON_STOP: "stop", inference_pb2.FINISH_REASON_LENGTH: "length"}


def rpc_error_kind(rpc: grpc.aio.AioRpcError) -> ErrorKind:
    """What a failed call means: the worker's `tide-error-code` when it sent one, else the status."""
    for key, value in rpc.trailing_metadata() or ():
        if key == ERROR_CODE_METADATA:
            try:
                return _ERROR_KINDS.get(common_pb2.ErrorCode.Value(str(value)), ErrorKind.INTERNAL)
            except ValueError:
                break
    return _STATUS_KINDS.get(rpc.code(), ErrorKind.INTERNAL)


def to_proto(request: GenerationRequest) -> inference_pb2.GenerateRequest:
    s = request.sampling
    sampling = inference_pb2.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
    )
    if s.seed is not None:
        sampling.seed = s.seed
    if s.logprobs is not None:
        sampling.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        sampling.prompt_logprobs = s.prompt_logprobs
    for token, bias in s.logit_bias:
        sampling.logit_bias[token] = bias
    sampling.presence_penalty = s.presence_penalty
    sampling.frequency_penalty = s.frequency_penalty
    sampling.min_tokens = s.min_tokens
    if s.repetition_penalty != 1.0:
        sampling.repetition_penalty = s.repetition_penalty
    sampling.min_p = s.min_p
    if s.constraint is not None:
        kind = s.constraint.kind
        setattr(sampling, kind, True if kind == "json_object" else s.constraint.value)
    msg = inference_pb2.GenerateRequest(
        request_id=request.request_id,
        sampling=sampling,
        workload=request.workload,
        prompt_token_ids=inference_pb2.TokenIds(ids=request.prompt_token_ids),
        no_capture=not request.capture,
        key_id=request.key_id,
        no_memory=request.no_memory,
    )
    if request.speculative is not None:
        msg.speculative = request.speculative
    return msg


def from_logprobs(entries) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(e.token_id, e.logprob, tuple((t.token_id, t.logprob) for t in e.top)) for e in entries)


def from_chunk(chunk: inference_pb2.TokenChunk) -> TokenDelta:
    prompt = from_logprobs(chunk.prompt_logprobs) if chunk.prompt_logprobs else None
    return TokenDelta(tuple(chunk.token_ids), chunk.text, from_logprobs(chunk.logprobs), prompt)


def from_final(final: inference_pb2.GenerateFinal, worker: str) -> GenerationFinal:
    return GenerationFinal(
        _FINISH[final.finish_reason],
        final.prompt_tokens,
        final.completion_tokens,
        stats_from_pb(final.speculation),
        final.time_to_first_token_ms,
        final.total_ms,
        worker,
        final.cached_prompt_tokens,
        final.stop_string if final.WhichOneof("matched_stop") == "stop_string" else None,
    )


class _Retry(Exception):
    def __init__(self, error: EngineError) -> None:
        self.error = error


class GrpcEngineClient(EngineClient):
    """`EngineClient` over the workers' `InferenceService` (see module docstring)."""

    def __init__(self, pool: WorkerPool, cancel_timeout_s: float = 2.0) -> None:
        self.pool = pool
        self.cancel_timeout_s = cancel_timeout_s

    @classmethod
    def from_addresses(
        cls, addresses: tuple[str, ...], poll_interval_s: float = 1.0, status_timeout_s: float = 5.0,
        wait_for_worker_s: float = 0.0,
    ) -> GrpcEngineClient:
        return cls(WorkerPool(addresses, poll_interval_s, status_timeout_s, wait_for_worker_s=wait_for_worker_s))

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()

    def is_ready(self) -> bool:
        return self.pool.ready()

    def workers(self) -> list[WorkerInfo]:
        return self.pool.infos()

    def max_model_len(self) -> int | None:
        return self.pool.max_model_len()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta | GenerationFinal]:
        tried: set[str] = set()
        last: EngineError | None = None
        while True:
            worker = self.pool.pick(tried)
            if worker is None and not tried:  # nothing looks healthy: wait for a worker (e.g. one restarting)
                worker = await self.pool.pick_or_wait(tried)
            if worker is None:
                raise last or EngineError(ErrorKind.UNAVAILABLE, "No healthy inference worker is available.")
            tried.add(worker.address)
            try:
                async with contextlib.aclosing(self._attempt(worker, request)) as events:
                    async for event in events:
                        yield event
                return
            except _Retry as retry:
                log.warning(
                    "retrying on another worker",
                    extra={"request_id": request.request_id, "worker": worker.address, "reason": retry.error.message},
                )
                last = retry.error

    async def _attempt(self, worker: Worker, request: GenerationRequest) -> AsyncIterator[TokenDelta | GenerationFinal]:
        """One try on one worker. Raises `_Retry` only while nothing has been yielded."""
        call = worker.stub.Generate(to_proto(request))
        worker.inflight += 1
        started = done = False
        try:
            async for msg in call:
                kind = msg.WhichOneof("payload")
                if kind == "chunk":
                    started = True
                    yield from_chunk(msg.chunk)
                elif kind == "final":
                    done = True
                    if msg.final.finish_reason not in _FINISH:
                        raise EngineError(ErrorKind.CANCELLED, "The worker cancelled the generation.")
                    yield from_final(msg.final, worker.address)
                    return
                elif kind == "error":
                    done = True
                    err = EngineError(_ERROR_KINDS.get(msg.error.code, ErrorKind.INTERNAL), msg.error.message)
                    if not started and err.kind in RETRYABLE:
                        raise _Retry(err)
                    raise err if not started else EngineError(ErrorKind.LOST, err.message)
            done = True
            err = EngineError(ErrorKind.LOST, f"Worker {worker.address} ended the stream without a result.")
            raise _Retry(err) if not started else err
        except grpc.aio.AioRpcError as rpc:
            done = True
            kind = rpc_error_kind(rpc)
            detail = f"Worker {worker.address} failed: {rpc.code().name}"
            if kind in (ErrorKind.UNAVAILABLE, ErrorKind.CANCELLED):
                self.pool.mark_down(worker, detail)
            if started:
                raise EngineError(ErrorKind.LOST, f"{detail} during generation.") from None
            if kind in RETRYABLE:
                raise _Retry(EngineError(kind, detail)) from None
            raise EngineError(kind, rpc.details() or detail) from None
        finally:
            worker.inflight -= 1
            if not done:  # the consumer went away (client disconnect): stop the work upstream
                call.cancel()
                self.pool.spawn(self._cancel(worker, request.request_id))

    async def _cancel(self, worker: Worker, request_id: str) -> None:
        try:
            await worker.stub.Cancel(inference_pb2.CancelRequest(request_id=request_id), timeout=self.cancel_timeout_s)
            log.info("cancelled upstream", extra={"request_id": request_id, "worker": worker.address})
        except grpc.aio.AioRpcError as err:
            log.warning(
                "upstream cancel failed",
                extra={"request_id": request_id, "worker": worker.address, "reason": err.code().name},
            )

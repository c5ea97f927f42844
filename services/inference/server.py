"""gRPC InferenceService: translates tide.v1 protobuf <-> the worker's domain types.

Refusals before a stream starts end the call with a status: INVALID_ARGUMENT (bad input; also a
prompt + max_tokens over the context), ALREADY_EXISTS (request id in use), RESOURCE_EXHAUSTED
(worker full), UNAVAILABLE (shutting down); the trailing metadata `tide-error-code` then carries
the tide.v1.ErrorCode name (e.g. ERROR_CODE_CONTEXT_LENGTH_EXCEEDED) for the gateway's mapping.
Once accepted, a Generate stream carries chunks and ends with one `final` or one `error`. A client
that goes away cancels its request in the engine. ApplyDecision is an admin method: tide.grpcutil
enforces the bearer token declared in the proto. A worker's status also says which registry draft it
serves, which one the registry wants, and the versions it refused (drafts.py).
"""

from __future__ import annotations

import dataclasses
import logging
import queue

import grpc

from services.inference.control import Outcome, WorkerStatus
from services.inference.drafts import DraftsReport, DraftWatcher, Refusal
from services.inference.live import LiveSnapshot, LiveStats
from services.inference.requests import (
    ErrorEvent,
    ErrorKind,
    FinalEvent,
    GenerationRequest,
    RequestRejected,
    TokenEvent,
)
from services.inference.worker import Worker
from tide.decisions import DecisionError, decision_from_pb, policy_pb, schedule_pb
from tide.engine.sequence import FinishReason, GrammarKind, GrammarSpec
from tide.grpcutil import GrpcServer
from tide.proto.tide.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tide.speculation import stats_pb

log = logging.getLogger(__name__)

SERVICE_NAME = "tide.v1.InferenceService"
ERROR_CODE_METADATA = "tide-error-code"

_STATUS = {
    ErrorKind.INVALID_ARGUMENT: (grpc.StatusCode.INVALID_ARGUMENT, common_pb2.ERROR_CODE_INVALID_ARGUMENT),
    ErrorKind.CONTEXT_LENGTH_EXCEEDED: (grpc.StatusCode.INVALID_ARGUMENT,
                                        common_pb2.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED),
    ErrorKind.DUPLICATE_ID: (grpc.StatusCode.ALREADY_EXISTS, common_pb2.ERROR_CODE_INVALID_ARGUMENT),
    ErrorKind.OVERLOADED: (grpc.StatusCode.RESOURCE_EXHAUSTED, common_pb2.ERROR_CODE_OVERLOADED),
    ErrorKind.UNAVAILABLE: (grpc.StatusCode.UNAVAILABLE, common_pb2.ERROR_CODE_UNAVAILABLE),
    ErrorKind.INTERNAL: (grpc.StatusCode.INTERNAL, common_pb2.ERROR_CODE_INTERNAL),
}
_FINISH = {
    FinishReason.STOP: inference_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: inference_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: inference_pb2.FINISH_REASON_CANCELLED,
}
_OUTCOME = {
    Outcome.APPLIED: inference_pb2.ApplyDecisionResponse.OUTCOME_APPLIED,
    Outcome.ALREADY_APPLIED: inference_pb2.ApplyDecisionResponse.OUTCOME_ALREADY_APPLIED,
    Outcome.REJECTED: inference_pb2.ApplyDecisionResponse.OUTCOME_REJECTED,
}


# ---------------------------------------------------------------------------------- conversions


def _grammar(s: inference_pb2.SamplingParams) -> GrammarSpec | None:
    """SamplingParams.constraint (a oneof whose field names are GrammarKind values) as a spec."""
    which = s.WhichOneof("constraint")
    if which is None:
        return None
    kind = GrammarKind(which)
    return GrammarSpec(kind, "" if kind is GrammarKind.JSON_OBJECT else getattr(s, which))


def generation_request(r: inference_pb2.GenerateRequest) -> GenerationRequest:
    s = r.sampling
    which = r.WhichOneof("prompt")
    return GenerationRequest(
        request_id=r.request_id,
        prompt_ids=tuple(r.prompt_token_ids.ids) if which == "prompt_token_ids" else None,
        prompt_text=r.prompt_text if which == "prompt_text" else None,
        max_tokens=s.max_tokens,
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        speculative=r.speculative if r.HasField("speculative") else None,
        workload=r.workload,
        capture=not r.no_capture,
        key_id=r.key_id,
        no_memory=r.no_memory,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        min_tokens=s.min_tokens,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        min_p=s.min_p,
        grammar=_grammar(s),
    )


def logprobs_pb(entries) -> list[inference_pb2.TokenLogprob]:
    """tide.engine.sequence.TokenLogprob entries as protobuf messages."""
    return [inference_pb2.TokenLogprob(token_id=e.token_id, logprob=e.logprob,
                                       top=[inference_pb2.TopLogprob(token_id=t, logprob=v) for t, v in e.top])
            for e in entries]


def final_pb(e: FinalEvent) -> inference_pb2.GenerateFinal:
    out = inference_pb2.GenerateFinal(
        finish_reason=_FINISH.get(e.finish_reason, inference_pb2.FINISH_REASON_UNSPECIFIED),
        prompt_tokens=e.prompt_tokens, completion_tokens=e.completion_tokens,
        speculation=stats_pb(e.speculation),
        time_to_first_token_ms=e.time_to_first_token_ms, total_ms=e.total_ms,
        cached_prompt_tokens=e.cached_prompt_tokens)
    if e.stop_string is not None:
        out.stop_string = e.stop_string
    elif e.stop_token_id is not None:
        out.stop_token_id = e.stop_token_id
    return out


def refusal_pb(r: Refusal) -> inference_pb2.DraftRefusal:
    return inference_pb2.DraftRefusal(version=r.version, reason=r.reason, detail=r.detail, time_unix_s=r.at_unix_s)


def status_pb(s: WorkerStatus, drafts: DraftsReport | None = None) -> inference_pb2.WorkerStatus:
    """The worker's status; with `drafts`, also what it serves of the registry and what it refused."""
    out = inference_pb2.WorkerStatus(
        worker_id=s.worker_id, model_id=s.model_id, engine=s.engine, device=s.device,
        running_requests=s.running_requests, waiting_requests=s.waiting_requests, max_batch_size=s.max_batch_size,
        load=s.load, kv_cache_usage=s.kv_cache_usage, draft_version=s.draft_version, drafter=s.drafter,
        gamma_policy=policy_pb(s.policy),
        speculation=schedule_pb(s.speculation), collection_enabled=s.collection_enabled,
        last_decision_id=s.last_decision_id, uptime_s=s.uptime_s)
    if drafts is not None:
        out.registry_draft_version, out.wanted_draft_version = drafts.version, drafts.wanted
        out.draft_refusals.extend(refusal_pb(r) for r in drafts.refusals)
    return out


def live_pb(s: LiveSnapshot) -> inference_pb2.WorkerLive:
    """What the engine did lately (live.py): tokens/s, acceptance per draft version, γ per batch bucket."""
    return inference_pb2.WorkerLive(
        tokens_per_s=s.tokens_per_s, window_s=s.window_s, tokens_total=s.tokens_total, steps_total=s.steps_total,
        drafts=[inference_pb2.DraftAcceptance(draft_version=version, drafter=v.drafter, verify_rows=v.verify_rows,
                                              draft_tokens=v.draft_tokens, accepted_tokens=v.accepted_tokens,
                                              last_unix_s=v.last_unix_s) for version, v in s.drafts.items()],
        gamma=[inference_pb2.GammaBucket(min_batch=lo, max_batch=hi, steps=b.steps,
                                         speculative_steps=b.speculative_steps, gamma_sum=b.gamma_sum,
                                         speculative_rows=b.speculative_rows, last_gamma=b.last_gamma)
               for (lo, hi), b in s.gamma.items()])


# ------------------------------------------------------------------------------------ servicer


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    """`poll_s`: how often a waiting stream checks that its client is still there (seconds).
    `stream_interval_s`: after sending a chunk, a stream lets the tokens of the next `stream_interval_s`
    seconds queue up and sends them as one chunk (0: every step's tokens at once). The first token
    and a request's end are never held back. On a CPU the engine fills every core, and each message costs
    a few wake-ups in this process, the gateway and the client (docs/results/engine-step, 2h).
    `drafts`: the worker's registry drafts (their version and refusals go into its status)."""

    def __init__(self, worker: Worker, poll_s: float = 0.5, decision_timeout_s: float = 30.0,
                 drafts: DraftWatcher | None = None, live: LiveStats | None = None,
                 stream_interval_s: float = 0.0) -> None:
        self.worker, self.poll_s, self.decision_timeout_s = worker, poll_s, decision_timeout_s
        self.drafts, self.live, self.stream_interval_s = drafts, live, stream_interval_s

    def _status(self, status: WorkerStatus) -> inference_pb2.WorkerStatus:
        """The status message; `max_model_len` is this worker's context (the gateway serves the smallest)."""
        out = status_pb(status, self.drafts.report() if self.drafts is not None else None)
        out.max_model_len = self.worker.engine.config.max_seq_len
        mem = self.worker.memory()
        out.memory.CopyFrom(inference_pb2.WorkerMemory(**dataclasses.asdict(mem)))
        if self.live is not None:
            out.live.CopyFrom(live_pb(self.live.snapshot()))
        return out

    def Generate(self, request, context):
        try:
            handle = self.worker.submit(generation_request(request))
        except RequestRejected as e:
            status, code = _STATUS[e.kind]
            context.set_trailing_metadata(((ERROR_CODE_METADATA, common_pb2.ErrorCode.Name(code)),))
            context.abort(status, e.message)
        context.add_callback(lambda: None if handle.done else self.worker.cancel_handle(handle))
        rid = request.request_id
        while True:
            try:
                event = handle.events.get(timeout=self.poll_s)
            except queue.Empty:
                if not context.is_active():
                    self.worker.cancel_handle(handle)
                    return
                continue
            tokens, text, logprobs, prompt_logprobs = [], [], [], []
            while isinstance(event, TokenEvent):  # coalesce what queued up while we were sending
                tokens.extend(event.token_ids)
                text.append(event.text)
                logprobs.extend(event.logprobs)
                prompt_logprobs.extend(event.prompt_logprobs or ())
                try:
                    event = handle.events.get_nowait()
                except queue.Empty:
                    event = None
            if tokens or text:
                yield inference_pb2.GenerateResponse(request_id=rid, chunk=inference_pb2.TokenChunk(
                    token_ids=tokens, text="".join(text), logprobs=logprobs_pb(logprobs),
                    prompt_logprobs=logprobs_pb(prompt_logprobs)))
                if event is None and self.stream_interval_s > 0:
                    # tokens queue up meanwhile without waking this thread; the end wakes it at once
                    handle.ended.wait(self.stream_interval_s)
            if isinstance(event, FinalEvent):
                yield inference_pb2.GenerateResponse(request_id=rid, final=final_pb(event))
                return
            if isinstance(event, ErrorEvent):
                code = _STATUS[event.kind][1]
                yield inference_pb2.GenerateResponse(request_id=rid, error=common_pb2.Error(code=code,
                                                                                           message=event.message))
                return

    def Cancel(self, request, context):
        return inference_pb2.CancelResponse(found=self.worker.cancel(request.request_id))

    def GetStatus(self, request, context):
        return self._status(self.worker.status())

    def ApplyDecision(self, request, context):
        try:
            d = decision_from_pb(request)
        except DecisionError as e:
            return inference_pb2.ApplyDecisionResponse(
                outcome=_OUTCOME[Outcome.REJECTED], detail=str(e), status=self._status(self.worker.status()))
        try:
            result = self.worker.apply_decision(d, timeout_s=self.decision_timeout_s)
        except TimeoutError:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker did not reach a step boundary in time; retry")
        return inference_pb2.ApplyDecisionResponse(outcome=_OUTCOME[result.outcome], detail=result.detail,
                                                   status=self._status(result.status))


def serve(worker: Worker, address: str, admin_token: str | None, max_workers: int = 64,
          drafts: DraftWatcher | None = None, live: LiveStats | None = None,
          stream_interval_s: float = 0.0) -> GrpcServer:
    """Start the gRPC server (health SERVING from here on: call once the model is loaded)."""
    server = GrpcServer(address, admin_token=admin_token, max_workers=max_workers)
    server.add_service(inference_pb2_grpc.add_InferenceServiceServicer_to_server,
                       InferenceServicer(worker, drafts=drafts, live=live, stream_interval_s=stream_interval_s),
                       SERVICE_NAME)
    server.start()
    log.info("inference service listening on %s", server.target)
    return server

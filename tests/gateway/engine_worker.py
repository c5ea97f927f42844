"""A real `InferenceService` on a real socket, driving the real engine: the gateway tests' backend.

Test support only, until `services/inference/server.py` lands (then the tests switch to it). Runs as
its own process so that tests can kill it (`kill -9`) mid-stream like a crashed worker:

    python tests/gateway/engine_worker.py --target DIR [--port 0] [--step-delay-ms 0]

prints `PORT <n>` once it serves. One engine thread steps `LLMEngine` (n-gram drafter, γ = 3)
and hands each request's outputs to its Generate stream through a queue; Cancel and a client
that goes away both cancel the request in the engine. `--step-delay-ms` slows every step down so
that tests can act while a generation is still running.
"""

from __future__ import annotations

import argparse
import queue
import threading
import time

import torch
from transformers import AutoTokenizer

from services.inference.engine.drafters import NgramDrafter
from services.inference.engine.engine import EngineConfig, LLMEngine
from services.inference.engine.llama import LlamaModel
from services.inference.engine.sequence import FinishReason, SamplingParams
from tide.grpcutil import GrpcServer
from tide.policies import FixedGamma
from tide.proto.tide.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tide.target import resolve_target

_FINISH = {FinishReason.STOP: inference_pb2.FINISH_REASON_STOP, FinishReason.LENGTH: inference_pb2.FINISH_REASON_LENGTH}


def _error(rid: str, code: int, message: str) -> inference_pb2.GenerateResponse:
    return inference_pb2.GenerateResponse(request_id=rid, error=common_pb2.Error(code=code, message=message))


class EngineServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, engine: LLMEngine, model_id: str, step_delay_s: float = 0.0) -> None:
        self.engine = engine
        self.model_id = model_id
        self.step_delay_s = step_delay_s
        self.cond = threading.Condition()
        self.adds: list[tuple] = []
        self.cancels: list[str] = []
        self.streams: dict[str, queue.Queue] = {}
        self.started = time.monotonic()
        threading.Thread(target=self._loop, name="engine", daemon=True).start()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.adds and not self.cancels and not self.engine.has_work():
                    self.cond.wait()
                adds, self.adds = self.adds, []
                cancels, self.cancels = self.cancels, []
            for rid, prompt, params, speculative, workload in adds:
                try:
                    self.engine.add_request(rid, prompt, params, speculative, workload)
                except ValueError as err:
                    self._put(rid, ("error", str(err)))
            for rid in cancels:
                if self.engine.cancel(rid):
                    self._put(rid, ("cancelled",))
            if self.engine.has_work():
                for out in self.engine.step():
                    self._put(out.request_id, ("out", out))
                if self.step_delay_s:
                    time.sleep(self.step_delay_s)

    def _put(self, rid: str, item) -> None:
        q = self.streams.get(rid)
        if q is not None:
            q.put(item)

    def _cancel(self, rid: str) -> None:
        with self.cond:
            self.cancels.append(rid)
            self.cond.notify()

    def Generate(self, request, context):
        rid = request.request_id
        if request.WhichOneof("prompt") == "prompt_text":
            prompt = self.engine.tokenizer(request.prompt_text)["input_ids"]
        else:
            prompt = list(request.prompt_token_ids.ids)
        sp, limit = request.sampling, self.engine.config.max_seq_len
        if len(prompt) + max(1, sp.max_tokens) > limit:
            yield _error(rid, common_pb2.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED, f"over the context of {limit} tokens")
            return
        try:
            params = SamplingParams(
                max_tokens=sp.max_tokens or limit - len(prompt),
                temperature=sp.temperature if sp.HasField("temperature") else 1.0,
                top_p=sp.top_p if sp.HasField("top_p") else 1.0,
                top_k=sp.top_k,
                seed=sp.seed if sp.HasField("seed") else None,
                stop=tuple(sp.stop),
                stop_token_ids=tuple(sp.stop_token_ids),
                ignore_eos=sp.ignore_eos,
            )
        except ValueError as err:
            yield _error(rid, common_pb2.ERROR_CODE_INVALID_ARGUMENT, str(err))
            return
        speculative = request.speculative if request.HasField("speculative") else True
        q: queue.Queue = queue.Queue()
        self.streams[rid] = q
        context.add_callback(lambda: self._cancel(rid))  # the gateway went away
        with self.cond:
            self.adds.append((rid, prompt, params, speculative, request.workload))
            self.cond.notify()
        try:
            yield from self._relay(rid, q, len(prompt), time.monotonic())
        finally:
            self.streams.pop(rid, None)

    def _relay(self, rid, q, prompt_len, t0):
        ttft = 0.0
        while True:
            item = q.get()
            if item[0] == "error":
                yield _error(rid, common_pb2.ERROR_CODE_INVALID_ARGUMENT, item[1])
                return
            if item[0] == "cancelled":
                final = inference_pb2.GenerateFinal(finish_reason=inference_pb2.FINISH_REASON_CANCELLED)
                yield inference_pb2.GenerateResponse(request_id=rid, final=final)
                return
            out = item[1]
            ttft = ttft or (time.monotonic() - t0) * 1e3
            if out.new_token_ids:
                chunk = inference_pb2.TokenChunk(token_ids=out.new_token_ids, text=out.text_delta)
                yield inference_pb2.GenerateResponse(request_id=rid, chunk=chunk)
            if out.finished:
                yield inference_pb2.GenerateResponse(request_id=rid, final=self._final(out, prompt_len, ttft, t0))
                return

    def _final(self, out, prompt_len, ttft, t0) -> inference_pb2.GenerateFinal:
        seq = out.sequence
        spec = seq.draft_tokens > 0
        stats = inference_pb2.SpeculationStats(
            accept_length=seq.accept_length if spec else 0.0,
            draft_tokens=seq.draft_tokens,
            accepted_tokens=seq.accepted_tokens,
            verify_steps=seq.verify_steps if spec else 0,
            plain_steps=0 if spec else seq.verify_steps,
            draft_version=self.engine.drafter.version,
            drafter=self.engine.drafter.algorithm.value,
        )
        return inference_pb2.GenerateFinal(
            finish_reason=_FINISH[out.finish_reason],
            prompt_tokens=prompt_len,
            completion_tokens=seq.num_output,
            speculation=stats,
            time_to_first_token_ms=ttft,
            total_ms=(time.monotonic() - t0) * 1e3,
        )

    def Cancel(self, request, context):
        found = request.request_id in self.streams
        if found:
            self._cancel(request.request_id)
        return inference_pb2.CancelResponse(found=found)

    def GetStatus(self, request, context):
        sched = self.engine.scheduler
        running, waiting, cap = len(sched.active), len(sched.waiting), self.engine.config.max_batch
        return inference_pb2.WorkerStatus(
            worker_id=self.engine.config.worker_id,
            model_id=self.model_id,
            engine="torch",
            device="cpu",
            running_requests=running,
            waiting_requests=waiting,
            max_batch_size=cap,
            load=(running + waiting) / cap,
            draft_version=self.engine.drafter.version,
            drafter=self.engine.drafter.algorithm.value,
            uptime_s=time.monotonic() - self.started,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--step-delay-ms", type=float, default=0.0)
    parser.add_argument("--max-batch", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = resolve_target(args.target)
    model = LlamaModel.load(target, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(target.path))
    config = EngineConfig(
        max_batch=args.max_batch,
        max_seq_len=model.cfg.max_position_embeddings,
        max_tokens_per_step=256,
        prefill_chunk=128,
        worker_id=f"test-{args.port}",
        target_model=target.model_id,
    )
    engine = LLMEngine(model, config, tokenizer=tokenizer, drafter=NgramDrafter(), policy=FixedGamma(3))
    server = GrpcServer(f"127.0.0.1:{args.port}", max_workers=64)
    server.add_service(
        inference_pb2_grpc.add_InferenceServiceServicer_to_server,
        EngineServicer(engine, target.model_id, args.step_delay_ms / 1e3),
        "tide.v1.InferenceService",
    )
    port = server.start()
    print(f"PORT {port}", flush=True)
    server.wait()


if __name__ == "__main__":
    main()

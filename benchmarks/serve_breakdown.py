"""Where a served token's time goes at batch 1, layer by layer (`tide bench engine --serve URL`).

The same prompts (token ids), greedy, `ignore_eos`, the same number of output tokens, no speculation,
one request at a time, decoded four ways:

  engine      an LLMEngine in this process (the same target and dtype), no server around it;
  worker      the stack's inference worker, as it reports itself: (total_ms - ttft_ms) / (n - 1)
              from its GenerateFinal — its engine loop inside the service, sharing the process
              (and the GIL) with the gRPC threads, the exporter and telemetry;
  grpc        the same worker called directly over gRPC (InferenceService.Generate) from here: the
              client sees each TokenChunk arrive;
  gateway     the gateway's /v1/completions, streamed (SSE), through `tide bench serve`'s client.

Per layer the medians over requests of TTFT and TPOT (time per output token after the first, ms).
`serve_breakdown_ms` splits the gateway's TPOT into additive parts:
  engine_step            the engine alone;
  worker_process         worker - engine: what running inside the service costs the engine loop;
  worker_handoff_grpc    grpc - worker: queue hand-off, protobuf, the gRPC stream;
  gateway_sse            gateway - grpc: the gateway (HTTP, JSON, SSE) and the client's parsing;
  total                  the gateway's TPOT as a client sees it.
A part can come out slightly negative when it is below the noise between runs. The engine here and
the worker share the machine's cores: run it on a stack that is otherwise idle (or say it was not).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid

import grpc
import httpx

from benchmarks import serve
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.sequence import SamplingParams
from tide.prompts import Prompt
from tide.proto.tide.v1 import inference_pb2, inference_pb2_grpc


def _summary(ttft_s: list[float], tpot_s: list[float]) -> dict:
    return {"ttft_ms": round(statistics.median(ttft_s) * 1e3, 3), "tpot_ms": round(statistics.median(tpot_s) * 1e3, 3),
            "requests": len(tpot_s)}


def engine_alone(model, prompts: list[list[int]], max_tokens: int) -> dict:
    """Plain decode in this process, one request at a time; client-side times as the servers' clients see them."""
    engine = LLMEngine(model, EngineConfig(max_batch=1, max_seq_len=4096))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate([prompts[0]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    ttft, tpot = [], []
    for ids in prompts:
        t0 = time.perf_counter()
        engine.add_request(uuid.uuid4().hex, ids, params)
        first = last = None
        n = 0
        while engine.has_work():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                if o.new_token_ids:
                    first = now if first is None else first
                    last, n = now, n + len(o.new_token_ids)
        ttft.append(first - t0)
        tpot.append((last - first) / (n - 1))
    return _summary(ttft, tpot)


async def worker_direct(address: str, prompts: list[list[int]], max_tokens: int) -> tuple[dict, dict]:
    """(what the client of the worker's gRPC stream saw, what the worker reported of itself)."""
    ttft, tpot, own_ttft, own_tpot = [], [], [], []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        for i, ids in enumerate([prompts[0], *prompts]):  # the first is a warm-up
            req = inference_pb2.GenerateRequest(
                request_id=f"breakdown-{uuid.uuid4().hex}", speculative=False,
                prompt_token_ids=inference_pb2.TokenIds(ids=ids),
                sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            t0 = time.perf_counter()
            first = last = None
            n = 0
            final = None
            async for msg in stub.Generate(req):
                now = time.perf_counter()
                kind = msg.WhichOneof("payload")
                if kind == "chunk" and msg.chunk.token_ids:
                    first = now if first is None else first
                    last, n = now, n + len(msg.chunk.token_ids)
                elif kind == "final":
                    final = msg.final
                elif kind == "error":
                    raise RuntimeError(f"worker {address}: {msg.error.message}")
            if i == 0:
                continue
            ttft.append(first - t0)
            tpot.append((last - first) / (n - 1))
            own_ttft.append(final.time_to_first_token_ms / 1e3)
            own_tpot.append((final.total_ms - final.time_to_first_token_ms) / 1e3 / (final.completion_tokens - 1))
    return _summary(ttft, tpot), _summary(own_ttft, own_tpot)


async def gateway_sse(base_url: str, model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    target = serve.Target(url=serve.endpoint_url(base_url, "completions"), api="completions", model=model,
                          max_tokens=max_tokens, temperature=0.0,
                          extra_body={"speculative": False, "ignore_eos": True}, headers={}, timeout=300.0)
    ttft, tpot = [], []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        for i, ids in enumerate([prompts[0], *prompts]):  # the first is a warm-up
            # a list of token ids is a valid completions prompt: the same ids as the other layers
            o = await serve.send(client, target, Prompt(text=ids, domain="breakdown", source="breakdown"))  # type: ignore[arg-type]
            if not o.ok:
                raise RuntimeError(f"gateway {base_url}: {o.error}")
            if i:
                ttft.append(o.ttft)
                tpot.append(o.tpot)
    return _summary(ttft, tpot)


def stack_facts(base_url: str) -> dict:
    """The first worker's gRPC address and what the loop is doing, from the gateway's /v1/status."""
    doc = httpx.get(base_url.rstrip("/").removesuffix("/v1") + "/v1/status", timeout=10).json()
    workers = [w for w in doc.get("workers") or [] if w.get("available")]
    if not workers:
        raise RuntimeError(f"{base_url}/v1/status lists no available worker")
    ctl, tr = doc.get("controller") or {}, doc.get("trainer") or {}
    return {"worker": workers[0]["address"], "collection": (ctl.get("collection") or {}).get("enabled"),
            "trainer": tr.get("state"), "model": doc.get("target_model")}


def breakdown(model, base_url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    facts = stack_facts(base_url)
    gateway_model = serve.discover_model(serve.Target(serve.endpoint_url(base_url, "completions"), "completions", "",
                                                      max_tokens, 0.0, {}, {}, 30.0))
    layers = {"engine": engine_alone(model, prompts, max_tokens)}
    layers["grpc"], layers["worker"] = asyncio.run(worker_direct(facts["worker"], prompts, max_tokens))
    layers["gateway"] = asyncio.run(gateway_sse(base_url, gateway_model, prompts, max_tokens))
    tpot = {k: v["tpot_ms"] for k, v in layers.items()}
    parts = {"engine_step": tpot["engine"], "worker_process": tpot["worker"] - tpot["engine"],
             "worker_handoff_grpc": tpot["grpc"] - tpot["worker"], "gateway_sse": tpot["gateway"] - tpot["grpc"],
             "total": tpot["gateway"]}
    return {"serve_breakdown_ms": {k: round(v, 3) for k, v in parts.items()},
            "serve_layers": layers, "serve_stack": {**facts, "base_url": base_url, "max_tokens": max_tokens,
                                                    "prompts": len(prompts)},
            "serve_engine_share": round(tpot["engine"] / tpot["gateway"], 3)}

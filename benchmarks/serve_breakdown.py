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

The layers take turns: every round decodes all prompts through each layer, the layers' order
rotated from round to round, so that a slow spell of the machine (this guest's speed moves by
±15 % within minutes) lands on all of them. Per layer the medians over all its requests of TTFT
and TPOT (time per output token after the first, ms); `serve_engine_share` is the median over
rounds of engine TPOT / gateway TPOT, each ratio taken within one round.
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


def timings() -> dict[str, list[float]]:
    return {"ttft": [], "tpot": []}


def engine_alone(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, out: dict[str, list[float]]) -> None:
    """Plain decode in this process, one request at a time; client-side times as the servers' clients see them."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
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
        out["ttft"].append(first - t0)
        out["tpot"].append((last - first) / (n - 1))


async def worker_direct(address: str, prompts: list[list[int]], max_tokens: int, seen: dict[str, list[float]],
                        own: dict[str, list[float]]) -> None:
    """What the client of the worker's gRPC stream saw (`seen`) and what the worker reported of itself (`own`)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        for ids in prompts:
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
            seen["ttft"].append(first - t0)
            seen["tpot"].append((last - first) / (n - 1))
            own["ttft"].append(final.time_to_first_token_ms / 1e3)
            own["tpot"].append((final.total_ms - final.time_to_first_token_ms) / 1e3 / (final.completion_tokens - 1))


async def gateway_sse(target: serve.Target, prompts: list[list[int]], out: dict[str, list[float]]) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        for ids in prompts:
            # a list of token ids is a valid completions prompt: the same ids as the other layers
            o = await serve.send(client, target, Prompt(text=ids, domain="breakdown", source="breakdown"))  # type: ignore[arg-type]
            if not o.ok:
                raise RuntimeError(f"gateway {target.url}: {o.error}")
            out["ttft"].append(o.ttft)
            out["tpot"].append(o.tpot)


def stack_facts(base_url: str) -> dict:
    """The first worker's gRPC address and what the loop is doing, from the gateway's /v1/status."""
    doc = httpx.get(base_url.rstrip("/").removesuffix("/v1") + "/v1/status", timeout=10).json()
    workers = [w for w in doc.get("workers") or [] if w.get("available")]
    if not workers:
        raise RuntimeError(f"{base_url}/v1/status lists no available worker")
    ctl, tr = doc.get("controller") or {}, doc.get("trainer") or {}
    return {"worker": workers[0]["address"], "collection": (ctl.get("collection") or {}).get("enabled"),
            "trainer": tr.get("state"), "model": doc.get("target_model")}


def breakdown(model, base_url: str, prompts: list[list[int]], max_tokens: int, rounds: int = 3) -> dict:
    facts = stack_facts(base_url)
    gateway_model = serve.discover_model(serve.Target(serve.endpoint_url(base_url, "completions"), "completions", "",
                                                      max_tokens, 0.0, {}, {}, 30.0))
    target = serve.Target(url=serve.endpoint_url(base_url, "completions"), api="completions", model=gateway_model,
                          max_tokens=max_tokens, temperature=0.0,
                          extra_body={"speculative": False, "ignore_eos": True}, headers={}, timeout=300.0)
    engine = LLMEngine(model, EngineConfig(max_batch=1, max_seq_len=4096))
    times = {name: timings() for name in ("engine", "worker", "grpc", "gateway")}
    runs = {
        "engine": lambda ids, sink: engine_alone(engine, ids, max_tokens, sink["engine"]),
        "grpc": lambda ids, sink: asyncio.run(worker_direct(facts["worker"], ids, max_tokens, sink["grpc"],
                                                            sink["worker"])),
        "gateway": lambda ids, sink: asyncio.run(gateway_sse(target, ids, sink["gateway"])),
    }
    for run in runs.values():  # warm-up, counted nowhere
        run(prompts[:1], {name: timings() for name in times})
    shares = []
    for r in range(rounds):
        names = list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]
        this = {name: timings() for name in times}
        for name in names:
            runs[name](prompts, this)
        for name, t in this.items():
            times[name]["ttft"] += t["ttft"]
            times[name]["tpot"] += t["tpot"]
        shares.append(statistics.median(this["engine"]["tpot"]) / statistics.median(this["gateway"]["tpot"]))
    layers = {name: _summary(t["ttft"], t["tpot"]) for name, t in times.items()}
    tpot = {k: v["tpot_ms"] for k, v in layers.items()}
    parts = {"engine_step": tpot["engine"], "worker_process": tpot["worker"] - tpot["engine"],
             "worker_handoff_grpc": tpot["grpc"] - tpot["worker"], "gateway_sse": tpot["gateway"] - tpot["grpc"],
             "total": tpot["gateway"]}
    return {"serve_breakdown_ms": {k: round(v, 3) for k, v in parts.items()},
            "serve_layers": layers, "serve_stack": {**facts, "base_url": base_url, "max_tokens": max_tokens,
                                                    "prompts": len(prompts), "rounds": rounds},
            "serve_engine_share": round(statistics.median(shares), 3),
            "serve_engine_share_by_round": [round(x, 3) for x in shares]}

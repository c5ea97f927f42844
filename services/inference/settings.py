"""Inference-service settings: one frozen object built once from the environment, passed explicitly.

Every variable (all optional), its type, default and meaning is a field of `InferenceSettings`; the
table in docs/configuration.md is generated from it (tools/gen_config_docs.py). The worker's
variables are `TIDE_` + the field name (TIDE_MAX_BATCH: `max_batch`); it also reads the storage
variables (`tide.blobs.StorageSettings`: TIDE_S3_*, TIDE_REDIS_URL, TIDE_STREAM_PREFIX).
"""

from __future__ import annotations

import os
import socket
from typing import Annotated

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from tide.blobs import StorageSettings
from tide.grpcutil import ADMIN_TOKEN_ENV
from tide.precision import DTYPE_NAMES, WEIGHTS_NAMES
from tide.registry_client import DEFAULT_REGISTRY_ADDR, REGISTRY_ADDR_ENV
from tide.settings import (
    Count,
    CpuSet,
    CpuSetMixin,
    Flag,
    JsonObject,
    ListenHostMixin,
    NonNegative,
    OptionalCount,
    Port,
    Seconds,
    Secret,
    TideSettings,
    check,
    one_of,
    shown_default,
)

DRAFTERS = ("ngram", "none", "eagle3")
MEMORY_SCOPES = ("key", "stack")
SAMPLING_SCHEMES = ("coupled", "rejection")  # tide.engine.sampling.SamplingScheme's values (torch-free here)
PROFILE_AT_START = ("auto", "", "1", "0", "true", "false", "yes", "no", "on", "off")


class InferenceSettings(ListenHostMixin, CpuSetMixin, TideSettings):
    """Everything the inference service is configured with. Times in seconds; sizes in tokens/slots."""

    model_config = SettingsConfigDict(env_prefix="TIDE_")

    target: str = Field("ref", description='target model: "ref", a HF directory or a .gguf file')
    dtype: Annotated[str, one_of(DTYPE_NAMES)] = Field(
        "auto",
        description="auto = bf16 where it is fast (native, or tide.kernels' AVX2 GEMM), else fp32 (tide/precision.py)")
    weights: Annotated[str, one_of(WEIGHTS_NAMES)] = Field(
        "auto", description="how the target's weights are stored: auto = in the compute dtype where they take at most "
        "half the memory available at load, else int8, else int4 (an 8B model on a 24 GB machine); bf16 / fp16 / fp32 "
        "(also the compute dtype); int8 / int4 = weight-only quantized, CPU only (tide/quant.py)")
    prefill_weights: Annotated[str, one_of(("auto", "float", "shared"))] = Field(
        "auto", description="with int8 / int4 weights, what prompts run on: float = bf16 copies of the projections "
        "(twice the weight memory or more), shared = the quantized ones; auto = shared for int8 where the CPU "
        "kernels widen a prompt's weights once (AVX512_BF16: 0.96x the copies' speed), else the copies where they "
        "take at most a quarter of the memory available at load (tide.engine.llama)")
    device: str = Field("cpu", description="cpu | cuda | cuda:N")
    cpus: CpuSet = Field("", description="CPUs this worker runs on (affinity, and torch threads = their count; keep "
                         "the trainer's TIDE_TRAINER_CPUS apart; `tide up` starts its other services on the remaining "
                         "CPUs)")
    # Unset, the slots and the context are derived from the KV-cache budget (tide.engine.kv_budget):
    # 16 slots × 2048 tokens (or the model's context if shorter) where they fit, else fewer slots.
    max_batch: OptionalCount = Field(None, json_schema_extra=shown_default("16, fewer to fit TIDE_KV_CACHE_MB"),
                                     description="KV-cache slots = most sequences decoded per step")
    max_seq_len: OptionalCount = Field(
        None, json_schema_extra=shown_default("2048 (the model's if shorter), less to fit TIDE_KV_CACHE_MB"),
        description="prompt + output tokens per sequence")
    # Half of what is free by default: the rest of the stack shares the machine (kv_budget.BUDGET_FRACTION).
    kv_cache_mb: OptionalCount = Field(
        None, json_schema_extra=shown_default("50% of the memory available after the weights load"),
        description="byte budget (MiB) of everything the worker allocates per KV slot: the target's K/V (the "
        "model's bf16 on the CPU kernels, else float32 on CPU), and the EAGLE-3 draft's K/V and feature rows; the "
        "slots and context not set are derived to fit it, and a TIDE_MAX_BATCH × TIDE_MAX_SEQ_LEN that does not fit "
        "is refused at start. Available memory = "
        "MemAvailable, or less under a cgroup memory.max (the GPU's free memory on cuda)")
    max_tokens_per_step: Count = Field(512, description="prefill token budget per step")
    prefix_cache: bool = Field(True, description="a prompt that starts like an earlier request's reuses the KV "
                               "entries that request left in its slot instead of prefilling them again (exact: "
                               "outputs are unchanged)")
    prefix_cache_host_mb: NonNegative = Field(512, description="host memory (MiB) for the prefix cache's entries "
                                              "evicted from free KV slots, least recently used dropped first; 0 "
                                              "keeps only what the free slots hold (about 23 KB a token for the "
                                              "reference model in bf16)")
    max_gamma: NonNegative = Field(8, description="hard cap on draft tokens per request per step")
    max_queue: NonNegative = Field(64, description="requests that may wait beyond max batch before "
                                   "RESOURCE_EXHAUSTED")
    # 50 ms: 20 updates a second, as smooth as text is read; at one stream on a 2-vCPU CPU (~20 ms a
    # token) it sends ~2.5 tokens a message and served tokens came 5 % faster (engine-step README, 2h)
    stream_interval_ms: NonNegative = Field(50, description="a stream sends at most one message per this many ms "
                                            "after its first token, each with the tokens made meanwhile (0: one "
                                            "per engine step); the first token and the end are never held back")
    listen: str = Field("127.0.0.1:50051", description="gRPC host:port")
    metrics_port: Port = Field(9101, description="Prometheus HTTP port on the listen host; 0 = off")
    worker_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
                           json_schema_extra=shown_default("hostname-pid"),
                           description="worker id in telemetry and chunks")
    drafter: Annotated[str, one_of(DRAFTERS)] = Field(
        "ngram", description="the registry's current draft for the target (n-gram until one loads; see drafts.py)")
    # Copying where the context repeats, drafting elsewhere: under the adaptive policy 1.48x plain at
    # batch 1 on held-out code, chat and maths prompts, where the starter draft alone gave 1.17x
    # (docs/results/speculation).
    prompt_lookup: bool = Field(True, description="with TIDE_DRAFTER=eagle3: each step, a sequence whose last "
                                "tokens occurred earlier in its context proposes what followed them (no draft "
                                "forward), the others the EAGLE-3 draft's tokens (tide/engine/drafters/hybrid.py); "
                                "lossless either way")
    # A memory of what the worker served, recalled where a request's context ends as an earlier
    # one's did (tide/engine/drafters/memory.py). Default: see docs/results/speculation-memory.
    speculation_memory_mb: NonNegative = Field(0, description="with TIDE_DRAFTER=eagle3 and prompt lookup: MiB "
                                               "for a memory of the token ids of finished requests (a prompt's "
                                               "last 256 tokens and the output), shared by the worker's requests "
                                               "and proposing what followed where a request's last tokens occurred "
                                               "in it (no draft forward; lossless); oldest evicted first; 0 = off")
    # Speculation never changes a response's text, but it changes its timing: a response that
    # streams faster because it matched another client's text would tell that client something of
    # it. So by default each API key (tide.v1.GenerateRequest.key_id) has its own memory.
    speculation_memory_scope: Annotated[str, one_of(MEMORY_SCOPES)] = Field(
        "key", description="key = a request reads and feeds only the memory of its own API key (requests "
        "without keys share one), so no client's timing depends on another's text; stack = one memory for all "
        "(more recalls, for a deployment whose keys trust each other)")
    # Off by default: whether sharing pays is not measured yet (docs/results/speculation-memory,
    # "Across the fleet"; `python -m benchmarks.speculation_memory --fleet 2` counts it).
    speculation_memory_fleet: bool = Field(False, description="with a speculation memory: publish the token "
                                           "ids it adds (finished requests that did not opt out; sealed with the "
                                           "data keys when set) to the Redis stream <prefix>:memory, and add what "
                                           "the stack's other workers published there to this worker's memory "
                                           "(a restarted worker warms from the newest entries its budget holds)")
    registry_addr: str = Field(DEFAULT_REGISTRY_ADDR, validation_alias=REGISTRY_ADDR_ENV,
                               description='draft registry gRPC host:port (watched while "eagle3" is used)')
    draft_wait_s: Seconds = Field(15.0, description='with TIDE_DRAFTER=eagle3: at start, wait up to this long for '
                                  "the registry's draft to load before serving (the first request then runs it); "
                                  "0 = serve at once with the fallback drafter")
    draft_cache_dir: str = Field("", json_schema_extra=shown_default("`$TIDE_CACHE_DIR/drafts`"),
                                 description="where registry drafts are downloaded")
    # adaptive: per batch bucket, the γ the latency profile and the live acceptance predict fastest,
    # 0 where no γ pays (a weak draft is then not used); 1.7x static γ = 3 in `tide bench policies`.
    policy: str = Field("adaptive", description="γ policy name (tide.policies.registry.POLICY_NAMES)")
    policy_params: JsonObject = Field(default_factory=dict, description="the policy's keyword arguments")
    latency_profile: str = Field("", description="path of a LatencyProfile JSON for policies that need one")
    profile_at_start: Annotated[str, check(lambda v: v.strip().lower() in PROFILE_AT_START, "auto, 1 or 0")] = Field(
        "auto", description="auto | 1 | 0: measure T(b, n), D(b) at start when no profile file is given (auto: for "
        "policies that take a profile; see profiling.py)")
    profile_cache_dir: str = Field("", json_schema_extra=shown_default("`$TIDE_CACHE_DIR/profiles`"),
                                   description="where measured profiles are cached")
    forced_gamma: NonNegative = Field(3, description="γ for requests with speculative=true where the policy says 0")
    collection: Flag = Field(False, description="hidden-state export on at start")
    train_on_traffic: Flag = Field(True, validation_alias="TIDE_TRAIN_ON_TRAFFIC",
                                   description="the stack-wide switch (gateway and workers read it): 0 = no "
                                   "request is ever captured for training, collection decisions are refused")
    chunk_tokens: Count = Field(2048, description="rows per hidden-state chunk")
    chunk_buffers: Count = Field(3, description="preallocated chunk buffers (bounds exporter memory)")
    flush_interval_s: Seconds = Field(30.0, description="flush a partial chunk after this many seconds")
    chunk_prefix: str = Field("chunks", description="S3 key prefix for chunk blobs")
    chunk_spool_dir: str = Field(
        "", json_schema_extra=shown_default("`$TIDE_CACHE_DIR/spool/<worker id>`"),
        description="directory of chunks whose S3 write failed, of chunk refs waiting for Redis and of S3 writes "
        "in progress: uploaded / announced when S3 / Redis answer again, and re-sent by the next worker started "
        "on it, which also announces the blobs a killed predecessor stored but never announced (give each "
        "worker its own, on a disk that outlives the process; `tide up`: <data dir>/spool/worker-<i>)")
    chunk_spool_bytes: NonNegative = Field(1 << 30, description="most bytes the chunk spool holds; a new chunk "
                                           "that does not fit evicts the oldest spooled ones (counted); 0 = no "
                                           "spool: drop at once")
    telemetry_batch: Count = Field(64, description="step records per XADD pipeline")
    telemetry_interval_s: Seconds = Field(0.5, description="seconds between telemetry flushes")
    telemetry_buffer: Count = Field(10_000, description="step records kept while Redis is unreachable (oldest "
                                    "dropped)")
    seed: int = Field(0, description="RNG seed for sampled requests without their own seed")
    # Seeded requests always draw coupled (their seed keys the draws, so they reproduce under
    # speculation); for the others both schemes are exact (docs/results/sampling compares them).
    unseeded_sampling: Annotated[str, one_of(SAMPLING_SCHEMES)] = Field(
        "rejection", description="how sampled requests without a seed draw: rejection (speculative sampling with "
        "the request's generator; accepts more drafts, docs/results/sampling) or coupled (inverse-CDF draws keyed "
        "by a seed the worker picks and the position, as seeded requests draw)")
    admin_token: Secret = Field(None, validation_alias=ADMIN_TOKEN_ENV,
                                description="bearer token for ApplyDecision (unset: admin calls refused)")
    storage: StorageSettings = Field(default_factory=StorageSettings, description="S3 (chunks, drafts) and Redis")

    @model_validator(mode="after")
    def _weights_fit_dtype_and_device(self):
        from tide.precision import resolve_weights

        resolve_weights(self.weights, self.dtype, self.device)  # ValueError: bf16 weights with TIDE_DTYPE=fp32, ...
        return self

    @property
    def torch_dtype(self):
        """The dtype the target and draft compute in ("auto" resolved for the device; set by float `weights`)."""
        from tide.precision import resolve_weights

        return resolve_weights(self.weights, self.dtype, self.device)[0]

    @property
    def weight_format(self) -> str:
        """"float", "int8" or "int4": how LlamaModel stores the target's projections (tide.precision)."""
        from tide.precision import resolve_weights

        return resolve_weights(self.weights, self.dtype, self.device)[1]


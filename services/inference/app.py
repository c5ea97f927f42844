"""Wiring: settings -> target model -> engine -> worker (+ telemetry, exporter) -> gRPC server.

`build(settings)` returns a running `InferenceService`; `__main__` adds signals, logs and metrics.
Redis and S3 are optional at run time: when they are down the worker serves, the exporter spools
chunks and refs on disk (TIDE_CHUNK_SPOOL_DIR) and the publishers count what they drop (see
telemetry.py and exporter.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import logging
import numbers
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import urllib3
from minio import Minio

from services.inference.control import make_drafter
from services.inference.drafts import DRAFTER_NAME, DraftWatcher
from services.inference.exporter import ChunkExporter
from services.inference.fleet_memory import FleetMemory
from services.inference.live import LiveStats
from services.inference.memory_forget import MemoryForgetter
from services.inference.server import serve
from services.inference.settings import InferenceSettings
from services.inference.telemetry import TelemetryPublisher
from services.inference.worker import Worker
from tide import blobs, streams
from tide.allocator import release_free_memory
from tide.decisions import PolicySpec
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.kv_budget import BUDGET_FRACTION, DEFAULT_SLOTS, KVPlan, default_budget, model_slot_cost, plan
from tide.engine.profiling import (
    PROFILE_POLICIES,
    LiveProfile,
    cached_profile,
    random_draft,
    start_cost,
    start_grid,
    wants_profile,
)
from tide.engine.sampling import SamplingScheme
from tide.grpcutil import GrpcServer
from tide.memory import available_bytes, tensor_bytes
from tide.policies.profile import LatencyProfile
from tide.precision import weights_label
from tide.target import cache_dir, load_tokenizer, resolve_target

log = logging.getLogger(__name__)


def load_target(settings: InferenceSettings):
    """(LlamaModel, tokenizer or None, model id) for the configured target (a GGUF file's weights read
    from the file per tensor; its metadata described once, cached: tide.target)."""
    from tide.engine.llama import LlamaConfig, LlamaModel, auto_weight_format

    started = time.monotonic()
    target = resolve_target(settings.target)
    fmt = settings.weight_format
    if settings.weights == "auto":  # float where it fits in memory, else int8 / int4 (AUTO_FLOAT_SHARE)
        fmt = auto_weight_format(LlamaConfig.from_hf(target.config), settings.torch_dtype, settings.device)
    model = LlamaModel.load(target, dtype=settings.torch_dtype, device=settings.device,
                            weight_format=fmt, prefill_weights=settings.prefill_weights)
    tokenizer = None
    if (target.path / "tokenizer.json").exists() or (target.path / "tokenizer_config.json").exists():
        tokenizer = load_tokenizer(target)
    else:
        log.warning("target %s has no tokenizer: prompt_text and stop strings will be refused", target.path)
    log.info("loaded target %s (%s%s, %s) from %s in %.1f s", target.model_id,
             weights_label(model.dtype, model.weight_format),
             "" if model.weight_format == "float" else f", prompts on {model.prefill_weights} projections",
             settings.device, target.gguf or target.path, time.monotonic() - started)
    return model, tokenizer, target.model_id


def kv_budget(settings: InferenceSettings, device) -> tuple[int | None, str]:
    """(the KV cache's byte budget, where it came from): TIDE_KV_CACHE_MB, else a share of the memory
    available now (call it after the weights are loaded: they are then no longer available) —
    tide.engine.kv_budget.BUDGET_FRACTION says why that share. None: the memory is unknown."""
    if settings.kv_cache_mb is not None:
        return settings.kv_cache_mb * 2**20, "TIDE_KV_CACHE_MB"
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        found = (free, "free GPU memory")
    else:
        found = available_bytes()
    if found is None:
        return None, "available memory unknown"
    avail, source = found
    return default_budget(avail), f"{BUDGET_FRACTION:.0%} of {avail / 2**20:.0f} MiB available ({source})"


def kv_plan(settings: InferenceSettings, model, max_new_per_step: int) -> KVPlan:
    """The slots and context the worker serves with (tide.engine.kv_budget.plan): TIDE_MAX_BATCH and
    TIDE_MAX_SEQ_LEN where set, the rest derived from the budget. Raises KVBudgetError (a ValueError)
    when what is set does not fit."""
    cost = model_slot_cost(model, max_new_per_step)
    budget, source = kv_budget(settings, model.device)
    if budget is None:  # no limit known: the values set, else the defaults
        budget = 1 << 62
    return plan(cost, budget, model.cfg.max_position_embeddings, slots=settings.max_batch,
                context=settings.max_seq_len, budget_source=source)


def policy_spec(name: str, params) -> PolicySpec:
    """Scalar parameters go in `params`, structured ones in `table_json` (as the proto has it)."""
    scalars = {k: float(v) for k, v in params.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)}
    rest = {k: v for k, v in params.items() if k not in scalars}
    return PolicySpec(name, scalars, json.dumps(rest, sort_keys=True) if rest else "")


def start_profile(settings: InferenceSettings, model, model_id: str,
                  max_batch: int | None = None) -> LatencyProfile | None:
    """The worker's latency profile: TIDE_LATENCY_PROFILE's file, else (TIDE_PROFILE_AT_START) one
    measured here — from the disk cache when this target/dtype/device/threads/drafter was profiled
    before — as a `LiveProfile` that a `reprofile` decision re-measures. None: no profile. With
    TIDE_DRAFTER=eagle3 the draft is timed in the production shape (8192-token draft vocabulary,
    random weights): the registry's draft arrives after start, and latency depends on shape only.
    `max_batch`: the worker's slots (the profile's largest batch; default TIDE_MAX_BATCH or 16)."""
    max_batch = max_batch or settings.max_batch or DEFAULT_SLOTS
    if settings.latency_profile:
        return LatencyProfile.load(settings.latency_profile)
    if not wants_profile(settings.policy, settings.profile_at_start):
        return None
    if settings.drafter == "eagle3":  # the registry's draft comes later; latency depends on its shape only
        from tide.engine.drafters.eagle3 import Eagle3Drafter

        drafter = Eagle3Drafter(random_draft(model, min(8192, model.cfg.vocab_size)), "shape", 1, 1)
    else:
        drafter = make_drafter(settings.drafter)
    # With a speculation memory, recalls verify up to EngineConfig.max_recall_gamma + 1 rows: profile them.
    recall_gamma = EngineConfig.max_recall_gamma if settings.speculation_memory_mb > 0 else 0
    weight_bytes = tensor_bytes(model)
    batches, ns, lags, reps = start_grid(max_batch, settings.max_gamma, weight_bytes, recall_gamma)
    cache = Path(settings.profile_cache_dir) if settings.profile_cache_dir else None

    def measure(refresh: bool) -> LatencyProfile:
        prof, path, hit = cached_profile(model, drafter, model_id=model_id, batches=batches, ns=ns, lags=lags,
                                         reps=reps, directory=cache, refresh=refresh, cost=start_cost(weight_bytes))
        log.info("latency profile %s (%s): %s", path, "cached" if hit else f"measured in {prof.meta['profile_s']} s",
                 json.dumps({k: v for k, v in prof.to_dict().items() if k != "meta"}, sort_keys=True))
        return prof

    return LiveProfile.wrap(measure(False), lambda: measure(True))


def s3_client(settings: InferenceSettings, read_timeout_s: float = 30.0, read_retries: int | None = None) -> Minio:
    """A minio client that fails fast (seconds, few retries) so an S3 outage never stalls the flusher.
    The exporter's waits at most 10 s for a hung S3 (a stopped process still accepts connections) and
    does not retry reads: its chunk goes to the spool instead."""
    st = settings.storage
    # maxsize 4: minio uploads a chunk (7 MB at the defaults) as parallel parts; at urllib3's default
    # of one connection per host, every chunk logged "Connection pool is full, discarding connection"
    http = urllib3.PoolManager(maxsize=4, timeout=urllib3.Timeout(connect=2.0, read=read_timeout_s),
                               retries=urllib3.Retry(total=2, read=read_retries, backoff_factor=0.2,
                                                     status_forcelist=[500, 502, 503, 504]))
    return Minio(st.s3_endpoint, access_key=st.s3_access_key, secret_key=st.s3_secret_key, secure=st.s3_secure,
                 http_client=http)


def spool_dir(settings: InferenceSettings) -> Path:
    """The exporter's spool: TIDE_CHUNK_SPOOL_DIR, else $TIDE_CACHE_DIR/spool/<worker id>."""
    if settings.chunk_spool_dir:
        return Path(settings.chunk_spool_dir)
    return cache_dir() / "spool" / re.sub(r"[^A-Za-z0-9._-]", "_", settings.worker_id)


@dataclass
class InferenceService:
    settings: InferenceSettings
    worker: Worker
    server: GrpcServer
    telemetry: TelemetryPublisher
    exporter: ChunkExporter
    drafts: DraftWatcher
    fleet: FleetMemory | None = None  # TIDE_SPECULATION_MEMORY_FLEET
    forgetter: MemoryForgetter | None = None  # with a speculation memory: deletion requests reach it

    @property
    def target(self) -> str:
        return self.server.target

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop routing (health NOT_SERVING), drain for `grace_s`, then stop the publishers after a last flush."""
        self.server.health.enter_graceful_shutdown()
        self.drafts.stop()
        self.worker.stop(grace_s)
        self.server.stop(1.0)
        self.telemetry.stop()
        self.exporter.stop()
        if self.fleet is not None:
            self.fleet.stop()
        if self.forgetter is not None:
            self.forgetter.stop()


@dataclass
class _Prepared:
    """What `prepare` built on the engine thread, for `finish` to start serving from."""

    worker: Worker
    telemetry: TelemetryPublisher
    exporter: ChunkExporter
    drafts: DraftWatcher
    live: LiveStats


def build(settings: InferenceSettings, *, model=None, tokenizer=None, model_id: str | None = None) -> InferenceService:
    """Build and start everything, the engine loop on a thread of its own. `model`/`tokenizer`/
    `model_id` may be passed in (tests reuse a loaded model); otherwise the target named by the
    settings is loaded. The service process uses `build_on_engine_thread` instead."""
    parts = prepare(settings, model=model, tokenizer=tokenizer, model_id=model_id)
    parts.worker.start()
    return finish(settings, parts)


def build_on_engine_thread(settings: InferenceSettings) -> InferenceService:
    """`build`, with the model loaded and profiled on the thread that then runs the engine loop
    (see `Worker.run`: one thread does all of the model's work); returns once serving."""
    ready: concurrent.futures.Future[_Prepared] = concurrent.futures.Future()

    def engine_thread() -> None:
        try:
            parts = prepare(settings)
        except BaseException as e:  # reported by the caller (start-up failed)
            ready.set_exception(e)
            return
        ready.set_result(parts)
        parts.worker.run()

    threading.Thread(target=engine_thread, name="engine-loop", daemon=True).start()
    return finish(settings, ready.result())


def prepare(settings: InferenceSettings, *, model=None, tokenizer=None, model_id: str | None = None) -> _Prepared:
    """Everything that touches the model (load, latency profile, engine) and the parts around the
    worker; nothing serves yet and the engine loop does not run."""
    if model is None:
        model, tokenizer, model_id = load_target(settings)
    # The load's transient tensors (each checkpoint tensor as read, float values before packing)
    # were freed into the heap, which tide.allocator keeps mapped: handed back here, or the worker
    # would hold its load's peak as RSS (docs/results/model-sizes, "Memory beside llama-server").
    release_free_memory()
    model_id = model_id or settings.target
    config = EngineConfig(max_tokens_per_step=settings.max_tokens_per_step, max_gamma=settings.max_gamma,
                          forced_gamma=settings.forced_gamma, seed=settings.seed, worker_id=settings.worker_id,
                          target_model=model_id, prefix_cache=settings.prefix_cache,
                          prefix_cache_host_mb=settings.prefix_cache_host_mb,
                          unseeded_sampling=SamplingScheme(settings.unseeded_sampling),
                          speculation_memory_mb=settings.speculation_memory_mb)
    kv = kv_plan(settings, model, config.max_new_per_step)
    log.info("%s", kv.describe())
    config = dataclasses.replace(config, max_batch=kv.slots, max_seq_len=kv.context)
    engine = LLMEngine(model, config, tokenizer=tokenizer)
    names = streams.StreamNames(settings.storage.stream_prefix)
    rclient = settings.storage.redis_client(socket_connect_timeout=1.0, socket_timeout=2.0)
    telemetry = TelemetryPublisher(rclient, names.telemetry, batch_size=settings.telemetry_batch,
                                   interval_s=settings.telemetry_interval_s, buffer_cap=settings.telemetry_buffer)
    s3 = s3_client(settings)
    try:
        blobs.ensure_bucket(s3, settings.storage.s3_bucket)
    except Exception as e:  # S3 down at start: serve anyway, chunks are spooled (or dropped) until it is up
        log.warning("S3 bucket %s not reachable at start (%s); collection will spool chunks until it is",
                    settings.storage.s3_bucket, e)
    export_s3 = s3_client(settings, read_timeout_s=10.0, read_retries=0)
    exporter = ChunkExporter(export_s3, settings.storage.s3_bucket, rclient, names.chunks, target_model=model_id,
                             worker_id=settings.worker_id, hidden_size=model.cfg.hidden_size,
                             chunk_tokens=settings.chunk_tokens, buffers=settings.chunk_buffers,
                             flush_interval_s=settings.flush_interval_s, key_prefix=settings.chunk_prefix,
                             pin_memory=model.device.type == "cuda", spool_dir=spool_dir(settings),
                             spool_max_bytes=settings.chunk_spool_bytes, keyring=settings.storage.keyring())
    profile = start_profile(settings, model, model_id, config.max_batch)
    release_free_memory()  # the profile's runners and their caches too
    params = dict(settings.policy_params)
    if profile is not None and settings.policy in PROFILE_POLICIES:
        params.setdefault("profile", profile.to_dict())  # GetStatus shows the table the policy runs on
    # "eagle3" = the registry's current draft for this target; the registry is watched from the
    # first time "eagle3" is asked for (at start with TIDE_DRAFTER=eagle3, or by a decision).
    drafts = DraftWatcher(model_id, s3=s3, cache_dir=settings.draft_cache_dir or cache_dir() / "drafts",
                          model=model, max_batch=config.max_batch, max_len=engine.runner.cache.max_len,
                          registry_addr=settings.registry_addr, prompt_lookup=settings.prompt_lookup)
    worker = Worker(engine, policy=policy_spec(settings.policy, params), drafter=settings.drafter,
                    tokenizer=tokenizer, exporter=exporter, collection=settings.collection,
                    train_on_traffic=settings.train_on_traffic,
                    max_queue=settings.max_queue, profile=profile,
                    drafter_factory=functools.partial(make_drafter, eagle3=drafts.drafter),
                    device=str(model.device), memory_scope=settings.speculation_memory_scope)
    drafts.attach(functools.partial(worker.offer_drafter, DRAFTER_NAME))
    engine.step_listeners.append(telemetry.publish)
    live = LiveStats()
    engine.step_listeners.append(live.observe)
    return _Prepared(worker, telemetry, exporter, drafts, live)


def finish(settings: InferenceSettings, parts: _Prepared) -> InferenceService:
    """Start the publishers, wait for the registry's draft (the engine loop is running) and serve."""
    worker, telemetry, exporter, drafts, live = parts.worker, parts.telemetry, parts.exporter, parts.drafts, parts.live
    telemetry.start()
    exporter.start()
    if settings.drafter == DRAFTER_NAME and settings.draft_wait_s > 0:
        t0 = time.monotonic()
        settled = drafts.wait_settled(settings.draft_wait_s)
        log.info("registry draft %s before serving (%.1f s): %s", "settled" if settled else "not settled",
                 time.monotonic() - t0, drafts.version or "fallback drafter")
    server = serve(worker, settings.listen, settings.admin_token,
                   max_workers=worker.engine.config.max_batch + settings.max_queue + 8, drafts=drafts, live=live,
                   stream_interval_s=settings.stream_interval_ms / 1e3)
    return InferenceService(settings, worker, server, telemetry, exporter, drafts, fleet_memory(settings, worker),
                            memory_forgetter(settings, worker))


def memory_forgetter(settings: InferenceSettings, worker: Worker) -> MemoryForgetter | None:
    """With a speculation memory: the reader of deletion requests for it (memory_forget.py), started."""
    if worker.engine.memory is None:
        return None
    client = settings.storage.redis_client(socket_connect_timeout=1.0, socket_timeout=5.0)
    return MemoryForgetter(client, streams.StreamNames(settings.storage.stream_prefix).forget, worker).start()


def fleet_memory(settings: InferenceSettings, worker: Worker) -> FleetMemory | None:
    """The worker's share of the fleet's speculation memory (TIDE_SPECULATION_MEMORY_FLEET), started."""
    eng = worker.engine
    if not settings.speculation_memory_fleet or eng.memory is None:
        return None
    client = settings.storage.redis_client(socket_connect_timeout=1.0, socket_timeout=5.0)
    return FleetMemory(client, streams.StreamNames(settings.storage.stream_prefix).memory, eng,
                       worker_id=settings.worker_id, target_model=eng.config.target_model,
                       keyring=settings.storage.keyring()).start()

"""The worker: owns the LLMEngine and drives it from one thread; everything else talks to it by message.

Threads: any thread may `submit`, `cancel`, `apply_decision`, `offer_drafter` or read `status()`;
the loop thread runs engine steps and, between steps, the commands those calls queued (add, cancel,
decisions, drafter swaps: the registry's new "eagle3" draft arrives by `offer_drafter`, see drafts.py).
Each request's events go to its `RequestHandle.events` queue (see `requests.py`). Decisions are
applied between steps, atomically (validated first, then committed), once per decision id.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable

from services.inference import metrics
from services.inference.control import (
    DecisionResult,
    DrafterFactory,
    Outcome,
    ScheduledPolicy,
    SeenIds,
    WorkerMemory,
    WorkerStatus,
    build_policy,
    make_drafter,
)
from services.inference.requests import (
    ErrorEvent,
    ErrorKind,
    GenerationRequest,
    RequestHandle,
    RequestRejected,
    TokenEvent,
    prepare,
)
from tide.decisions import Decision, DecisionError, PolicySpec, SpeculationSchedule
from tide.engine.constraints import CompiledGrammar
from tide.engine.drafters import Drafter
from tide.engine.drafters.hybrid import HybridDrafter
from tide.engine.engine import LLMEngine, RequestOutput
from tide.engine.sequence import FinishReason, SamplingParams
from tide.memory import resident_tensor_bytes, rss_bytes, tensor_bytes
from tide.policies import Introspectable
from tide.policies.profile import LatencyProfile
from tide.telemetry import StepRecord

log = logging.getLogger(__name__)
_HALT = object()  # command that stops the loop thread
ESTIMATES_EVERY_S = 1.0  # the policy's estimates are exported this often: scrapes are seconds apart


class Worker:
    """`exporter` (optional) has `add(rows, prompt_lens)`, `set_draft_version(v)` and `flush_soon()`;
    while collection is on its capture hook is the engine's only capture listener, while off the
    engine has none. `max_queue` = requests accepted beyond `max_batch` before OVERLOADED. A
    request's `speculative` flag rides on its engine sequence (the engine applies it, with
    `EngineConfig.forced_gamma`); the decision's schedule and policy decide for the others.
    Only requests submitted with `capture=True` reach the exporter (opt-out, see docs/data-handling.md);
    with `train_on_traffic=False` none does and collection cannot be turned on."""

    def __init__(self, engine: LLMEngine, *, policy: PolicySpec, drafter: str = "ngram", tokenizer=None,
                 exporter=None, collection: bool = False, max_queue: int = 64,
                 profile: LatencyProfile | None = None, drafter_factory: DrafterFactory = make_drafter,
                 device: str = "cpu", train_on_traffic: bool = True, memory_scope: str = "key") -> None:
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self.exporter = exporter
        self.max_queue, self.profile = max_queue, profile
        self.drafter_factory, self.device = drafter_factory, device
        # "key": a request reads and feeds the speculation memory of its API key only; "stack": one
        # memory for all (settings.py says why the default keeps keys apart).
        self.memory_scope = memory_scope
        self.started_s = time.monotonic()
        self._estimates_at = 0.0  # monotonic s of the last estimates export (ESTIMATES_EVERY_S)
        self._lock = threading.Lock()
        self._live: dict[str, RequestHandle] = {}  # accepted, not finished (guarded by _lock)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._prompt_lens: dict[str, int] = {}
        # requests eligible for training (request id -> API key id); the others' rows are never exported
        self._capture_keys: dict[str, str] = {}
        self._capture_pending: dict[str, str] = {}  # submitted, not yet in the engine (guarded by _lock)
        self.train_on_traffic = train_on_traffic  # the stack-wide switch: False = nothing is ever captured
        self._seen = SeenIds()
        self._last_decision = ""
        self._collection = False
        self._schedule = SpeculationSchedule()
        self._policy_spec = policy
        self._drafter_name = drafter
        self._proposals_counted: tuple[object, int, int] = (None, 0, 0)  # drafter, copied, drafted (_count_proposals)
        self._held: tuple[int, int, set[int]] | None = None  # (weights, KV cache bytes, their storages)
        engine.set_policy(ScheduledPolicy(build_policy(policy, profile), self._schedule))
        engine.swap_drafter(drafter_factory(drafter))
        engine.step_listeners.append(self._on_step)
        if collection:
            if exporter is None:
                raise ValueError("collection needs an exporter")
            self._set_collection(True)

    # ---- any thread ------------------------------------------------------------------------

    def start(self) -> Worker:
        """Run the loop on a new thread (`run` runs it on the caller's)."""
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        return self

    def run(self) -> None:
        """Run the loop on this thread until `stop`. The service runs it on the thread that loaded
        and profiled the model: torch's OpenMP threads belong to the thread that starts a parallel
        region, and a second thread running the model starts a second pool, which makes libgomp
        throttle its spin-waits on a machine with as many cores as one pool's threads (on 2 cores:
        a batch-1 step 25 ms on the loading thread, 35 ms on another)."""
        self._thread = threading.current_thread()
        self._run()

    def submit(self, req: GenerationRequest) -> RequestHandle:
        """Validate and queue a request; raises RequestRejected (invalid, duplicate id, overloaded)."""
        cfg = self.engine.config
        prompt, params = prepare(req, self.tokenizer, self.engine.model.cfg.vocab_size, cfg.max_seq_len)
        handle = RequestHandle(req.request_id, prompt, params, req.speculative, req.workload,
                               grammar=self._compile_grammar(params),
                               memory_scope=req.key_id if self.memory_scope == "key" else "",
                               remember=not req.no_memory, key_id=req.key_id)
        with self._lock:
            if self._stopping:
                raise RequestRejected(ErrorKind.UNAVAILABLE, "the worker is shutting down")
            if req.request_id in self._live:
                raise RequestRejected(ErrorKind.DUPLICATE_ID, f"request id {req.request_id!r} is already in use")
            if len(self._live) >= cfg.max_batch + self.max_queue:
                metrics.REQUESTS.labels("overloaded").inc()
                raise RequestRejected(ErrorKind.OVERLOADED, f"worker is full: {len(self._live)} requests in flight "
                                                            f"(max batch {cfg.max_batch} + queue {self.max_queue})")
            self._live[req.request_id] = handle
            if req.capture and self.train_on_traffic:
                self._capture_pending[req.request_id] = req.key_id
        self._commands.put(lambda: self._add(handle))
        return handle

    def _compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """Compile the request's output constraint on the caller's thread (cached per spec), so a
        bad schema / regex is refused as INVALID_ARGUMENT and the engine loop never compiles."""
        if params.grammar is None:
            return None
        try:
            compiled = self.engine.compile_grammar(params.grammar)
        except ValueError as e:
            raise RequestRejected(ErrorKind.INVALID_ARGUMENT, str(e)) from None
        metrics.GRAMMAR_COMPILE.observe(compiled.compile_ms / 1e3)  # 0 for a cached grammar: nothing to compile
        log.debug("%s constraint compiled in %.1f ms", params.grammar.kind.value, compiled.compile_ms)
        return compiled

    def cancel(self, request_id: str) -> bool:
        """Cancel a running or queued request (its stream ends with a CANCELLED final)."""
        with self._lock:
            handle = self._live.get(request_id)
        if handle is None:
            return False
        self.cancel_handle(handle)
        return True

    def cancel_handle(self, handle: RequestHandle) -> None:
        """Cancel exactly this submission (a later request reusing the id is not affected)."""
        self._commands.put(lambda: self._cancel(handle))

    def apply_decision(self, decision: Decision, timeout_s: float = 30.0) -> DecisionResult:
        """Apply between steps; blocks until applied (or raises TimeoutError)."""
        fut: concurrent.futures.Future[DecisionResult] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(self._apply(decision))
            except Exception as e:  # never let a decision kill the loop
                log.exception("decision %s failed", decision.decision_id)
                fut.set_exception(e)

        self._commands.put(run)
        return fut.result(timeout=timeout_s)

    def forget_memory(self, key_id: str = "", request_id: str = "") -> concurrent.futures.Future[int]:
        """Drop the speculation memory's documents of an API key id or a request, between steps (on
        the engine thread, which alone touches the memory); the future: how many went."""
        fut: concurrent.futures.Future[int] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(self.engine.forget(key_id=key_id, request_id=request_id))
            except Exception as e:  # a bad notice must not kill the loop
                fut.set_exception(e)

        self._commands.put(run)
        return fut

    def offer_drafter(self, name: str, drafter: Drafter | None) -> concurrent.futures.Future[bool]:
        """Swap `drafter` in between steps if this worker runs the drafter called `name` (e.g. the
        registry watcher's newly loaded "eagle3" draft); the future says whether it was swapped in.
        In-flight requests continue with it from the next step on."""
        fut: concurrent.futures.Future[bool] = concurrent.futures.Future()

        def run() -> None:
            swap = self._drafter_name == name and self.engine.drafter is not drafter
            if swap:
                self._swap(drafter)
                log.info("drafter %s: now %s", name, drafter.version if drafter is not None else "none")
            fut.set_result(swap)

        self._commands.put(run)
        return fut

    def memory(self) -> WorkerMemory:
        """What this process holds (RSS) and what the target's weights, its KV cache and the draft
        in service take (tensor storages, each counted once: a draft's storage shared with the
        target counts as the target's). Any thread; the draft is read as it is at the call."""
        if self._held is None:  # the target and its cache never change: walk them once
            seen: set[int] = set()
            self._held = (tensor_bytes(self.engine.model, seen=seen), tensor_bytes(self.engine.runner.cache, seen=seen),
                          seen)
        weights, kv, seen = self._held
        drafter = self.engine.drafter
        draft = tensor_bytes(drafter, seen=set(seen)) if drafter is not None else 0
        sm = self.engine.memory  # read unlocked: ints the engine thread replaces, a sample may lag a step
        cache = self.engine.runner.cache
        resident = resident_tensor_bytes(cache.k + cache.v)
        return WorkerMemory(rss_bytes=rss_bytes() or 0, weights_bytes=weights, kv_cache_bytes=kv, draft_bytes=draft,
                            kv_cache_resident_bytes=kv if resident is None else resident,
                            speculation_memory_bytes=sm.nbytes if sm is not None else 0,
                            speculation_memory_budget_bytes=sm.budget_bytes if sm is not None else 0,
                            speculation_memory_tokens=sm.tokens if sm is not None else 0)

    def status(self) -> WorkerStatus:
        eng = self.engine
        with self._lock:
            live = len(self._live)
        active = len(eng.scheduler.active)
        d = eng.drafter
        return WorkerStatus(
            worker_id=eng.config.worker_id, model_id=eng.config.target_model, engine="torch", device=self.device,
            running_requests=active, waiting_requests=max(0, live - active), max_batch_size=eng.config.max_batch,
            load=live / eng.config.max_batch, kv_cache_usage=active / eng.config.max_batch,
            draft_version=d.version if d is not None else "", drafter=self._drafter_name,
            policy=self._policy_spec, speculation=self._schedule, collection_enabled=self._collection,
            last_decision_id=self._last_decision, uptime_s=time.monotonic() - self.started_s)

    def stop(self, grace_s: float = 5.0) -> None:
        """Refuse new requests, let running ones finish for up to `grace_s`, cancel the rest, stop."""
        with self._lock:
            self._stopping = True
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._live:
                    break
            time.sleep(0.02)
        with self._lock:
            left = list(self._live.values())
        for handle in left:
            self.cancel_handle(handle)
        if self._thread is not None:
            self._commands.put(_HALT)
            self._thread.join(timeout=30)
        if self._collection and self.exporter is not None:
            self.exporter.flush_soon()

    # ---- loop thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                cmd = self._commands.get(timeout=0.5) if not self.engine.has_work() else self._commands.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd is _HALT:
                    return
                try:
                    cmd()
                except Exception:  # a command must never take the loop down
                    log.exception("worker command failed")
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.engine.has_work():
                self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            metrics.STEP_ERRORS.inc()
            with self._lock:
                handles = list(self._live.values())
            log.exception("engine step failed; failing the %d requests in flight", len(handles))
            for handle in handles:
                if handle.seq is not None:
                    self.engine.cancel(handle.request_id)
                self._end(handle, ErrorEvent(ErrorKind.INTERNAL, "the worker failed while generating"), "error")
            return
        metrics.STEPS.inc()
        for out in outputs:
            self._dispatch(out)
        active = len(self.engine.scheduler.active)
        metrics.RUNNING.set(active)
        metrics.WAITING.set(max(0, len(self._live) - active))
        metrics.KV_USAGE.set(active / self.engine.config.max_batch)
        self._count_proposals()
        prefixes = self.engine.scheduler.prefixes
        if prefixes is not None:
            metrics.PREFIX_HOST_TOKENS.set(prefixes.host_held)
        self._export_estimates()

    def _count_proposals(self) -> None:
        """Prometheus: a HybridDrafter's copied / drafted proposals since the last step (its counts
        are per instance; a swapped-in drafter starts from zero)."""
        d = self.engine.drafter
        if not isinstance(d, HybridDrafter):
            return
        seen_by, copied, drafted = self._proposals_counted
        if seen_by is not d:
            copied = drafted = 0
        metrics.DRAFT_PROPOSALS.labels("copy").inc(d.copied - copied)
        metrics.DRAFT_PROPOSALS.labels("draft").inc(d.drafted - drafted)
        self._proposals_counted = (d, d.copied, d.drafted)

    def _export_estimates(self) -> None:
        """The γ policy's estimates as `tide_inference_policy_estimate` (at most every ESTIMATES_EVERY_S;
        the series are replaced whole, so a policy swap leaves none of the old policy's behind)."""
        now = time.monotonic()
        if now - self._estimates_at < ESTIMATES_EVERY_S:
            return
        self._estimates_at = now
        policy = self.engine.policy
        estimates = policy.estimates() if isinstance(policy, Introspectable) else []
        metrics.POLICY_ESTIMATE.clear()
        for e in estimates:
            metrics.POLICY_ESTIMATE.labels(policy.name, e.name, e.scope).set(e.value)

    def _add(self, h: RequestHandle) -> None:
        if h.done:  # cancelled before it reached the engine
            return
        try:
            h.seq = self.engine.add_request(h.request_id, h.prompt_ids, h.params, speculative=h.speculative,
                                            workload=h.workload, grammar=h.grammar, memory_scope=h.memory_scope,
                                            remember=h.remember, key_id=h.key_id)
        except ValueError as e:
            self._end(h, ErrorEvent(ErrorKind.INVALID_ARGUMENT, str(e)), "invalid")
            return
        d = self.engine.drafter
        h.drafter = d.algorithm.value if d is not None else "none"
        h.draft_version = d.version if d is not None else ""
        self._prompt_lens[h.request_id] = len(h.prompt_ids)
        with self._lock:
            key_id = self._capture_pending.pop(h.request_id, None)
        if key_id is not None:
            self._capture_keys[h.request_id] = key_id

    def _cancel(self, h: RequestHandle) -> None:
        if h.done:
            return
        if h.seq is not None:
            self.engine.cancel(h.request_id)
        self._end(h, h.final(FinishReason.CANCELLED, self.tokenizer, self.engine.eos_ids), "cancelled")

    def _dispatch(self, out: RequestOutput) -> None:
        h = self._live.get(out.request_id)
        if h is None or h.seq is not out.sequence:
            return
        if out.new_token_ids or out.text_delta or out.logprobs:
            if h.first_token_s is None and out.new_token_ids:
                h.first_token_s = time.monotonic()
                metrics.PROMPT_TOKENS.inc(out.sequence.num_prompt)
                metrics.PROMPT_TOKENS_CACHED.inc(out.sequence.num_reused)
            metrics.GENERATED_TOKENS.inc(len(out.new_token_ids))
            prompt = tuple(out.prompt_logprobs) if out.prompt_logprobs is not None else None
            h.events.put(TokenEvent(tuple(out.new_token_ids), out.text_delta, tuple(out.logprobs or ()), prompt))
        if out.finished:
            reason = out.finish_reason or FinishReason.STOP
            if reason is FinishReason.ERROR:
                self._end(h, ErrorEvent(ErrorKind.INTERNAL, "generation failed"), "error")
            else:
                self._end(h, h.final(reason, self.tokenizer, self.engine.eos_ids), reason.value)

    def _end(self, h: RequestHandle, event, outcome: str) -> None:
        h.done = True
        h.events.put(event)
        h.ended.set()
        metrics.REQUESTS.labels(outcome).inc()
        self._prompt_lens.pop(h.request_id, None)
        self._capture_keys.pop(h.request_id, None)
        with self._lock:
            self._capture_pending.pop(h.request_id, None)
            if self._live.get(h.request_id) is h:
                del self._live[h.request_id]

    def _on_step(self, record: StepRecord) -> None:
        for rid, gamma in zip(record.request_ids, record.gammas, strict=True):
            h = self._live.get(rid)
            if h is not None:
                if gamma > 0:
                    h.spec_steps += 1
                else:
                    h.plain_steps += 1

    def _on_capture(self, rows) -> None:
        # opted-out requests' rows stop here: the exporter never sees them (and filters again by key_ids)
        keep = [r for r in rows if r.request_id in self._capture_keys]
        if keep:
            self.exporter.add(keep, self._prompt_lens, self._capture_keys)

    def _set_collection(self, on: bool) -> None:
        on = on and self.train_on_traffic
        listeners = self.engine.capture_listeners
        if on and self._on_capture not in listeners:
            d = self.engine.drafter
            self.exporter.set_draft_version(d.version if d is not None else "")
            listeners.append(self._on_capture)
        elif not on and self._on_capture in listeners:
            listeners.remove(self._on_capture)
            self.exporter.flush_soon()
        self._collection = on
        metrics.COLLECTION.set(1 if on else 0)

    def _swap(self, drafter: Drafter | None) -> None:
        self.engine.swap_drafter(drafter)
        with self._lock:
            handles = list(self._live.values())
        for h in handles:  # the new drafter serves them from the next step on
            h.drafter = drafter.algorithm.value if drafter is not None else "none"
            h.draft_version = drafter.version if drafter is not None else ""
        if self._collection:
            self.exporter.set_draft_version(drafter.version if drafter is not None else "")

    def _apply(self, d: Decision) -> DecisionResult:
        outcome, detail = self._try_apply(d)
        metrics.DECISIONS.labels(outcome.value).inc()
        level = logging.WARNING if outcome is Outcome.REJECTED else logging.INFO
        log.log(level, "decision %s %s: %s (reason: %s)", d.decision_id, outcome.value, detail, d.reason or "-")
        return DecisionResult(outcome, detail, self.status())

    def _try_apply(self, d: Decision) -> tuple[Outcome, str]:
        if not d.decision_id:
            return Outcome.REJECTED, "decision_id is required"
        if d.decision_id in self._seen:
            return Outcome.ALREADY_APPLIED, f"decision {d.decision_id} was applied before; nothing changed"
        target = self.engine.config.target_model
        if d.target_model and d.target_model != target:
            return Outcome.REJECTED, f"decision is for target {d.target_model!r}; this worker serves {target!r}"
        try:  # validate and build everything first; commit only if all parts are valid
            inner = build_policy(d.policy, self.profile) if d.policy is not None else self.engine.policy.inner
            drafter = self.drafter_factory(d.drafter) if d.drafter not in (None, self._drafter_name) else None
        except DecisionError as e:
            return Outcome.REJECTED, str(e)
        if d.collection_enabled and self.exporter is None:
            return Outcome.REJECTED, "collection cannot be enabled: this worker has no hidden-state exporter"
        if d.collection_enabled and not self.train_on_traffic:
            return Outcome.REJECTED, ("collection cannot be enabled: training on traffic is off "
                                      "(TIDE_TRAIN_ON_TRAFFIC=0)")
        schedule = d.speculation if d.speculation is not None else self._schedule
        self._schedule = schedule
        if d.policy is not None:
            self._policy_spec = d.policy
        self.engine.set_policy(ScheduledPolicy(inner, schedule))
        if d.drafter is not None and d.drafter != self._drafter_name:
            self._swap(drafter)
            self._drafter_name = d.drafter
        if d.collection_enabled is not None:
            self._set_collection(d.collection_enabled)
        self._seen.add(d.decision_id)
        self._last_decision = d.decision_id
        return Outcome.APPLIED, "applied"

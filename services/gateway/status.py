"""`GET /v1/status`: the state of every part of the stack, in one JSON document.

Sources, each optional (one that is down or slow shows as `"available": false` with its error; the
document is still served):
- the workers: the gateway's own worker pool (healthy after its last status poll), and each worker's
  GetStatus asked now: load, tokens/s, acceptance per draft version and γ per batch bucket
  (WorkerStatus.live), the speculation schedule and γ policy in force, its drafts and refusals;
- the other gRPC services (registry, trainer, controller) at the addresses in the gateway's
  settings: their gRPC health check, and their read-only RPCs (registry ListDrafts, controller
  GetState, trainer GetStatus);
- the supervisor's view, when the stack runs under `tide up`: `TIDE_STACK_STATE` names its
  stack.json, which has every process's state (ready / starting / restarting / failed) and restart
  count, Redis and S3 included, and (the gateway runs beside them) each one's resident memory
  (`rss_bytes`, also summed at the top level). Under docker compose, Docker restarts containers and the restart
  counts are not visible here (null);
- this gateway's own training decisions since it started (`opt_out`: requests eligible, and excluded
  by reason; services/gateway/governance.py).

Everything is asked concurrently, `PROBE_TIMEOUT_S` each (the registry, whose pointer is per target,
after the others when no worker has named the target yet). `status` is "ok" when every part known is
healthy and ready, else "degraded" with `degraded` naming the parts that are not. No secrets:
addresses, names, counts and reasons only (no tokens, no credentials, no object-store paths).
The document's shape is in services/gateway/README.md ("Status page").
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.engine_client import EngineClient
from tide.grpcutil import aio_channel
from tide.memory import rss_bytes
from tide.proto.tide.v1 import (
    controller_pb2,
    controller_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0
RECENT_DECISIONS = 5  # the controller's decisions shown
MAX_REMEMBERED_CYCLES = 100  # training outcomes the gateway remembers (seen in the trainer's / controller's state)
_POINTER_ACTIONS = {registry_pb2.POINTER_ACTION_PROMOTE: "promote", registry_pb2.POINTER_ACTION_PIN: "pin",
                    registry_pb2.POINTER_ACTION_UNPIN: "unpin", registry_pb2.POINTER_ACTION_ROLLBACK: "rollback"}
_TRAINER_STATES = {trainer_pb2.TrainerStatus.STATE_IDLE: "idle", trainer_pb2.TrainerStatus.STATE_TRAINING: "training",
                   trainer_pb2.TrainerStatus.STATE_EVALUATING: "evaluating"}


@dataclass
class TrainingMemory:
    """Training outcomes seen in the trainer's and controller's state (which keep only the last one), by
    run id, so the timeline shows every cycle since the gateway started, promoted or not."""

    cycles: OrderedDict[str, dict] = field(default_factory=OrderedDict)

    def remember(self, cycle: dict) -> None:
        self.cycles[cycle["run_id"]] = cycle
        while len(self.cycles) > MAX_REMEMBERED_CYCLES:
            self.cycles.popitem(last=False)


@dataclass(frozen=True)
class StatusSources:
    services: dict[str, str]  # service name -> gRPC address ("" = not configured)
    stack_state: Path | None = None  # tide up's stack.json
    memory: TrainingMemory = field(default_factory=TrainingMemory)  # what the gateway has seen of training
    # this gateway's training decisions since it started: "eligible" or the exclusion's reason -> requests
    training_decisions: Counter = field(default_factory=Counter)
    started_unix_s: float = field(default_factory=time.time)


def supervisor_view(path: Path | None) -> dict[str, dict]:
    """Per process {state, restarts, last_exit, pid} from tide up's stack.json ({} when unknown)."""
    if path is None:
        return {}
    try:
        return dict(json.loads(path.read_text()).get("services") or {})
    except (OSError, ValueError) as e:
        log.warning("stack state unreadable", extra={"path": str(path), "error": str(e)})
        return {}


async def grpc_health(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the server at `address` says SERVING within `timeout_s`."""
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except (grpc.RpcError, OSError, TimeoutError):
        return False


async def _ask(address: str, stub_class, method: str, request, timeout_s: float = PROBE_TIMEOUT_S):
    """(reply, None) or (None, why not) for one read-only unary call."""
    try:
        async with aio_channel(address) as ch:
            return await getattr(stub_class(ch), method)(request, timeout=timeout_s), None
    except grpc.aio.AioRpcError as e:
        return None, f"{e.code().name}: {e.details()}"
    except (grpc.RpcError, OSError, TimeoutError) as e:
        return None, f"{type(e).__name__}: {e}"


def _r(x: float, nd: int = 4) -> float:
    return round(float(x), nd)


# ------------------------------------------------------------------------------------ workers


def _schedule(s: inference_pb2.SpeculationSchedule) -> list[dict]:
    return [{"min_batch": b.min_batch, "max_batch": b.max_batch or None, "enabled": b.enabled} for b in s.buckets]


def _policy(p: inference_pb2.GammaPolicy) -> dict:
    return {"name": p.name, "params": {k: _r(v) for k, v in sorted(p.params.items())}}


def _speculating(st: inference_pb2.WorkerStatus, reasons: dict[str, str]) -> dict:
    """Whether the worker speculates at its current batch size, and why (its drafter, its schedule's bucket,
    and the reason of the controller decision it applied last)."""
    batch = max(st.running_requests, 1)
    bucket = next((b for b in st.speculation.buckets
                   if b.min_batch <= batch and (b.max_batch == 0 or batch <= b.max_batch)), None)
    decision = reasons.get(st.last_decision_id, "")
    if st.drafter in ("", "none"):
        on, why = False, "no drafter"
    elif bucket is None:
        on, why = False, f"no schedule bucket covers batch {batch}" if st.speculation.buckets else "no schedule"
    else:
        span = f"{bucket.min_batch}-{bucket.max_batch}" if bucket.max_batch else f"{bucket.min_batch}+"
        on, why = bucket.enabled, f"batch {batch}: bucket {span} is {'on' if bucket.enabled else 'off'}"
    if decision:
        why += f"; controller: {decision}"
    return {"on": on, "why": why, "batch": batch, "decision_id": st.last_decision_id or None}


def _acceptance(d: inference_pb2.DraftAcceptance) -> dict:
    return {"draft_version": d.draft_version, "drafter": d.drafter, "verify_rows": d.verify_rows,
            "draft_tokens": d.draft_tokens, "accepted_tokens": d.accepted_tokens,
            "accept_length": _r((d.accepted_tokens + d.verify_rows) / d.verify_rows) if d.verify_rows else None,
            "acceptance_rate": _r(d.accepted_tokens / d.draft_tokens) if d.draft_tokens else None,
            "last_unix_s": d.last_unix_s}


def _gamma(g: inference_pb2.GammaBucket) -> dict:
    return {"min_batch": g.min_batch, "max_batch": g.max_batch, "steps": g.steps,
            "speculative_steps": g.speculative_steps,
            "mean_gamma": _r(g.gamma_sum / g.speculative_rows, 3) if g.speculative_rows else 0.0,
            "last_gamma": g.last_gamma, "gamma_sum": g.gamma_sum, "speculative_rows": g.speculative_rows}


def worker_view(name: str, address: str, healthy: bool, st: inference_pb2.WorkerStatus | None, error: str | None,
                reasons: dict[str, str]) -> dict:
    out: dict = {"name": name, "address": address, "healthy": healthy, "available": st is not None}
    if st is None:
        out["error"] = error
        return out
    live = st.live
    out.update(
        worker_id=st.worker_id, model_id=st.model_id, device=st.device, engine=st.engine,
        running=st.running_requests, waiting=st.waiting_requests, max_batch=st.max_batch_size,
        max_model_len=st.max_model_len, load=_r(st.load),
        kv_cache_usage=_r(st.kv_cache_usage), tokens_per_s=_r(live.tokens_per_s, 2), tokens_total=live.tokens_total,
        steps_total=live.steps_total, drafter=st.drafter, draft_version=st.draft_version,
        registry_draft_version=st.registry_draft_version, wanted_draft_version=st.wanted_draft_version,
        gamma_policy=_policy(st.gamma_policy), schedule=_schedule(st.speculation),
        speculation=_speculating(st, reasons), collection_enabled=st.collection_enabled,
        acceptance=[_acceptance(d) for d in live.drafts], gamma=[_gamma(g) for g in live.gamma],
        draft_refusals=[{"version": r.version, "reason": r.reason, "detail": r.detail, "time_unix_s": r.time_unix_s}
                        for r in st.draft_refusals],
        uptime_s=_r(st.uptime_s, 1),
        memory={"rss_bytes": st.memory.rss_bytes or None, "weights_bytes": st.memory.weights_bytes,
                "kv_cache_bytes": st.memory.kv_cache_bytes,
                "kv_cache_resident_bytes": st.memory.kv_cache_resident_bytes, "draft_bytes": st.memory.draft_bytes,
                "speculation_memory_bytes": st.memory.speculation_memory_bytes,
                "speculation_memory_budget_bytes": st.memory.speculation_memory_budget_bytes,
                "speculation_memory_tokens": st.memory.speculation_memory_tokens})
    return out


# ------------------------------------------------------------------------------------ services


def controller_view(state: controller_pb2.ControllerState, target: str) -> dict:
    targets = [t for t in state.targets if not target or t.target_model == target] or list(state.targets)
    t = targets[0] if targets else None
    decisions = [_decision(r) for r in state.recent_decisions[:RECENT_DECISIONS]]
    out: dict = {"available": True, "target_model": t.target_model if t else None,
                 "last_decision": decisions[0] if decisions else None, "recent_decisions": decisions,
                 "workers": [{"worker_id": w.worker_id, "address": w.address, "last_seen_unix_s": w.last_seen_unix_s,
                              "last_decision_id": w.last_decision_id} for w in state.workers]}
    if t is None:
        return {**out, "draft_version": None, "drafts": [], "collection": None, "schedule": [], "gamma_policy": None,
                "rollback": None, "draft_refusals": []}
    c, rb = t.collection, t.rollback
    out.update(
        draft_version=t.draft_version,
        drafts=[{"draft_version": d.draft_version, "accept_length_short": _r(d.accept_length_ema_short),
                 "accept_length_long": _r(d.accept_length_ema_long),
                 "acceptance_rate_short": _r(d.acceptance_rate_ema_short),
                 "acceptance_rate_long": _r(d.acceptance_rate_ema_long), "verify_steps": d.verify_steps,
                 "tokens": d.tokens, "last_update_unix_s": d.last_update_unix_s} for d in t.drafts],
        collection={"enabled": c.enabled, "reason": c.reason, "tokens_collected": c.tokens_collected,
                    "tokens_needed": c.tokens_needed, "since_unix_s": c.since_unix_s or None},
        schedule=_schedule(t.speculation), gamma_policy=_policy(t.gamma_policy) if t.gamma_policy.name else None,
        rollback={"enabled": rb.enabled, "watching_version": rb.watching_version or None,
                  "previous_version": rb.previous_version or None, "verify_steps": rb.verify_steps,
                  "window": rb.window, "last": _rollback(rb.last) if rb.HasField("last") else None},
        draft_refusals=[{"worker_id": r.worker_id, "version": r.version, "reason": r.reason, "outcome": r.outcome,
                         "to_version": r.to_version or None, "time_unix_s": r.time_unix_s}
                        for r in t.draft_refusals],
        last_training=_outcome(t.last_training) if t.HasField("last_training") and t.last_training.run_id else None)
    return out


def _rollback(r: controller_pb2.RollbackRecord) -> dict:
    return {"from_version": r.from_version, "to_version": r.to_version, "reason": r.reason,
            "live_acceptance_rate": _r(r.live_acceptance_rate),
            "previous_acceptance_rate": _r(r.previous_acceptance_rate), "time_unix_s": r.time_unix_s}


def _decision(r: controller_pb2.DecisionRecord) -> dict:
    d = r.decision
    return {"decision_id": d.decision_id, "reason": d.reason, "issued_unix_s": d.issued_unix_s,
            "schedule": _schedule(d.speculation) if d.HasField("speculation") else None,
            "gamma_policy": _policy(d.gamma_policy) if d.HasField("gamma_policy") else None,
            "collection_enabled": d.collection_enabled if d.HasField("collection_enabled") else None,
            "drafter": d.drafter if d.HasField("drafter") else None,
            "applied_to": list(r.applied_to), "failed": list(r.failed)}


def _outcome(o: trainer_pb2.TrainingOutcome) -> dict:
    return {"run_id": o.run_id, "candidate_version": o.candidate_version or None,
            "base_version": o.base_version or None, "train_tokens": o.train_tokens, "eval_tokens": o.eval_tokens,
            "duration_s": _r(o.duration_s, 1), "eval_before": _r(o.eval_accept_length_base),
            "eval_after": _r(o.eval_accept_length_candidate), "promoted": o.promoted, "detail": o.detail,
            "time_unix_s": o.finished_unix_s}


def trainer_view(st: trainer_pb2.TrainerStatus) -> dict:
    return {"available": True, "state": _TRAINER_STATES.get(st.state, "unknown"), "run_id": st.run_id or None,
            "target_model": st.target_model or None, "progress": _r(st.progress), "loss": _r(st.loss),
            "buffered_chunks": st.buffered_chunks, "buffered_tokens": st.buffered_tokens,
            "chunks_consumed": st.chunks_consumed, "chunks_deduplicated": st.chunks_deduplicated,
            "chunks_dead_lettered": st.chunks_dead_lettered,
            # the governed store (docs/data-handling.md): deletions by reason, quarantine, bytes vs budget
            "data": {"chunks_deleted": dict(sorted(st.chunks_deleted.items())),
                     "chunk_bytes_deleted": st.chunk_bytes_deleted, "chunks_quarantined": st.chunks_quarantined,
                     "bucket_chunk_bytes": st.bucket_chunk_bytes, "bucket_budget_bytes": st.bucket_budget_bytes,
                     "stream_entries_trimmed": st.stream_entries_trimmed},
            "last_outcome": _outcome(st.last_outcome) if st.last_outcome.run_id else None}


def opt_out_view(decisions: Counter, since_unix_s: float) -> dict:
    """What this gateway decided about training on the requests it served (X-TIDE-Training)."""
    excluded = {reason: n for reason, n in sorted(decisions.items()) if reason != "eligible"}
    return {"available": True, "since_unix_s": since_unix_s, "eligible": decisions.get("eligible", 0),
            "excluded": excluded, "excluded_total": sum(excluded.values())}


def _provenance(text: str) -> dict:
    try:
        p = json.loads(text or "{}")
        return p if isinstance(p, dict) else {}
    except ValueError:
        return {}


def registry_view(reply: registry_pb2.ListDraftsResponse, target: str) -> dict:
    p = reply.pointer
    versions = []
    for d in reversed(reply.drafts):  # most recent first
        prov = _provenance(d.provenance_json)
        train = prov.get("train") if isinstance(prov.get("train"), dict) else {}
        versions.append({"version": d.version, "parent_version": d.parent_version or None, "drafter": d.drafter,
                         "created_unix_s": d.created_unix_s,
                         "eval_metrics": {k: _r(v) for k, v in sorted(d.eval_metrics.items())},
                         "run_id": prov.get("run_id") if isinstance(prov.get("run_id"), str) else None,
                         "train_seconds": train.get("seconds"),
                         "current": d.version == p.current, "pinned": d.version == p.pinned,
                         "effective": d.version == p.effective})
    return {"available": True, "target_model": target,
            "pointer": {"current": p.current or None, "pinned": p.pinned or None, "effective": p.effective or None,
                        "is_pinned": bool(p.pinned), "previous": list(p.previous), "generation": p.generation},
            "events": [{"action": _POINTER_ACTIONS.get(e.action, "unknown"), "from_version": e.from_version or None,
                        "to_version": e.to_version or None, "reason": e.reason, "actor": e.actor,
                        "time_unix_s": e.time_unix_s} for e in p.history],
            "versions": versions}


def training_view(registry: dict, controller: dict, trainer: dict, memory: TrainingMemory | None) -> dict:
    """Training cycles (trainer / controller outcomes seen, and the registry's trained versions) and the
    timeline of cycles, promotions, rollbacks and pins, most recent first."""
    cycles: dict[str, dict] = {}
    for v in reversed(registry.get("versions") or []):  # registered candidates: their eval metrics and provenance
        m = v["eval_metrics"]
        if v["run_id"] and "accept_length" in m:
            cycles[v["run_id"]] = {
                "run_id": v["run_id"], "candidate_version": v["version"], "base_version": v["parent_version"],
                "train_tokens": int(m.get("train_tokens", 0)), "eval_tokens": int(m.get("eval_tokens", 0)),
                "duration_s": v["train_seconds"], "eval_before": m.get("accept_length_base"),
                "eval_after": m.get("accept_length"), "promoted": None, "detail": "",
                "time_unix_s": v["created_unix_s"]}
    seen = [o for o in (trainer.get("last_outcome"), controller.get("last_training")) if o]
    if memory is not None:
        for o in seen:
            memory.remember(o)
        seen = list(memory.cycles.values())
    for o in seen:  # the trainer's own account wins (promoted, duration of the whole cycle, detail)
        cycles[o["run_id"]] = {**cycles.get(o["run_id"], {}), **o}
    promoted = {e["to_version"] for e in registry.get("events") or [] if e["action"] == "promote"}
    for c in cycles.values():
        if c.get("promoted") is None:
            c["promoted"] = c.get("candidate_version") in promoted
    timeline = [{"kind": "training", "time_unix_s": c["time_unix_s"], "version": c.get("candidate_version"),
                 "from_version": c.get("base_version"), "promoted": c["promoted"],
                 "reason": c.get("detail") or ""} for c in cycles.values()]
    timeline += [{"kind": e["action"], "time_unix_s": e["time_unix_s"], "version": e["to_version"],
                  "from_version": e["from_version"], "reason": e["reason"]} for e in registry.get("events") or []]
    rb = (controller.get("rollback") or {}).get("last")
    if rb and not any(t["kind"] == "rollback" and abs(t["time_unix_s"] - rb["time_unix_s"]) < 5 for t in timeline):
        timeline.append({"kind": "rollback", "time_unix_s": rb["time_unix_s"], "version": rb["to_version"],
                         "from_version": rb["from_version"], "reason": rb["reason"]})
    timeline.sort(key=lambda t: t["time_unix_s"] or 0, reverse=True)
    return {"cycles": sorted(cycles.values(), key=lambda c: c["time_unix_s"] or 0, reverse=True),
            "timeline": timeline,
            "promotions": sum(t["kind"] == "promote" for t in timeline),
            "rollbacks": sum(t["kind"] == "rollback" for t in timeline)}


def _down(error: str | None, configured: bool = True) -> dict:
    return {"available": False, "error": error if configured else "not configured"}


def _safe(view, *args, **kw) -> dict:
    """A view of one source; a source whose answer cannot be read shows as down, never fails the document."""
    try:
        return view(*args, **kw)
    except Exception as e:  # noqa: BLE001 - one bad source must not take the page down
        log.exception("status view failed", extra={"view": view.__name__})
        return _down(f"unreadable answer: {type(e).__name__}")


# ------------------------------------------------------------------------------------ the document


async def stack_status(sources: StatusSources, engine: EngineClient) -> dict:
    supervised = supervisor_view(sources.stack_state)
    probed = {name: addr for name, addr in sources.services.items() if addr}
    pool = engine.workers()
    target = next((w.model_id for w in pool if w.model_id), "")

    async def nothing():
        return None, "not configured"

    def ask(name: str, stub, method: str, request):
        addr = probed.get(name)
        return _ask(addr, stub, method, request) if addr else nothing()

    health_f = asyncio.gather(*(grpc_health(a) for a in probed.values()))
    workers_f = asyncio.gather(*(_ask(w.address, inference_pb2_grpc.InferenceServiceStub, "GetStatus",
                                      inference_pb2.GetWorkerStatusRequest()) for w in pool))
    ctl_f = ask("controller", controller_pb2_grpc.ControllerServiceStub, "GetState",
                controller_pb2.GetControllerStateRequest(target_model=target, max_decisions=RECENT_DECISIONS))
    trainer_f = ask("trainer", trainer_pb2_grpc.TrainerServiceStub, "GetStatus", trainer_pb2.GetTrainerStatusRequest())

    def registry_f(target: str):
        return ask("registry", registry_pb2_grpc.RegistryServiceStub, "ListDrafts",
                   registry_pb2.ListDraftsRequest(target_model=target))

    if target:
        health, statuses, (ctl, ctl_err), (tr, tr_err), (reg, reg_err) = await asyncio.gather(
            health_f, workers_f, ctl_f, trainer_f, registry_f(target))
    else:
        health, statuses, (ctl, ctl_err), (tr, tr_err) = await asyncio.gather(health_f, workers_f, ctl_f, trainer_f)
        target = next((st.model_id for st, _ in statuses if st is not None and st.model_id), "") or \
            (ctl.targets[0].target_model if ctl is not None and ctl.targets else "") or \
            (tr.target_model if tr is not None else "")
        reg, reg_err = await registry_f(target) if target else (None, "no target known yet")
    healthy = dict(zip(probed, health, strict=True))

    services: dict[str, dict] = {}
    for name, addr in probed.items():
        services[name] = {"address": addr, "healthy": healthy[name]}
    for i, w in enumerate(pool):
        services[f"inference-{i}"] = {"address": w.address, "healthy": w.healthy}
    for name, s in supervised.items():
        entry = services.setdefault(name, {"address": None, "healthy": s.get("state") == "ready"})
        entry.update(state=s.get("state"), restarts=s.get("restarts"), last_exit=s.get("last_exit"))
        if s.get("pid"):  # tide up's processes run on this machine: their resident memory
            entry["rss_bytes"] = rss_bytes(s["pid"])
    for entry in services.values():
        entry.setdefault("state", "ready" if entry["healthy"] else "unreachable")
        entry.setdefault("restarts", None)
    degraded = sorted(n for n, e in services.items() if not e["healthy"] or e["state"] != "ready")

    controller = _safe(controller_view, ctl, target) if ctl is not None else _down(ctl_err, "controller" in probed)
    reasons = {d["decision_id"]: d["reason"] for d in controller.get("recent_decisions") or []}
    workers = [_safe(worker_view, f"inference-{i}", w.address, w.healthy, st, err, reasons)
               for i, (w, (st, err)) in enumerate(zip(pool, statuses, strict=True))]
    trainer = _safe(trainer_view, tr) if tr is not None else _down(tr_err, "trainer" in probed)
    registry = _safe(registry_view, reg, target) if reg is not None else _down(reg_err, "registry" in probed)
    training = _safe(training_view, registry, controller, trainer, sources.memory)
    up = [w for w in workers if w["available"]]
    rss = [e["rss_bytes"] for e in services.values() if e.get("rss_bytes")]
    return {"status": "degraded" if degraded else "ok", "degraded": degraded, "serving": engine.is_ready(),
            "services": services, "supervised": bool(supervised), "time_unix_s": time.time(),
            "rss_bytes": sum(rss) if rss else None,  # all of tide up's processes (None: not known here)
            "target_model": target or None,
            "fleet": {"workers": len(workers), "available": len(up),
                      "tokens_per_s": _r(sum(w["tokens_per_s"] for w in up), 2),
                      "running": sum(w["running"] for w in up), "waiting": sum(w["waiting"] for w in up)},
            "workers": workers, "controller": controller, "registry": registry, "trainer": trainer,
            "training": training, "opt_out": opt_out_view(sources.training_decisions, sources.started_unix_s),
            "backlog": {"available": trainer["available"], "buffered_chunks": trainer.get("buffered_chunks"),
                        "buffered_tokens": trainer.get("buffered_tokens"),
                        "dead_letters": trainer.get("chunks_dead_lettered")}}

"""The live half of `tide bench adapt`: talking to a running stack (tools.launcher.Stack).

- `Gateway`: one OpenAI-API request over real HTTP (httpx), greedy; returns the request record
  fields of adapt_stats (completion tokens from `usage`, acceptance from `speculation`).
- `drive`: `concurrency` closed-loop clients; each sends the next prompt of the phase the clock is
  in, waits for the answer, repeats until the last phase ends (in-flight requests then finish).
- `Poller`: every `every_s` seconds, one sample of the loop's state: the workers' draft version and
  collection flag (GetStatus), the controller's collection state and the serving version's short
  acceptance EMA (GetState), the trainer's state and buffered tokens (GetStatus), chunk bytes the
  workers wrote (their Prometheus counter), the first worker's γ-policy estimates (α̂, κ corrections:
  `policy_estimates`), the registry pointer's history; trainer outcomes are
  kept by run_id (from the controller's last_training and the trainer's last_outcome).
- `start_draft`: register + promote a checkpoint directory in the stack's registry and wait until
  every worker serves it. `set_collection` flips collection on every worker by an admin decision.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tide import grpcutil
from tide.blobs import StorageSettings
from tide.prompts import Prompt
from tide.proto.tide.v1 import (
    controller_pb2,
    controller_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    registry_pb2,
    trainer_pb2,
    trainer_pb2_grpc,
)
from tide.registry_client import RegistryClient
from tide.resources import cpu_seconds
from tools.launcher import BUCKET, Endpoints, Stack, service_env

ACTOR = "bench-adapt"
RPC_TIMEOUT_S = 5.0
_ACCEPTED_TOKENS = re.compile(r"^tide_trainer_accepted_tokens_total\s+([0-9.eE+]+)", re.M)
_CHUNK_BYTES = re.compile(r"^tide_chunk_bytes_written_total(?:\{[^}]*\})?\s+([0-9.eE+]+)", re.M)


class Gateway:
    """One client connection to the gateway; `ask` never raises (errors go in the record)."""

    def __init__(self, base_url: str, model: str, max_tokens: int, timeout_s: float = 900.0) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=timeout_s)
        self.model, self.max_tokens = model, max_tokens

    def close(self) -> None:
        self.http.close()

    def ask(self, prompt: Prompt, workload: str, max_tokens: int | None = None) -> dict:
        body = {"model": self.model, "max_tokens": max_tokens or self.max_tokens, "temperature": 0.0,
                "workload": workload}
        if prompt.chat:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt.text}]
        else:  # HumanEval: raw code completion
            path, body["prompt"] = "/v1/completions", prompt.text
        rec = {"tokens": 0, "accept_length": 0.0, "verify_steps": 0, "draft_version": "", "error": ""}
        try:
            r = self.http.post(path, json=body)
            if r.status_code != 200:
                return {**rec, "error": f"HTTP {r.status_code}: {r.text[:200]}"}
            j = r.json()
            sp = j.get("speculation") or {}
            return {**rec, "tokens": int(j["usage"]["completion_tokens"]),
                    "accept_length": float(sp.get("accept_length", 0)), "verify_steps": int(sp.get("verify_steps", 0)),
                    "draft_version": sp.get("draft_version", "")}
        except Exception as e:  # transport errors, a malformed body: the client thread keeps going
            return {**rec, "error": f"{type(e).__name__}: {e}"[:300]}


def phase_at(bounds: Sequence[tuple[str, float, float]], t: float) -> int:
    return next((i for i, (_, a, b) in enumerate(bounds) if a <= t < b), len(bounds) - 1)


def drive(new_gateway: Callable[[], Gateway], prompts: Sequence[Sequence[Prompt]],
          bounds: Sequence[tuple[str, float, float]], concurrency: int, clock: Callable[[], float],
          progress: Callable[[str], None] = print) -> list[dict]:
    """Closed-loop load until bounds[-1] ends; the request records (adapt_stats), by send time."""
    end, lock, records = bounds[-1][2], threading.Lock(), []
    counters = [0] * len(bounds)

    def client() -> None:
        gw = new_gateway()
        try:
            while (t0 := clock()) < end:
                ph = phase_at(bounds, t0)
                with lock:
                    k, counters[ph] = counters[ph], counters[ph] + 1
                rec = gw.ask(prompts[ph][k % len(prompts[ph])], workload=bounds[ph][0])
                with lock:
                    records.append({"t0": round(t0, 3), "t1": round(clock(), 3), "phase": ph, **rec})
        finally:
            gw.close()

    threads = [threading.Thread(target=client, name=f"client-{i}", daemon=True) for i in range(concurrency)]
    for th in threads:
        th.start()
    shown = -1
    while any(th.is_alive() for th in threads):
        time.sleep(1.0)
        if (ph := phase_at(bounds, clock())) != shown and clock() < end:
            shown = ph
            progress(f"  phase {bounds[ph][0]} ({bounds[ph][1]:.0f}-{bounds[ph][2]:.0f} s)")
    return sorted(records, key=lambda r: r["t0"])


def run_batch(new_gateway: Callable[[], Gateway], items: Sequence[tuple[Prompt, str]], concurrency: int) -> list[dict]:
    """Every (prompt, workload) once, `concurrency` at a time; the answers in order."""
    local = threading.local()
    made: list[Gateway] = []

    def one(item):
        if not hasattr(local, "gw"):
            local.gw = new_gateway()
            made.append(local.gw)
        return local.gw.ask(*item)

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(one, items))
    finally:
        for gw in made:
            gw.close()


# ------------------------------------------------------------------------------------ gRPC side


def _stub(make, address: str, ep: Endpoints):
    return make(grpcutil.channel(address, token=ep.admin_token, actor=ACTOR))


def worker_status(ep: Endpoints, address: str) -> inference_pb2.WorkerStatus:
    stub = _stub(inference_pb2_grpc.InferenceServiceStub, address, ep)
    return stub.GetStatus(inference_pb2.GetWorkerStatusRequest(), timeout=RPC_TIMEOUT_S)


def set_collection(ep: Endpoints, model_id: str, on: bool) -> None:
    """Collection on/off on every worker (an admin decision, as the controller would push)."""
    for address in ep.workers:
        stub = _stub(inference_pb2_grpc.InferenceServiceStub, address, ep)
        d = inference_pb2.Decision(decision_id=f"bench-adapt-{uuid.uuid4().hex[:12]}", target_model=model_id,
                                   collection_enabled=on, reason="tide bench adapt: collection A/B",
                                   issued_unix_s=time.time())
        r = stub.ApplyDecision(d, timeout=RPC_TIMEOUT_S * 6)
        if r.outcome == inference_pb2.ApplyDecisionResponse.OUTCOME_REJECTED:
            raise RuntimeError(f"worker {address} rejected collection={on}: {r.detail}")


def start_draft(stack: Stack, ep: Endpoints, model_id: str, draft_dir: Path, timeout_s: float = 300.0) -> str:
    """Register `draft_dir` in the stack's registry, promote it, wait until every worker runs it."""
    s3 = StorageSettings.from_env(service_env("registry", stack.cfg, ep)).s3_client()
    with RegistryClient(ep.registry, token=ep.admin_token, actor=ACTOR) as reg:
        v = reg.register_dir(draft_dir, model_id, s3=s3, bucket=BUCKET,
                             provenance={"source": "tide bench adapt: starting draft", "path": str(draft_dir)}).version
        reg.promote(v, model_id, reason="tide bench adapt: starting draft")
    deadline = time.monotonic() + timeout_s
    while any(worker_status(ep, a).draft_version != v for a in ep.workers):
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers did not load the starting draft {v} within {timeout_s:.0f} s")
        time.sleep(0.5)
    return v


def fetch_drafts(stack: Stack, ep: Endpoints, model_id: str, dest: Path) -> list[dict]:
    """Every draft version registered for `model_id` (each training cycle's candidate, promoted or
    not) downloaded into `dest` (tide.registry_client.fetch_version's layout, as a worker's draft
    cache); their versions, creation times and parents, oldest first."""
    from tide.registry_client import fetch_version

    s3 = StorageSettings.from_env(service_env("registry", stack.cfg, ep)).s3_client()
    out = []
    with RegistryClient(ep.registry, token=ep.admin_token, actor=ACTOR) as reg:
        for d in sorted(reg.list(model_id).drafts, key=lambda d: d.created_unix_s):
            fetch_version(s3, d.version, d.artifact, dest)
            out.append({"version": d.version, "created_unix_s": d.created_unix_s, "parent": d.parent_version,
                        "eval_metrics": dict(d.eval_metrics)})
    return out


def _scrape(port: int) -> str | None:
    """A worker's /metrics text; None without a port or when it does not answer."""
    if not port:
        return None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=RPC_TIMEOUT_S) as r:
            return r.read().decode()
    except OSError:
        return None


def _chunk_bytes(text: str | None) -> float | None:
    if text is None:
        return None
    m = _CHUNK_BYTES.search(text)
    return float(m.group(1)) if m else 0.0


def policy_estimates(text: str | None) -> dict[str, float]:
    """The γ policy's estimates in a /metrics text (tide_inference_policy_estimate), keyed
    "name" or "name[scope]", e.g. "alpha_global", "kappa_draft[batch=2]"."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text or ""):
        if family.name == "tide_inference_policy_estimate":
            for smp in family.samples:
                scope = smp.labels.get("scope", "")
                out[smp.labels["name"] + (f"[{scope}]" if scope else "")] = round(smp.value, 4)
    return out


def _worker_metrics(ep: Endpoints) -> list[str | None]:
    return [_scrape(ep.metrics.get(f"inference-{i}", 0)) for i in range(len(ep.workers))]


def trainer_accepted_tokens(ep: Endpoints) -> int | None:
    """Tokens of the chunks the trainer accepted so far (its tide_trainer_accepted_tokens counter)."""
    m = _ACCEPTED_TOKENS.search(_scrape(ep.metrics.get("trainer", 0)) or "")
    return int(float(m.group(1))) if m else None


def chunk_bytes(ep: Endpoints, texts: list[str | None] | None = None) -> int | None:
    """Chunk bytes all workers wrote so far (their tide_chunk_bytes_written counters); None: unreadable.
    `texts`: the workers' /metrics already scraped (else scraped now)."""
    got = [_chunk_bytes(t) for t in (_worker_metrics(ep) if texts is None else texts)]
    return None if not got or None in got else int(sum(got))


def _outcome(msg) -> dict | None:
    """A TrainingOutcome (all scalar fields) as a dict; None when unset (no run yet)."""
    d = {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}
    return d if d.get("run_id") else None


class Poller(threading.Thread):
    """Samples the loop's state every `every_s` s until `stop()` (see the module doc)."""

    def __init__(self, ep: Endpoints, model_id: str, clock: Callable[[], float], every_s: float = 2.0,
                 cpu_pids: dict[str, int] | None = None) -> None:
        """`cpu_pids`: processes whose CPU-seconds so far each sample records (`cpu_s`, by name)."""
        super().__init__(name="bench-adapt-poller", daemon=True)
        self.ep, self.model_id, self.clock, self.every_s = ep, model_id, clock, every_s
        self.cpu_pids = dict(cpu_pids or {})
        self.samples: list[dict] = []
        self.outcomes: dict[str, dict] = {}  # run_id -> TrainingOutcome as a dict
        self.events: dict[tuple, dict] = {}  # registry pointer events, deduplicated
        self.drafts: dict[str, dict] = {}  # version -> eval_metrics
        self._stop_event = threading.Event()
        self.worker_stubs = [_stub(inference_pb2_grpc.InferenceServiceStub, a, ep) for a in ep.workers]
        self.controller = _stub(controller_pb2_grpc.ControllerServiceStub, ep.controller, ep)
        self.trainer = _stub(trainer_pb2_grpc.TrainerServiceStub, ep.trainer, ep)
        self.registry = RegistryClient(ep.registry, token=ep.admin_token, actor=ACTOR, timeout_s=RPC_TIMEOUT_S)

    def run(self) -> None:
        while not self._stop_event.is_set():
            t = time.monotonic()
            self.samples.append(self.sample())
            self._stop_event.wait(max(0.0, self.every_s - (time.monotonic() - t)))

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)
        self.samples.append(self.sample())  # the final state (chunk bytes, outcomes)
        self.registry.close()

    def sample(self) -> dict:
        s: dict = {"t": round(self.clock(), 2)}
        if self.cpu_pids:
            s["cpu_s"] = {name: cpu_seconds(pid) for name, pid in self.cpu_pids.items()}
        try:
            req = inference_pb2.GetWorkerStatusRequest()
            sts = [w.GetStatus(req, timeout=RPC_TIMEOUT_S) for w in self.worker_stubs]
            s["draft_version"] = ",".join(sorted({st.draft_version for st in sts}))
            s["collection"] = any(st.collection_enabled for st in sts)
            s["running"] = sum(st.running_requests for st in sts)
            s["rss_bytes"] = sum(st.memory.rss_bytes for st in sts)
            if any(st.memory.speculation_memory_budget_bytes for st in sts):  # the memory's bound, reported
                s["speculation_memory"] = [{"bytes": st.memory.speculation_memory_bytes,
                                            "budget_bytes": st.memory.speculation_memory_budget_bytes,
                                            "tokens": st.memory.speculation_memory_tokens} for st in sts]
        except Exception as e:  # a busy or restarting worker: the sample says so
            s["worker_error"] = type(e).__name__
        try:
            st = self.controller.GetState(controller_pb2.GetControllerStateRequest(target_model=self.model_id,
                                                                                   max_decisions=1),
                                          timeout=RPC_TIMEOUT_S)
            tgt = next((x for x in st.targets if x.target_model == self.model_id), None)
            if tgt is not None:
                c = tgt.collection
                s.update(controller_collection=c.enabled, collection_reason=c.reason,
                         tokens_collected=c.tokens_collected, tokens_needed=c.tokens_needed)
                ds = next((d for d in tgt.drafts if d.draft_version == tgt.draft_version), None)
                s["ema_short"] = round(ds.accept_length_ema_short, 4) if ds else None
                s["ema_long"] = round(ds.accept_length_ema_long, 4) if ds else None
                if (o := _outcome(tgt.last_training)) is not None:
                    self.outcomes[o["run_id"]] = o
        except Exception as e:
            s["controller_error"] = type(e).__name__
        try:
            tr = self.trainer.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=RPC_TIMEOUT_S)
            s.update(trainer_state=trainer_pb2.TrainerStatus.State.Name(tr.state).removeprefix("STATE_").lower(),
                     buffered_tokens=tr.buffered_tokens, chunks_consumed=tr.chunks_consumed)
            if (o := _outcome(tr.last_outcome)) is not None:
                self.outcomes.setdefault(o["run_id"], o)
        except Exception as e:
            s["trainer_error"] = type(e).__name__
        try:
            lst = self.registry.list(self.model_id)
            for d in lst.drafts:
                self.drafts[d.version] = dict(d.eval_metrics)
            for ev in lst.pointer.history:
                action = registry_pb2.PointerAction.Name(ev.action).removeprefix("POINTER_ACTION_").lower()
                self.events[(ev.time_unix_s, ev.to_version, action)] = {
                    "action": action, "from_version": ev.from_version, "to_version": ev.to_version,
                    "reason": ev.reason, "actor": ev.actor, "time_unix_s": ev.time_unix_s}
        except Exception as e:
            s["registry_error"] = type(e).__name__
        texts = _worker_metrics(self.ep)
        s["chunk_bytes"] = chunk_bytes(self.ep, texts)
        s["policy"] = policy_estimates(texts[0]) if texts else {}  # the first worker's γ policy
        return s

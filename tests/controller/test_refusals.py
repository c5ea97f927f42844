"""One truth about drafts: a worker that refuses the draft the registry names effective for its
target (checksum mismatch, missing file, ...) reports it in its status, and the controller rolls the
registry's pointer back to the version the fleet serves, once, saying why (GetState, logs, metric,
the pointer's history). A refusal of a version that is not effective changes nothing.

First without transport (the controller's domain with worker and registry doubles), then end to end:
a real worker (in process, real Redis and S3) watching a real registry, and the controller in process."""

from __future__ import annotations

import dataclasses
import io
import time

import pytest
import torch
from controller.svc import ADMIN_TOKEN, FakeRegistry, wait_for
from inference.service.test_drafts import fitting, register
from prometheus_client import CollectorRegistry, generate_latest
from registry.harness import start_registry
from support.engine import save_tiny_target

from services.controller.app import Controller
from services.controller.app import build as build_controller
from services.controller.decisions import StaticDecision
from services.controller.fleet import DraftRefusal, PushResult, WorkerSnapshot
from services.controller.metrics import ControllerCollector
from services.controller.outcomes import TrainingOutcome
from services.controller.refusals import REFUSAL_REASON_PREFIX, RefusalResolver
from services.controller.rollback import RegistryUnavailable, RollbackGuard
from services.controller.server import ControllerServicer
from services.controller.settings import ControllerSettings
from services.controller.stats import FleetStats
from services.controller.workers import snapshot_from_pb
from services.inference.app import build as build_worker
from services.inference.settings import InferenceSettings
from tide.blobs import StorageSettings
from tide.engine.llama import LlamaModel
from tide.grpcutil import channel
from tide.proto.tide.v1 import controller_pb2, controller_pb2_grpc, inference_pb2, inference_pb2_grpc, registry_pb2
from tools.admin import render

# ------------------------------------------------------------------------------ without transport


class Workers:
    """Worker client double: a status per address; decisions are applied."""

    def __init__(self) -> None:
        self.state: dict[str, WorkerSnapshot] = {}

    def status(self, address):
        return self.state[address]

    def apply(self, address, decision):
        self.state[address] = dataclasses.replace(self.state[address], last_decision_id=decision.decision_id)
        return PushResult("applied", "")


def refused(version: str, reason: str = "checksum") -> DraftRefusal:
    return DraftRefusal(version, reason, f"checksum mismatch for s3://b/{version}/model.safetensors", 100.0)


def snapshot(worker_id: str, serving: str, wanted: str, *refusals: DraftRefusal, target: str = "m"):
    return WorkerSnapshot(worker_id, target, "", 10.0, registry_draft_version=serving, wanted_draft_version=wanted,
                          draft_refusals=tuple(refusals))


class Setup:
    def __init__(self, registry: FakeRegistry | None) -> None:
        self.workers = Workers()
        self.ctl = Controller(StaticDecision(), FleetStats(), client=self.workers,
                              rollback=RollbackGuard(registry, window=20),
                              refusals=RefusalResolver(registry), clock=lambda: 5.0)

    def worker(self, address: str, snap: WorkerSnapshot) -> None:
        self.workers.state[address] = snap
        self.ctl.fleet.add(address, configured=True)

    def rounds(self, n: int = 1) -> None:
        for _ in range(n):  # as the reconciler: evaluate, then read the workers
            self.ctl.evaluate()
            self.ctl.fleet.reconcile()

    @property
    def resolver(self) -> RefusalResolver:
        return self.ctl.refusals


def test_a_refusal_of_the_effective_version_rolls_the_pointer_back_to_what_the_worker_serves():
    reg = FakeRegistry(current="v2")
    s = Setup(reg)
    s.worker("h:1", snapshot("w1", "v1", "v2", refused("v2")))
    s.rounds(2)
    ((target, to_version, reason),) = reg.calls
    assert (target, to_version) == ("m", "v1") and reg.current == "v1"
    assert reason.startswith(f"{REFUSAL_REASON_PREFIX}: w1 refused v2 (checksum: checksum mismatch for s3://b/v2/")
    assert reason.endswith("; back to v1, which the fleet serves")
    (rec,) = s.resolver.records("m")
    assert (rec.worker_id, rec.version, rec.reason, rec.outcome, rec.to_version) == ("w1", "v2", "checksum",
                                                                                     "rolled_back", "v1")
    assert rec.note == reason and rec.refused_unix_s == 100.0 and rec.time_unix_s == 5.0
    assert s.resolver.counts() == {("m", "checksum", "rolled_back"): 1}
    s.rounds(3)  # the worker still reports the refusal (and, slow to hear, still wants v2): no second rollback
    reg.current, reg.previous = "v2", ["v1"]  # someone promotes the refused version again: not fought over
    s.rounds(3)
    assert len(reg.calls) == 1 and len(s.resolver.records("m")) == 1


def test_a_refusal_of_a_version_that_is_not_effective_changes_nothing():
    reg = FakeRegistry(current="v3", previous=("v2", "v1"))
    s = Setup(reg)
    s.worker("h:1", snapshot("w1", "v3", "v3", refused("v2")))  # refused v2, then v3 came and serves
    s.rounds(3)
    assert reg.calls == [] and reg.reads == 0 and s.resolver.records("m") == []
    # a worker that has not heard of v3 yet still wants v2: the registry says otherwise, nothing happens
    s.worker("h:2", snapshot("w2", "v1", "v2", refused("v2")))
    s.rounds(3)
    assert reg.calls == [] and reg.current == "v3" and s.resolver.records("m") == []
    assert s.resolver.counts() == {}


def test_a_pinned_refused_version_is_left_and_the_conflict_recorded_once():
    reg = FakeRegistry(current="v2", pinned="v2")
    s = Setup(reg)
    s.worker("h:1", snapshot("w1", "v1", "v2", refused("v2")))
    s.rounds(4)
    assert reg.calls == [] and (reg.current, reg.pinned) == ("v2", "v2")
    (rec,) = s.resolver.records("m")
    assert rec.outcome == "pinned" and rec.to_version == "" and "pinned" in rec.note
    assert s.resolver.counts() == {("m", "checksum", "pinned"): 1}


def test_registry_errors_retry_or_give_up():
    reg = FakeRegistry(current="v2")
    reg.error = RegistryUnavailable("UNAVAILABLE: down")
    s = Setup(reg)
    s.worker("h:1", snapshot("w1", "v1", "v2", refused("v2", "missing")))
    s.rounds(3)
    assert reg.calls == [] and s.resolver.records("m") == [] and s.resolver.failures() == {"m": 2}
    reg.error = None  # back: the next round rolls back
    s.rounds(1)
    assert [c[:2] for c in reg.calls] == [("m", "v1")] and s.resolver.records("m")[0].reason == "missing"

    reg = FakeRegistry(current="v2", previous=())  # the registry has nothing to roll back to
    s = Setup(reg)
    s.worker("h:1", snapshot("w1", "v1", "v2", refused("v2")))
    s.rounds(3)
    (rec,) = s.resolver.records("m")
    assert rec.outcome == "registry_refused" and "not a previous current draft" in rec.note and reg.calls == []


def test_the_version_the_fleet_serves_when_the_refusing_worker_has_none():
    """A worker that never loaded a registry draft (the fallback serves) refuses the effective
    version: the pointer goes back to what the target's other workers serve; with no other worker
    there is nothing to roll back to (recorded, the pointer is left)."""
    reg = FakeRegistry(current="v2", previous=("v1",))
    s = Setup(reg)
    s.worker("h:1", snapshot("fresh", "", "v2", refused("v2")))
    s.worker("h:2", snapshot("old", "v1", "v1"))
    s.worker("h:3", snapshot("other-target", "x9", "x9", target="n"))
    s.rounds(2)
    assert [c[:2] for c in reg.calls] == [("m", "v1")]
    assert reg.calls[0][2].startswith(f"{REFUSAL_REASON_PREFIX}: fresh refused v2 (checksum")

    reg = FakeRegistry(current="v2")
    s = Setup(reg)
    s.worker("h:1", snapshot("fresh", "", "v2", refused("v2")))
    s.rounds(3)
    (rec,) = s.resolver.records("m")
    assert rec.outcome == "nothing_to_roll_back_to" and reg.calls == [] and reg.current == "v2"


def test_the_rollback_watch_of_a_refused_version_ends():
    """The trainer promoted v2 and reported it (a watch starts); no worker ever serves v2, so the watch
    would wait forever for observations: the refusal rollback ends it."""
    reg = FakeRegistry(current="v2")
    s = Setup(reg)
    s.ctl.report_outcome(TrainingOutcome("run-1", "m", "v2", "v1", 3.2, 3.0, promoted=True))
    assert s.ctl.rollback.watching("m").version == "v2"
    s.worker("h:1", snapshot("w1", "v1", "v2", refused("v2")))
    s.rounds(2)
    assert reg.current == "v1" and s.ctl.rollback.watching("m") is None


def test_disabled_without_a_registry():
    s = Setup(None)
    s.worker("h:1", snapshot("w1", "v1", "v2", refused("v2")))
    s.rounds(2)
    assert not s.resolver.enabled and s.resolver.records("m") == []


def test_status_conversion_and_get_state():
    pb = inference_pb2.WorkerStatus(
        worker_id="w1", model_id="m", last_decision_id="d", uptime_s=3.0, registry_draft_version="v1",
        wanted_draft_version="v2", draft_refusals=[inference_pb2.DraftRefusal(version="v2", reason="checksum",
                                                                             detail="bad", time_unix_s=7.0)])
    snap = snapshot_from_pb(pb)
    assert snap == WorkerSnapshot("w1", "m", "d", 3.0, "v1", "v2", (DraftRefusal("v2", "checksum", "bad", 7.0),))

    reg = FakeRegistry(current="v2")
    s = Setup(reg)
    s.worker("h:1", snap)
    s.rounds(2)
    state = ControllerServicer(s.ctl, lambda: None).GetState(
        controller_pb2.GetControllerStateRequest(target_model="m"), None)
    (rec,) = state.targets[0].draft_refusals
    assert (rec.worker_id, rec.version, rec.reason, rec.detail, rec.outcome, rec.to_version) == (
        "w1", "v2", "checksum", "bad", "rolled_back", "v1")
    assert rec.note == reg.calls[0][2] and rec.refused_unix_s == 7.0 and rec.time_unix_s == 5.0


def test_tidectl_marks_a_refused_version():
    reason = f"{REFUSAL_REASON_PREFIX}: w1 refused v2 (checksum: bad); back to v1, which the fleet serves"
    pointer = render.pointer_dict(registry_pb2.PointerState(
        target_model="m", current="v1", effective="v1", previous=[],
        history=[registry_pb2.PointerEvent(action=registry_pb2.POINTER_ACTION_ROLLBACK, from_version="v2",
                                           to_version="v1", reason=reason, actor="controller")]))
    assert render.states("v2", pointer) == ["refused"] and render.states("v1", pointer) == ["effective", "current"]
    assert "refused" in render.drafts_text([_draft("v1"), _draft("v2")], {"m": pointer}).splitlines()[2]
    assert render.REFUSAL_REASON_PREFIX == REFUSAL_REASON_PREFIX  # tidectl does not import the controller


def _draft(version: str) -> dict:
    return render.draft_dict(registry_pb2.DraftVersion(version=version, target_model="m"))


# ---------------------------------------------------------------------------------- end to end

TARGET = "tiny-llama-0"  # the worker's model id (as tests/inference/service/test_drafts.py registers drafts)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> LlamaModel:
    return LlamaModel.load(save_tiny_target(tmp_path_factory.mktemp("refusals-target")), dtype=torch.float32)


@pytest.fixture
def registry(s3_client, s3_bucket):
    reg = start_registry(s3_client, s3_bucket, token=ADMIN_TOKEN, poll_s=0.05)
    yield reg
    reg.stop()


@pytest.fixture
def admin(registry):
    client = registry.client(token=ADMIN_TOKEN)
    yield client
    client.close()


@pytest.fixture
def storage(redis_server, s3_server, s3_bucket, unique_prefix) -> StorageSettings:
    return StorageSettings(s3_endpoint=s3_server.endpoint, s3_access_key=s3_server.access_key,
                           s3_secret_key=s3_server.secret_key, s3_bucket=s3_bucket, redis_url=redis_server.url,
                           stream_prefix=unique_prefix)


@pytest.fixture
def stack(tiny_model, registry, storage, tmp_path):
    """start_worker() -> a real worker serving TARGET with drafter eagle3, watching the registry;
    start_controller(worker) -> the controller, pushing to it and rolling back through the registry."""
    started = []

    def start_worker():
        svc = build_worker(InferenceSettings(
            target="tiny", dtype="fp32", max_batch=4, max_seq_len=256, max_tokens_per_step=64, max_queue=8,
            listen="127.0.0.1:0", metrics_port=0, worker_id="worker-r", telemetry_interval_s=0.05,
            telemetry_batch=8, flush_interval_s=0.3, chunk_tokens=64, admin_token=ADMIN_TOKEN, storage=storage,
            registry_addr=registry.address, draft_cache_dir=str(tmp_path / "cache"), drafter="eagle3"),
            model=tiny_model, tokenizer=None, model_id=TARGET)
        started.append(svc)
        return svc

    def start_controller(worker):
        svc = build_controller(ControllerSettings(
            listen="127.0.0.1:0", metrics_port=0, reconcile_s=0.2, consumer="c-refusals", admin_token=ADMIN_TOKEN,
            registry_addr=registry.address, workers=(worker.target,),
            storage=StorageSettings(redis_url=storage.redis_url, stream_prefix=storage.stream_prefix)))
        started.append(svc)
        return svc

    yield start_worker, start_controller
    for svc in reversed(started):
        svc.stop(grace_s=0.2)


def corrupt(admin, s3_client, version: str) -> None:
    """Change the stored weights of a registered version (its registered SHA-256 no longer matches)."""
    art = admin.get(version).artifact
    key = f"{art.prefix}/model.safetensors"
    data = s3_client.get_object(art.bucket, key).read()
    flipped = data[:-1] + bytes([data[-1] ^ 0xFF])
    s3_client.put_object(art.bucket, key, io.BytesIO(flipped), len(flipped))


def worker_status(worker) -> inference_pb2.WorkerStatus:
    stub = inference_pb2_grpc.InferenceServiceStub(channel(worker.target))
    return stub.GetStatus(inference_pb2.GetWorkerStatusRequest(), timeout=10)


def refusal_metrics(controller) -> dict[tuple[str, str], float]:
    metrics = CollectorRegistry()
    metrics.register(ControllerCollector(controller))
    text = generate_latest(metrics).decode()
    prefix = "tide_controller_draft_refusals_total{"
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix) and f'target="{TARGET}"' in line:
            labels = dict(p.split("=", 1) for p in line[len(prefix):line.index("}")].split(","))
            out[(labels["reason"].strip('"'), labels["outcome"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.timeout(90)
def test_a_refused_promotion_is_rolled_back_to_what_the_worker_serves(stack, registry, admin, tiny_model, s3_client,
                                                                     tmp_path):
    start_worker, start_controller = stack
    worker = start_worker()
    v1, v2 = (register(admin, registry, tmp_path, seed, fitting(tiny_model)) for seed in (21, 22))
    admin.promote(v1, TARGET, reason="bootstrap")
    wait_for(lambda: worker.drafts.version == v1, 10, "the worker to serve v1")
    controller = start_controller(worker)
    corrupt(admin, s3_client, v2)  # passed the registry's checks; then its stored bytes changed

    admin.promote(v2, TARGET, reason="training run run-9", expected_current=v1)
    pointer = wait_for(lambda: (p := admin.pointer(TARGET)).current == v1 and p, 20, "the rollback to v1")

    event = pointer.history[0]
    assert event.action == registry_pb2.POINTER_ACTION_ROLLBACK and pointer.effective == v1
    assert (event.from_version, event.to_version, event.actor) == (v2, v1, "controller")
    assert event.reason.startswith(f"{REFUSAL_REASON_PREFIX}: worker-r refused {v2} (checksum: checksum mismatch")
    st = worker_status(worker)  # what the worker told the controller
    assert st.registry_draft_version == v1 and st.draft_version == v1
    assert [(r.version, r.reason) for r in st.draft_refusals] == [(v2, "checksum")]
    assert "checksum mismatch" in st.draft_refusals[0].detail and st.draft_refusals[0].time_unix_s > 0
    wait_for(lambda: worker_status(worker).wanted_draft_version == v1, 5, "the worker to hear the rollback")

    cstub = controller_pb2_grpc.ControllerServiceStub(channel(controller.target))
    (target,) = cstub.GetState(controller_pb2.GetControllerStateRequest(target_model=TARGET), timeout=5).targets
    (rec,) = target.draft_refusals
    assert (rec.worker_id, rec.version, rec.reason, rec.outcome, rec.to_version) == (
        "worker-r", v2, "checksum", "rolled_back", v1)
    assert rec.note == event.reason and "checksum mismatch" in rec.detail
    assert refusal_metrics(controller) == {("checksum", "rolled_back"): 1.0}
    # tidectl drafts list: v1 effective, v2 marked refused
    p = render.pointer_dict(admin.pointer(TARGET))
    assert render.states(v1, p)[:2] == ["effective", "current"] and "refused" in render.states(v2, p)

    time.sleep(1.0)  # more rounds: one rollback per refused version
    history = admin.pointer(TARGET).history
    assert [e.action for e in history].count(registry_pb2.POINTER_ACTION_ROLLBACK) == 1
    assert admin.pointer(TARGET).current == v1 and worker.drafts.version == v1


@pytest.mark.timeout(90)
def test_a_refusal_of_a_version_no_longer_effective_changes_nothing(stack, registry, admin, tiny_model, s3_client,
                                                                   tmp_path):
    """The worker refused v2 while no controller ran; an operator then promoted v3, which it serves.
    The controller reads the refusal and leaves the registry alone."""
    start_worker, start_controller = stack
    worker = start_worker()
    v1, v2, v3 = (register(admin, registry, tmp_path, seed, fitting(tiny_model)) for seed in (23, 24, 25))
    admin.promote(v1, TARGET)
    wait_for(lambda: worker.drafts.version == v1, 10, "the worker to serve v1")
    corrupt(admin, s3_client, v2)
    admin.promote(v2, TARGET)
    wait_for(lambda: worker.drafts.refusals, 10, "the refusal of v2")
    admin.promote(v3, TARGET)
    wait_for(lambda: worker.drafts.version == v3, 10, "the worker to serve v3")
    before = admin.pointer(TARGET)

    controller = start_controller(worker)
    wait_for(lambda: [w for w in controller.controller.fleet.workers() if w.draft_refusals], 10,
             "the controller to read the worker's refusal")
    time.sleep(1.0)  # several rounds
    after = admin.pointer(TARGET)
    assert (after.current, after.generation) == (v3, before.generation)
    cstub = controller_pb2_grpc.ControllerServiceStub(channel(controller.target))
    (target,) = cstub.GetState(controller_pb2.GetControllerStateRequest(target_model=TARGET), timeout=5).targets
    assert list(target.draft_refusals) == [] and refusal_metrics(controller) == {}
    assert worker.drafts.version == v3


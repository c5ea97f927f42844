"""The controller's gRPC service in process, with real Redis: health, state, admin auth, the
telemetry consumer group (ack, dead-letter, reclaim of a dead consumer's pending entry), and
collection control driven by telemetry and training outcomes (GetState, decisions, metrics)."""

from __future__ import annotations

import grpc
import pytest
from controller.svc import ADMIN_TOKEN, serving, wait_for
from prometheus_client import CollectorRegistry, generate_latest

from services.controller.app import build
from services.controller.metrics import ControllerCollector
from services.controller.settings import ControllerSettings
from tide import streams
from tide.blobs import StorageSettings
from tide.grpcutil import channel
from tide.proto.tide.v1 import controller_pb2, controller_pb2_grpc, trainer_pb2
from tide.telemetry import StepRecord


def step(i: int, accepted: int, worker: str = "w1", version: str = "v1") -> StepRecord:
    return StepRecord(worker_id=worker, step=i, time_unix_s=1e9 + i, batch_size=1, request_ids=["r"], gammas=[3],
                      accepted=[accepted], draft_ms=1, verify_ms=5, other_ms=1, drafter="ngram",
                      draft_version=version, target_model="tiny")


@pytest.fixture
def make_controller(redis_server, unique_prefix):
    started = []

    def make(**kw):
        base = dict(listen="127.0.0.1:0", metrics_port=0, consumer="c-test", claim_idle_ms=30_000, reconcile_s=0.2,
                    admin_token=ADMIN_TOKEN, storage=StorageSettings(redis_url=redis_server.url,
                                                                     stream_prefix=unique_prefix))
        svc = build(ControllerSettings(**{**base, **kw}))
        started.append(svc)
        return svc

    yield make
    for svc in started:
        svc.stop(grace_s=0.2)


def stub(svc, token=None):
    return controller_pb2_grpc.ControllerServiceStub(channel(svc.target, token=token))


def test_health_state_and_admin_auth(make_controller):
    svc = make_controller()
    assert serving(svc.target) and serving(svc.target, "tide.v1.ControllerService")
    assert stub(svc).GetState(controller_pb2.GetControllerStateRequest(), timeout=5) == controller_pb2.ControllerState()
    req = controller_pb2.RegisterWorkerRequest(worker_id="w9", address="127.0.0.1:1", target_model="tiny")
    with pytest.raises(grpc.RpcError) as err:
        stub(svc).RegisterWorker(req, timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    current = stub(svc, ADMIN_TOKEN).RegisterWorker(req, timeout=5).current
    assert current.target_model == "tiny" and current.decision_id.startswith("ctl-")
    assert stub(svc, ADMIN_TOKEN).RegisterWorker(req, timeout=5).current == current  # the same decision again
    assert not current.HasField("gamma_policy")  # the default decision leaves each worker's own γ policy
    assert not current.HasField("collection_enabled")  # no telemetry yet: collection left to the worker
    assert [b.enabled for b in current.speculation.buckets] == [True]
    with pytest.raises(grpc.RpcError) as err:
        stub(svc, ADMIN_TOKEN).RegisterWorker(controller_pb2.RegisterWorkerRequest(address="nope"), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    state = stub(svc).GetState(controller_pb2.GetControllerStateRequest(), timeout=5)
    assert [(w.worker_id, w.address) for w in state.workers] == [("w9", "127.0.0.1:1")]
    assert [t.target_model for t in state.targets] == ["tiny"]
    # the worker address is closed: the push fails and is recorded as such (and retried)
    wait_for(lambda: stub(svc).GetState(controller_pb2.GetControllerStateRequest(), timeout=5).recent_decisions,
             what="a failed push record")
    rec = stub(svc).GetState(controller_pb2.GetControllerStateRequest(), timeout=5).recent_decisions[0]
    assert list(rec.failed) == ["w9"] and not rec.applied_to and rec.decision.decision_id == current.decision_id


def test_training_outcome_reports_are_idempotent(make_controller):
    svc = make_controller()
    outcome = trainer_pb2.TrainingOutcome(run_id="run-1", target_model="tiny", eval_accept_length_candidate=1.7,
                                          finished_unix_s=5.0)
    assert stub(svc, ADMIN_TOKEN).ReportTrainingOutcome(outcome, timeout=5).recorded
    assert not stub(svc, ADMIN_TOKEN).ReportTrainingOutcome(outcome, timeout=5).recorded
    (target,) = stub(svc).GetState(controller_pb2.GetControllerStateRequest(target_model="tiny"), timeout=5).targets
    assert target.last_training.run_id == "run-1" and target.last_training.eval_accept_length_candidate == 1.7


def test_telemetry_is_consumed_acked_and_bad_entries_dead_lettered(make_controller, redis_client, unique_prefix):
    names = streams.StreamNames(unique_prefix)
    svc = make_controller()
    for i in range(20):
        streams.add(redis_client, names.telemetry, step(i, accepted=2))
    redis_client.xadd(names.telemetry, {"type": "step_record", "v": "1", "data": '{"worker_id": 5}'})

    def drafts():
        state = stub(svc).GetState(controller_pb2.GetControllerStateRequest(target_model="tiny"), timeout=5)
        return state.targets[0].drafts if state.targets else None

    (d,) = wait_for(lambda: (ds := drafts()) and ds[0].verify_steps == 20 and ds, what="20 observations")
    assert (d.draft_version, d.tokens) == ("v1", 60)
    assert d.accept_length_ema_short == pytest.approx(3.0) and d.accept_length_ema_long == pytest.approx(3.0)
    assert d.acceptance_rate_ema_short == pytest.approx(2 / 3) and d.acceptance_rate_ema_long == pytest.approx(2 / 3)
    wait_for(lambda: redis_client.xlen(names.dead_letter) == 1, what="the dead letter")
    (_, fields), = redis_client.xrange(names.dead_letter)
    letter = streams.decode(fields, streams.DeadLetter)
    assert "unparseable payload" in letter.reason and letter.consumer == "controller/c-test"
    wait_for(lambda: redis_client.xpending(names.telemetry, streams.CONTROLLER_GROUP)["pending"] == 0,
             what="every entry acked")


def test_pending_entry_of_a_dead_consumer_is_reclaimed(make_controller, redis_client, unique_prefix):
    names = streams.StreamNames(unique_prefix)
    redis_client.xgroup_create(names.telemetry, streams.CONTROLLER_GROUP, id="0", mkstream=True)
    streams.add(redis_client, names.telemetry, step(0, accepted=1, worker="w-lost"))
    # a controller that read the entry and died before acking it
    assert redis_client.xreadgroup(streams.CONTROLLER_GROUP, "dead-controller", {names.telemetry: ">"}, count=1)
    svc = make_controller(claim_idle_ms=300)
    wait_for(lambda: svc.controller.stats.records == 1, what="the reclaimed entry to be processed")
    assert svc.reader.consumer.stats.reclaimed == 1
    assert redis_client.xpending(names.telemetry, streams.CONTROLLER_GROUP)["pending"] == 0
    assert [load.worker_id for load in svc.controller.stats.load(now=1e9 + 1)] == ["w-lost"]


def test_collection_state_follows_telemetry_and_training_outcomes(make_controller, redis_client, unique_prefix):
    names = streams.StreamNames(unique_prefix)
    svc = make_controller(tokens_needed=500, min_on_s=0.0)  # no hysteresis: two non-gains turn it off
    admin = stub(svc, ADMIN_TOKEN)
    admin.RegisterWorker(controller_pb2.RegisterWorkerRequest(worker_id="w9", address="127.0.0.1:1",
                                                              target_model="tiny"), timeout=5)

    def target():
        return stub(svc).GetState(controller_pb2.GetControllerStateRequest(target_model="tiny"), timeout=5).targets[0]

    def decision():  # the newest decision the controller tried to push (the worker address is closed)
        recs = stub(svc).GetState(controller_pb2.GetControllerStateRequest(), timeout=5).recent_decisions
        return recs[0].decision if recs else None

    assert not target().collection.enabled and "waiting for telemetry" in target().collection.reason
    for i in range(20):  # n-gram steps: no draft version serving
        streams.add(redis_client, names.telemetry, step(i, accepted=2, version=""))
    col = wait_for(lambda: (c := target().collection).enabled and c, what="collection on")
    assert (col.reason, col.tokens_needed) == ("cold start", 500) and col.since_unix_s > 0
    on = wait_for(lambda: (d := decision()) and d.collection_enabled and d, what="the decision with collection on")
    for i in range(20, 30):
        streams.add(redis_client, names.telemetry, step(i, accepted=2, version=""))
    wait_for(lambda: target().collection.tokens_collected >= 30, what="tokens collected")

    for run in ("run-1", "run-2"):  # two trainings without gain: collection off, a new decision at once
        assert admin.ReportTrainingOutcome(trainer_pb2.TrainingOutcome(
            run_id=run, target_model="tiny", candidate_version=f"c-{run}", eval_accept_length_candidate=1.0,
            eval_accept_length_base=1.2, promoted=False), timeout=5).recorded
    col = target().collection
    assert (col.enabled, col.reason) == (False, "no gain after training")
    off = wait_for(lambda: (d := decision()) and d.HasField("collection_enabled") and not d.collection_enabled and d,
                   what="the decision with collection off")
    assert off.decision_id != on.decision_id and "no gain after training" in off.reason

    metrics = CollectorRegistry()
    metrics.register(ControllerCollector(svc))
    text = generate_latest(metrics).decode()
    assert 'tide_controller_collection_enabled{target="tiny"} 0.0' in text
    assert 'tide_controller_collection_changes_total{reason="cold start",target="tiny"} 1.0' in text
    assert 'tide_controller_collection_changes_total{reason="no gain after training",target="tiny"} 1.0' in text

"""Automatic rollback end to end with real parts: a real registry (on the shared S3 server), the
controller in process with its real telemetry reader on the real Redis stream, and step records in
the format workers publish. A promoted draft that accepts far less than the previous one is rolled
back in the registry, and the controller's GetState and metrics say why."""

from __future__ import annotations

import time

import pytest
from controller.svc import ADMIN_TOKEN, wait_for
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from registry.harness import start_registry, write_draft

from services.controller.app import build
from services.controller.metrics import ControllerCollector
from services.controller.settings import ControllerSettings
from tide import streams
from tide.blobs import StorageSettings
from tide.grpcutil import channel
from tide.proto.tide.v1 import controller_pb2, controller_pb2_grpc, registry_pb2, trainer_pb2
from tide.telemetry import StepRecord

TARGET = "tiny-llama"


@pytest.fixture
def registry(s3_client, s3_bucket):
    reg = start_registry(s3_client, s3_bucket, token=ADMIN_TOKEN)
    yield reg
    reg.stop()


def publish(redis_client, names, version: str, accepted: int, n: int, t0: float) -> None:
    """`n` speculative steps of one request each (γ=3), as an inference worker publishes them."""
    for i in range(n):
        streams.add(redis_client, names.telemetry, StepRecord(
            worker_id="worker-0", step=i, time_unix_s=t0 + i * 1e-3, batch_size=1, request_ids=[f"r{i}"], gammas=[3],
            accepted=[accepted], draft_ms=1.0, verify_ms=5.0, other_ms=1.0, drafter="eagle3", draft_version=version,
            target_model=TARGET))


@pytest.mark.timeout(120)
def test_a_promoted_draft_that_accepts_worse_is_rolled_back(registry, redis_server, redis_client, unique_prefix,
                                                            tmp_path):
    admin = registry.client(token=ADMIN_TOKEN)
    v1, v2 = (admin.register_dir(write_draft(tmp_path / f"d{i}", seed=i), TARGET, s3=registry.s3,
                                 bucket=registry.bucket).version for i in (1, 2))
    admin.promote(v1, TARGET, reason="bootstrap")
    svc = build(ControllerSettings(
        listen="127.0.0.1:0", metrics_port=0, reconcile_s=0.2, consumer="c-rollback", admin_token=ADMIN_TOKEN,
        registry_addr=registry.address, rollback_window=200, rollback_margin=0.05,
        storage=StorageSettings(redis_url=redis_server.url, stream_prefix=unique_prefix)))
    try:
        names = streams.StreamNames(unique_prefix)
        cstub = controller_pb2_grpc.ControllerServiceStub(channel(svc.target, token=ADMIN_TOKEN))

        def state() -> controller_pb2.TargetState | None:
            got = cstub.GetState(controller_pb2.GetControllerStateRequest(target_model=TARGET), timeout=5).targets
            return got[0] if got else None

        t0 = time.time()
        publish(redis_client, names, v1, accepted=2, n=300, t0=t0)  # v1 serves: accept length 3
        wait_for(lambda: (s := state()) and s.draft_version == v1 and s.drafts[0].verify_steps == 300, 30,
                 "v1's telemetry")
        # the trainer promotes v2 (its eval said better) and reports it
        admin.promote(v2, TARGET, reason="training run run-7", expected_current=v1)
        assert cstub.ReportTrainingOutcome(trainer_pb2.TrainingOutcome(
            run_id="run-7", target_model=TARGET, candidate_version=v2, base_version=v1,
            eval_accept_length_candidate=3.3, eval_accept_length_base=3.0, promoted=True), timeout=5).recorded
        watched = wait_for(lambda: (s := state()).rollback.watching_version == v2 and s, 10, "the watch of v2")
        assert watched.rollback.enabled and watched.rollback.previous_version == v1 and watched.rollback.window == 200
        publish(redis_client, names, v2, accepted=0, n=150, t0=t0 + 1)  # live, v2 accepts nothing: length 1
        wait_for(lambda: state().rollback.verify_steps == 150, 30, "150 observations of v2")
        assert admin.pointer(TARGET).current == v2  # below the window: no verdict yet
        publish(redis_client, names, v2, accepted=0, n=100, t0=t0 + 2)

        pointer = wait_for(lambda: (p := admin.pointer(TARGET)).current == v1 and p, 30, "the rollback to v1")
        event = pointer.history[0]
        assert event.action == registry_pb2.POINTER_ACTION_ROLLBACK
        assert (event.from_version, event.to_version, event.actor) == (v2, v1, "controller")
        assert f"{v2} accepted 0.000 of its checked draft tokens" in event.reason and f"{v1}'s 0.667" in event.reason
        last = state().rollback.last
        assert (last.from_version, last.to_version, last.reason) == (v2, v1, event.reason)
        assert last.live_accept_length == 1.0 and last.previous_accept_length == pytest.approx(3.0)
        assert last.live_acceptance_rate == 0.0 and last.previous_acceptance_rate == pytest.approx(2 / 3)
        assert last.verify_steps >= 200 and not state().rollback.watching_version

        metrics = CollectorRegistry()
        metrics.register(ControllerCollector(svc))
        text = generate_latest(metrics).decode()
        assert f'tide_controller_rollbacks_total{{target="{TARGET}"}} 1.0' in text
        # v2 accepted none of the draft tokens it checked; v1 (γ = 3, 2 accepted) two of every three
        rates = {(m.labels["draft_version"], m.labels["horizon"]): m.value
                 for family in text_string_to_metric_families(text) for m in family.samples
                 if m.name == "tide_controller_acceptance_rate_ema" and m.labels["target"] == TARGET}
        assert rates[(v2, "long")] == 0.0 and rates[(v1, "long")] == pytest.approx(2 / 3)
        time.sleep(0.5)  # more rounds: the rolled-back version is not rolled back twice
        history = admin.pointer(TARGET).history
        assert [e.action for e in history].count(registry_pb2.POINTER_ACTION_ROLLBACK) == 1
    finally:
        svc.stop(grace_s=0.2)
        admin.close()

"""Cancellation, status, health, decisions (idempotency, validation, bucket schedule) and admin auth."""

from __future__ import annotations

import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from inference.service.svc import ADMIN_TOKEN, request, rpc_error, run_stream, step_records, stub, wait_for
from prometheus_client import REGISTRY

from services.inference.worker import ESTIMATES_EVERY_S
from tide.decisions import DecisionError, SpeculationBucket, SpeculationSchedule
from tide.grpcutil import channel
from tide.policies.profile import synthetic_profile
from tide.proto.tide.v1 import inference_pb2

Outcome = inference_pb2.ApplyDecisionResponse
LOOPING = [5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9]  # the n-gram drafter finds matches in it


def decision(did: str, **kw) -> inference_pb2.Decision:
    buckets = kw.pop("buckets", None)
    if buckets is not None:
        kw["speculation"] = inference_pb2.SpeculationSchedule(buckets=[
            inference_pb2.SpeculationBucket(min_batch=lo, max_batch=hi, enabled=on) for lo, hi, on in buckets])
    return inference_pb2.Decision(decision_id=did, **kw)


def test_cancel_frees_the_slot(make_service):
    svc = make_service(max_batch=1)
    client = stub(svc)
    long = client.Generate(request("long", LOOPING, max_tokens=200), timeout=60)
    assert next(long).HasField("chunk")
    assert client.Cancel(inference_pb2.CancelRequest(request_id="long")).found
    last = list(long)[-1]
    assert last.final.finish_reason == inference_pb2.FINISH_REASON_CANCELLED
    assert 0 < last.final.completion_tokens < 200
    assert not client.Cancel(inference_pb2.CancelRequest(request_id="long")).found  # finished: not an error
    tokens, _, last = run_stream(client, request("next", LOOPING, max_tokens=5))  # the only slot is free again
    assert len(tokens) == 5
    status = client.GetStatus(inference_pb2.GetWorkerStatusRequest())
    assert status.running_requests == 0 and status.waiting_requests == 0


def test_client_disconnect_cancels_in_engine(make_service):
    svc = make_service(max_batch=1)
    client = stub(svc)
    call = client.Generate(request("gone", LOOPING, max_tokens=200), timeout=60)
    assert next(call).HasField("chunk")
    call.cancel()
    wait_for(lambda: not svc.worker.engine.has_work(), what="the engine to drop the request")
    assert svc.worker.status().running_requests == 0


def test_status_and_health(make_service):
    svc = make_service()
    s = stub(svc).GetStatus(inference_pb2.GetWorkerStatusRequest())
    assert (s.worker_id, s.model_id, s.engine, s.device, s.max_batch_size) == ("test-worker", "tiny-llama-0", "torch",
                                                                               "cpu", 4)
    assert s.drafter == "ngram" and s.gamma_policy.name == "static" and s.gamma_policy.params["gamma"] == 3
    assert not s.collection_enabled and s.uptime_s > 0
    assert [(b.min_batch, b.max_batch, b.enabled) for b in s.speculation.buckets] == [(1, 0, True)]
    health = health_pb2_grpc.HealthStub(channel(svc.target))
    resp = health.Check(health_pb2.HealthCheckRequest(service="tide.v1.InferenceService"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_apply_decision_needs_admin_token(make_service):
    svc = make_service()
    for token in (None, "wrong"):
        err = rpc_error(lambda t=token: stub(svc, t).ApplyDecision(decision("d0", drafter="none")))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert svc.worker.status().drafter == "ngram"
    assert stub(svc, ADMIN_TOKEN).ApplyDecision(decision("d0", drafter="none")).outcome == Outcome.OUTCOME_APPLIED


def test_decision_applied_once(make_service):
    svc = make_service()
    admin = stub(svc, ADMIN_TOKEN)
    first = admin.ApplyDecision(decision("d1", gamma_policy=inference_pb2.GammaPolicy(name="static",
                                                                                       params={"gamma": 2})))
    assert first.outcome == Outcome.OUTCOME_APPLIED and first.status.last_decision_id == "d1"
    assert first.status.gamma_policy.params["gamma"] == 2
    policy = svc.worker.engine.policy.inner
    # A re-sent id changes nothing, even with other contents.
    again = admin.ApplyDecision(decision("d1", drafter="none", collection_enabled=True))
    assert again.outcome == Outcome.OUTCOME_ALREADY_APPLIED
    assert again.status.drafter == "ngram" and not again.status.collection_enabled
    assert svc.worker.engine.policy.inner is policy
    second = admin.ApplyDecision(decision("d2", buckets=[(1, 2, True)]))  # schedule only: policy state kept
    assert second.outcome == Outcome.OUTCOME_APPLIED and svc.worker.engine.policy.inner is policy


@pytest.mark.parametrize(("kw", "needle"), [
    ({"target_model": "other-model", "drafter": "none"}, "other-model"),
    ({"gamma_policy": inference_pb2.GammaPolicy(name="nope")}, "unknown gamma policy"),
    ({"gamma_policy": inference_pb2.GammaPolicy(name="static", params={"gamma": -1})}, "gamma"),
    ({"gamma_policy": inference_pb2.GammaPolicy(name="static", params={"gama": 1})}, "bad parameters"),
    ({"gamma_policy": inference_pb2.GammaPolicy(name="tide")}, "latency profile"),
    ({"drafter": "medusa"}, "unknown drafter"),
    ({"buckets": [(1, 4, True), (4, 0, False)]}, "overlap"),
    ({"decision_id": ""}, "decision_id"),
])
def test_rejected_decisions_change_nothing(make_service, kw, needle):
    svc = make_service()
    before = svc.worker.status()
    resp = stub(svc, ADMIN_TOKEN).ApplyDecision(decision(kw.pop("decision_id", "bad"), **kw))
    assert resp.outcome == Outcome.OUTCOME_REJECTED and needle in resp.detail
    after = svc.worker.status()
    assert (after.policy, after.drafter, after.speculation, after.last_decision_id) == \
        (before.policy, before.drafter, before.speculation, before.last_decision_id)


def test_policy_with_profile_in_table_json(make_service):
    svc = make_service()
    table = json.dumps({"profile": synthetic_profile().to_dict()})
    resp = stub(svc, ADMIN_TOKEN).ApplyDecision(decision("p1", gamma_policy=inference_pb2.GammaPolicy(
        name="tide", params={"gamma": 3}, table_json=table)))
    assert resp.outcome == Outcome.OUTCOME_APPLIED, resp.detail
    assert resp.status.gamma_policy.name == "tide"
    tokens, _, last = run_stream(stub(svc), request("after", LOOPING, max_tokens=10))
    assert len(tokens) == 10


def _estimate(policy: str, name: str, scope: str = "") -> float | None:
    return REGISTRY.get_sample_value("tide_inference_policy_estimate", {"policy": policy, "name": name, "scope": scope})


def test_the_policys_estimates_are_exported_and_leave_with_it(make_service):
    """A policy's α̂ is on /metrics and follows the draft: on the tiny random target the n-gram
    drafter is mostly rejected, and the `tide` policy's α̂ falls from its 0.5 prior to about the
    share of drafted tokens accepted. A static γ has no estimates: after the swap none of the old
    policy's series are left to mislead a dashboard."""
    svc = make_service()
    admin, client = stub(svc, ADMIN_TOKEN), stub(svc)
    table = json.dumps({"profile": synthetic_profile().to_dict()})
    resp = admin.ApplyDecision(decision("e1", gamma_policy=inference_pb2.GammaPolicy(
        name="tide", params={"gamma": 3, "alpha_decay": 0.99}, table_json=table)))
    assert resp.outcome == Outcome.OUTCOME_APPLIED, resp.detail
    _, _, last = run_stream(client, request("loop-1", LOOPING, max_tokens=60))
    spec = last.final.speculation
    time.sleep(ESTIMATES_EVERY_S + 0.1)  # the next step exports again
    run_stream(client, request("loop-2", LOOPING, max_tokens=2))
    alpha = _estimate("tide", "alpha_global")
    assert spec.draft_tokens >= 30 and spec.accepted_tokens / spec.draft_tokens < 0.3
    assert alpha is not None and alpha < 0.4
    static = inference_pb2.GammaPolicy(name="static", params={"gamma": 2})
    resp = admin.ApplyDecision(decision("e2", gamma_policy=static))
    assert resp.outcome == Outcome.OUTCOME_APPLIED, resp.detail
    time.sleep(ESTIMATES_EVERY_S + 0.1)
    run_stream(client, request("loop-3", LOOPING, max_tokens=4))
    assert _estimate("tide", "alpha_global") is None


def test_schedule_turns_speculation_off_per_batch_size(make_service, redis_client, unique_prefix):
    """Speculation on at batch 1, off at batch >= 2; speculative=false/true per request override it."""
    svc = make_service(max_batch=4)
    admin, client = stub(svc, ADMIN_TOKEN), stub(svc)
    resp = admin.ApplyDecision(decision("s1", buckets=[(1, 1, True), (2, 0, False)]))
    assert resp.outcome == Outcome.OUTCOME_APPLIED
    run_stream(client, request("solo", LOOPING, max_tokens=30))
    from concurrent.futures import ThreadPoolExecutor
    reqs = [request("pair-a", LOOPING, 30), request("pair-b", LOOPING[1:], 30),
            request("forced", LOOPING[2:], 30, speculative=True)]
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda r: run_stream(client, r), reqs))
    recs = wait_for(lambda: [r for r in step_records(redis_client, unique_prefix) if r.batch_size]
                    if svc.telemetry.buffered == 0 else None, what="telemetry")
    solo = [g for r in recs for rid, g in zip(r.request_ids, r.gammas, strict=True) if rid == "solo"]
    assert max(solo) > 0
    multi = [(rid, g) for r in recs if r.batch_size >= 2 for rid, g in zip(r.request_ids, r.gammas, strict=True)]
    assert multi and all(g == 0 for rid, g in multi if rid != "forced")
    assert any(g > 0 for rid, g in multi if rid == "forced")
    # speculative=false: never drafts, even at batch 1 where the schedule enables it
    _, _, last = run_stream(client, request("never", LOOPING, max_tokens=20, speculative=False))
    assert last.final.speculation.verify_steps == 0 and last.final.speculation.plain_steps == 19


def test_schedule_validation():
    assert SpeculationSchedule((SpeculationBucket(1, 2, True), SpeculationBucket(5, 0, True))).enabled(7)
    s = SpeculationSchedule((SpeculationBucket(1, 2, True), SpeculationBucket(5, 0, True)))
    assert [s.enabled(b) for b in (1, 2, 3, 4, 5, 64)] == [True, True, False, False, True, True]
    with pytest.raises(DecisionError):
        SpeculationSchedule((SpeculationBucket(3, 2, True),))
    assert not SpeculationSchedule(()).enabled(1)

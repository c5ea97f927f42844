"""The worker profiles at start (TIDE_PROFILE_AT_START), exposes the table, and re-profiles on a decision."""

from __future__ import annotations

import json

import pytest
from inference.service.svc import ADMIN_TOKEN, storage, stub

from services.inference.app import build, start_profile
from services.inference.control import Outcome
from services.inference.settings import InferenceSettings
from tide.decisions import Decision, PolicySpec
from tide.engine.profiling import LiveProfile
from tide.policies.profile import synthetic_profile
from tide.proto.tide.v1 import inference_pb2

SMALL = dict(target="tiny", dtype="fp32", max_batch=2, max_seq_len=128, max_gamma=2)


def test_start_profile_by_policy_setting_and_file(tiny_model, tmp_path):
    cache = str(tmp_path / "cache")
    assert start_profile(InferenceSettings(**SMALL, policy="static", profile_cache_dir=cache), tiny_model, "t") is None
    live = start_profile(InferenceSettings(**SMALL, policy="adaptive", policy_params={}, profile_cache_dir=cache),
                         tiny_model, "t")
    assert isinstance(live, LiveProfile) and sorted(live.T_ms) == [1, 2] and sorted(live.T_ms[1]) == [1, 2, 3]
    files = list((tmp_path / "cache").glob("*.json"))
    assert len(files) == 1
    again = start_profile(InferenceSettings(**SMALL, policy="static", profile_at_start="1", profile_cache_dir=cache),
                          tiny_model, "t")
    assert again.T_ms == live.T_ms and again.meta["measured_unix_s"] == live.meta["measured_unix_s"]  # cache hit
    assert start_profile(InferenceSettings(**SMALL, policy="tide", profile_at_start="0"), tiny_model, "t") is None
    eagle = start_profile(InferenceSettings(**SMALL, policy="tide", drafter="eagle3", profile_cache_dir=cache),
                          tiny_model, "t")  # timed in the draft's shape before the registry's draft arrives
    assert eagle.meta["drafter"]["algorithm"] == "eagle3" and sorted(eagle.C_ms) == [1, 2]
    path = tmp_path / "given.json"
    synthetic_profile().save(path)
    given = start_profile(InferenceSettings(**SMALL, policy="tide", latency_profile=str(path)), tiny_model, "t")
    assert not isinstance(given, LiveProfile) and given.D0_ms == pytest.approx(1.7)
    with pytest.raises(ValueError, match="TIDE_PROFILE_AT_START"):
        InferenceSettings(**SMALL, profile_at_start="maybe")
    env = InferenceSettings.from_env({"TIDE_PROFILE_AT_START": "0", "TIDE_PROFILE_CACHE_DIR": cache})
    assert env.profile_at_start == "0" and env.profile_cache_dir == cache


def test_service_exposes_profile_and_reprofiles_on_decision(tiny_model, tmp_path, redis_server, s3_server, s3_bucket,
                                                           unique_prefix):
    st = storage(redis_server.url, s3_server.endpoint, s3_server.access_key, s3_server.secret_key, s3_bucket,
                 unique_prefix)
    settings = InferenceSettings(**SMALL, listen="127.0.0.1:0", metrics_port=0, worker_id="w-prof",
                                 admin_token=ADMIN_TOKEN, storage=st, policy="adaptive", policy_params={},
                                 profile_cache_dir=str(tmp_path))
    svc = build(settings, model=tiny_model, tokenizer=None, model_id="tiny-llama-0")
    try:
        status = stub(svc).GetStatus(inference_pb2.GetWorkerStatusRequest(), timeout=10)
        shown = json.loads(status.gamma_policy.table_json)["profile"]
        assert status.gamma_policy.name == "adaptive" and sorted(shown["T_ms"]) == ["1", "2"]
        before = svc.worker.profile.meta["measured_unix_s"]
        svc.worker.profile.meta["measured_unix_s"] = before - 1.0  # so a re-measure is visible
        res = svc.worker.apply_decision(Decision("reprof-1", policy=PolicySpec("adaptive", {"reprofile": 1.0})))
        assert res.outcome is Outcome.APPLIED, res.detail
        assert svc.worker.profile.meta["measured_unix_s"] >= before
        assert svc.worker.engine.policy.inner.profile is svc.worker.profile  # the new policy runs on the new table
        res = svc.worker.apply_decision(Decision("reprof-2", policy=PolicySpec("static", {"reprofile": 1.0})))
        assert res.outcome is Outcome.APPLIED, res.detail
    finally:
        svc.stop(grace_s=0.5)

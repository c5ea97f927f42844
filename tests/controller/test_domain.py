"""Controller domain without transport: settings, static decisions, acceptance EMAs and load, and
the fleet's reconciliation (against a scripted worker client: the real one is tested in test_push)."""

from __future__ import annotations

import json

import pytest

from services.controller.decisions import StaticDecision
from services.controller.fleet import Fleet, PushResult, WorkerSnapshot, WorkerUnreachable
from services.controller.outcomes import OutcomeLog, TrainingOutcome
from services.controller.settings import ControllerSettings
from services.controller.stats import FleetStats
from tide.telemetry import StepRecord


def test_settings_from_env():
    s = ControllerSettings.from_env({
        "TIDE_CONTROLLER_WORKERS": "127.0.0.1:1, 127.0.0.1:2", "TIDE_CONTROLLER_RECONCILE_S": "0.5",
        "TIDE_CONTROLLER_DECISION": '{"speculation": false, "gamma_policy": null, "collection_enabled": true}',
        "TIDE_ADMIN_TOKEN": "secret", "TIDE_STREAM_PREFIX": "p", "TIDE_CONTROLLER_CONSUMER": "c1"})
    assert s.workers == ("127.0.0.1:1", "127.0.0.1:2") and s.reconcile_s == 0.5 and s.consumer == "c1"
    assert s.decision.speculation[0].enabled is False and s.decision.policy is None
    assert s.decision.collection_enabled is True and s.storage.stream_prefix == "p"
    assert "secret" not in repr(s)
    default = ControllerSettings.from_env({})
    assert (default.listen, default.workers, default.decision) == ("127.0.0.1:50053", (), StaticDecision())
    for bad in ({"TIDE_CONTROLLER_WORKERS": "nohost"}, {"TIDE_CONTROLLER_RECONCILE_S": "x"},
                {"TIDE_CONTROLLER_DECISION": "{"}, {"TIDE_CONTROLLER_EMA_SHORT": "2000"}):
        with pytest.raises(ValueError):
            ControllerSettings.from_env(bad)


def test_collection_and_rollback_settings():
    default = ControllerSettings.from_env({})
    assert (default.collection_mode, default.shift_epsilon, default.break_even_rate, default.min_observations,
            default.no_gain_runs, default.gain_margin, default.tokens_needed) == ("auto", 0.15, 0.0, 50, 2, 0.02, 16384)
    assert (default.collection_learn, default.min_on_s, default.shift_hold_s) == (True, 300.0, 30.0)
    assert (default.auto_rollback, default.rollback_window, default.rollback_margin, default.rollback_z,
            default.registry_addr) == (True, 200, 0.05, 3.0, "")
    s = ControllerSettings.from_env({
        "TIDE_CONTROLLER_COLLECTION": "OFF", "TIDE_CONTROLLER_SHIFT_EPSILON": "0.3",
        "TIDE_CONTROLLER_BREAK_EVEN_RATE": "0.25", "TIDE_CONTROLLER_MIN_OBSERVATIONS": "20",
        "TIDE_CONTROLLER_NO_GAIN_RUNS": "3", "TIDE_CONTROLLER_GAIN_MARGIN": "0.05",
        "TIDE_CONTROLLER_TOKENS_NEEDED": "4096", "TIDE_CONTROLLER_AUTO_ROLLBACK": "0",
        "TIDE_CONTROLLER_ROLLBACK_WINDOW": "50", "TIDE_CONTROLLER_ROLLBACK_MARGIN": "0.2",
        "TIDE_CONTROLLER_ROLLBACK_Z": "0", "TIDE_REGISTRY_ADDR": "registry:50055"})
    assert (s.collection_mode, s.shift_epsilon, s.break_even_rate, s.min_observations, s.no_gain_runs, s.gain_margin,
            s.tokens_needed) == ("off", 0.3, 0.25, 20, 3, 0.05, 4096)
    assert (s.auto_rollback, s.rollback_window, s.rollback_margin, s.rollback_z, s.registry_addr) == (
        False, 50, 0.2, 0.0, "registry:50055")
    # a static decision that sets collection_enabled forces the mode; contradicting it is an error
    forced = ControllerSettings.from_env({"TIDE_CONTROLLER_DECISION": '{"collection_enabled": false}'})
    assert forced.collection_mode == "off"
    for bad in ({"TIDE_CONTROLLER_COLLECTION": "maybe"}, {"TIDE_CONTROLLER_AUTO_ROLLBACK": "yes please"},
                {"TIDE_CONTROLLER_DECISION": '{"collection_enabled": true}', "TIDE_CONTROLLER_COLLECTION": "off"},
                {"TIDE_CONTROLLER_DECISION": '{"collection_enabled": true}', "TIDE_CONTROLLER_COLLECTION": "auto"},
                {"TIDE_CONTROLLER_MIN_OBSERVATIONS": "0"}, {"TIDE_CONTROLLER_ROLLBACK_WINDOW": "0"},
                {"TIDE_CONTROLLER_ROLLBACK_MARGIN": "-1"}, {"TIDE_CONTROLLER_ROLLBACK_MARGIN": "1.5"},
                {"TIDE_CONTROLLER_ROLLBACK_Z": "-1"}, {"TIDE_CONTROLLER_BREAK_EVEN_RATE": "1.5"},
                {"TIDE_CONTROLLER_ROLLBACK_Z": "inf"},
                {"TIDE_REGISTRY_ADDR": "no-port"}):
        with pytest.raises(ValueError):
            ControllerSettings.from_env(bad)


def test_static_decision_parsing_and_ids():
    d = StaticDecision.from_json(json.dumps({
        "speculation": [{"min_batch": 5, "max_batch": 0, "enabled": False},
                        {"min_batch": 1, "max_batch": 4, "enabled": True}],
        "gamma_policy": {"name": "static", "params": {"gamma": 2}, "table_json": {"x": 1}}, "drafter": "ngram"}))
    assert [b.min_batch for b in d.speculation] == [1, 5]  # sorted
    assert d.policy.params["gamma"] == 2.0 and json.loads(d.policy.table_json) == {"x": 1}
    a, b = d.for_target("m1"), d.for_target("m1", now=5.0)
    assert a.decision_id == b.decision_id and a.decision_id.startswith("static-")  # deterministic
    assert d.for_target("m2").decision_id != a.decision_id
    assert StaticDecision.from_json('{"drafter": "none"}').decision_id("m1") != a.decision_id
    for bad in ('{"speculation": [{"min_batch": 1, "max_batch": 0, "enabled": true},'
                ' {"min_batch": 3, "max_batch": 4, "enabled": true}]}',  # overlap
                '{"gamma_policy": {"name": "warp"}}', '{"drafter": "medusa"}', '{"colection_enabled": true}',
                '{"gamma_policy": {"name": "static", "params": {"gamma": "3"}}}', "[1]"):
        with pytest.raises(ValueError):
            StaticDecision.from_json(bad)


def record(worker="w1", t=100.0, gammas=(3,), accepted=(2,), version="v1", target="m") -> StepRecord:
    return StepRecord(worker_id=worker, step=0, time_unix_s=t, batch_size=len(gammas),
                      request_ids=[f"r{i}" for i in range(len(gammas))], gammas=list(gammas),
                      accepted=list(accepted), draft_ms=1, verify_ms=10, other_ms=1, draft_version=version,
                      target_model=target)


def test_acceptance_emas_follow_a_shift():
    stats = FleetStats(short_horizon=5, long_horizon=100)
    for i in range(50):
        stats.observe(record(t=100 + i, accepted=(3,)))  # accept length 4
    for i in range(10):
        stats.observe(record(t=200 + i, accepted=(0,)))  # shift: accept length 1
    stats.observe(record(t=300, gammas=(0, 0), accepted=(0, 0)))  # plain step: no acceptance observation
    (d,) = stats.drafts("m")
    assert d.verify_steps == 60 and d.tokens == 50 * 4 + 10
    assert d.short.value < 1.1 < 3.0 < d.long.value < 4.0  # the short EMA saw the shift, the long one barely
    assert d.rate_short.value < 0.1 < 0.85 < d.rate_long.value  # per checked token: 50 x 3/3, then 10 x 0/1
    assert stats.serving_version("m") == "v1" and stats.targets() == ["m"]
    stats.observe(record(t=301, version="v2", accepted=(1,)))
    assert [s.draft_version for s in stats.drafts("m")] == ["v2", "v1"] and stats.serving_version("m") == "v2"


def test_load_window():
    stats = FleetStats(window_s=10)
    for i in range(20):
        stats.observe(record(worker="a", t=1000 + i, gammas=(3, 3), accepted=(1, 0)))
    (load,) = stats.load(now=1020.0)
    assert load.worker_id == "a" and load.mean_batch == 2 and load.steps_per_s == pytest.approx(1.0, rel=0.15)
    assert load.tokens_per_s == pytest.approx(3.0, rel=0.15)
    assert stats.load(now=2000.0) == []  # nothing recent


class ScriptedWorkers:
    """Worker client double: per address a status (or None = unreachable) and the decisions received."""

    def __init__(self) -> None:
        self.state: dict[str, WorkerSnapshot | None] = {}
        self.pushed: list[tuple[str, str]] = []
        self.reject = False

    def status(self, address):
        st = self.state.get(address)
        if st is None:
            raise WorkerUnreachable("down")
        return st

    def apply(self, address, decision):
        st = self.state[address]
        self.pushed.append((address, decision.decision_id))
        if self.reject:
            return PushResult("rejected", "no")
        if st.last_decision_id == decision.decision_id:
            return PushResult("already_applied", "")
        self.state[address] = WorkerSnapshot(st.worker_id, st.model_id, decision.decision_id, st.uptime_s)
        return PushResult("applied", "applied")


def test_fleet_pushes_once_and_again_after_restart():
    workers, static = ScriptedWorkers(), StaticDecision()
    fleet = Fleet(workers, lambda t: static.for_target(t) if t else None)
    fleet.add("h:1", configured=True)
    workers.state["h:1"] = WorkerSnapshot("w1", "m", "", 10.0)
    for _ in range(3):
        fleet.reconcile()
    did = static.decision_id("m")
    assert workers.pushed == [("h:1", did)] and fleet.pushes.applied == 1
    assert fleet.decisions.recent(5)[0].applied_to == ["w1"]
    workers.state["h:1"] = None  # down for a while: nothing to push, no crash
    fleet.reconcile()
    workers.state["h:1"] = WorkerSnapshot("w1b", "m", "", 0.5)  # restarted: forgot the decision
    fleet.reconcile()
    fleet.reconcile()
    assert workers.pushed == [("h:1", did)] * 2 and fleet.pushes.applied == 2


def test_fleet_does_not_hammer_a_worker_that_rejects():
    workers, static = ScriptedWorkers(), StaticDecision()
    fleet = Fleet(workers, lambda t: static.for_target(t))
    fleet.add("h:1", worker_id="w1", target_model="m")
    workers.state["h:1"] = WorkerSnapshot("w1", "m", "", 10.0)
    workers.reject = True
    for _ in range(3):
        fleet.reconcile()
    assert len(workers.pushed) == 1 and fleet.pushes.rejected == 1
    assert fleet.decisions.recent(1)[0].failed == ["w1"]
    fleet.add("h:1", worker_id="w1", target_model="m")  # re-registration: try again
    workers.reject = False
    fleet.reconcile()
    assert len(workers.pushed) == 2 and fleet.decisions.recent(1)[0].applied_to == ["w1"]


def test_outcomes_are_idempotent_by_run_id():
    log = OutcomeLog()
    assert log.record(TrainingOutcome("r1", "m", finished_unix_s=1.0))
    assert not log.record(TrainingOutcome("r1", "m", detail="retry", finished_unix_s=2.0))
    assert log.last("m").detail == "" and log.targets() == ["m"]
    with pytest.raises(ValueError):
        log.record(TrainingOutcome("", "m"))

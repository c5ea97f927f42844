"""The promotion rule, `compare` deciding on the served accept length, the automatic trigger's
back-off after failures, and the new settings' validation (no servers needed)."""

from __future__ import annotations

import importlib
import threading
import time
from types import SimpleNamespace

import pytest

from services.trainer import auto
from services.trainer.cycle import TrainingOutcome
from services.trainer.promotion import StepCosts, decide, served_at, step_costs
from services.trainer.runs import RunStats, TriggerResult
from services.trainer.settings import TrainerSettings
from tide.resources import parse_cpus

ev = importlib.import_module("services.trainer.training.evaluate")  # the package re-exports a function by that name


def test_promote_only_by_the_margin_over_the_base_or_over_no_draft():
    kw = dict(gamma=3, margin=0.02, auto_promote=True)
    d = decide("run-1", 2.5, 2.47, "t/v0001", **kw)
    assert d.promote and d.reason.startswith("run run-1: served accept length at γ=3 2.500 vs 2.470 (t/v0001): "
                                             "+0.030, margin 0.020; predicted speed-up at γ=3 1.7")
    assert not decide("run-1", 2.48, 2.47, "t/v0001", **kw).promote  # +0.01 < margin
    assert not decide("run-1", 2.0, 2.47, "t/v0001", **kw).promote  # worse
    assert decide("run-1", 1.6, None, "", **kw).promote  # no base: against plain decoding
    d = decide("run-1", 1.01, None, "", **kw)
    assert not d.promote and "vs 1.000 (no draft)" in d.reason
    off = decide("run-1", 3.0, 1.0, "t/v0001", gamma=3, margin=0.02, auto_promote=False)
    assert not off.promote and "TIDE_TRAINER_AUTO_PROMOTE=0" in off.reason
    assert not decide("run-1", None, None, "", **kw).promote  # nothing held out: nothing to judge by
    assert not decide("run-1", 3.0, None, "t/v0001", **kw).promote  # base not evaluated


def test_a_draft_that_accepts_more_than_nothing_but_costs_more_than_it_saves_is_not_promoted():
    """Issue #31: a from-scratch draft (1.3 tokens per step at γ = 3) was promoted over no draft, and
    serving slowed down: three draft steps at 12 % of a target step each cost more than 0.3 tokens."""
    kw = dict(gamma=3, margin=0.02, auto_promote=True)
    d = decide("run-1", 1.3, None, "", **kw)
    assert not d.promote and "drafting would not pay" in d.reason and "0.92" in d.reason
    # the same accept length with nearly free draft steps (a GPU, say) pays
    cheap = StepCosts(verify=(1.0, 1.0, 1.0, 1.0, 1.0, 1.0), draft=0.01, source="test")
    assert decide("run-1", 1.3, None, "", costs=cheap, **kw).promote
    # over a base draft: the candidate's predicted speed-up must beat the base's (here equal costs,
    # so the margin rule and this agree)
    assert decide("run-1", 2.5, 2.4, "t/v0001", costs=cheap, **kw).promote


def test_step_costs_come_from_the_workers_eagle3_profile(tmp_path):
    from tide.policies.profile import LatencyProfile

    assert step_costs("", "m", tmp_path).source.startswith("defaults")
    LatencyProfile(T_ms={1: {1: 10.0, 4: 11.0}}, D0_ms=2.0, meta={"drafter": {"algorithm": "ngram"}}).save(
        tmp_path / "m-aaaa.json")
    assert step_costs("", "m", tmp_path).source.startswith("defaults")  # an n-gram profile says nothing of EAGLE-3
    LatencyProfile(T_ms={1: {1: 10.0, 4: 11.0}}, D0_ms=2.0, meta={"drafter": {"algorithm": "eagle3"}}).save(
        tmp_path / "m-bbbb.json")
    costs = step_costs("", "m", tmp_path)
    assert costs.draft == pytest.approx(0.2) and costs.verify[3] == pytest.approx(1.1)
    assert costs.speedup(2.0, 3) == pytest.approx(2.0 / (1.1 + 0.6))


def test_served_not_all_rows_acceptance_decides():
    evaluation = {"acceptance": {"3": 3.9}, "served": {"3": 2.25}}
    assert served_at(evaluation, 3) == 2.25 and served_at(None, 3) is None and served_at(evaluation, 2) is None


def test_compare_decides_on_served(monkeypatch):
    # a: higher all-rows acceptance, lower served accept length; b the reverse
    results = iter([ev.EvalResult({3: 3.0}, [], [], [], 1.0, 10, 10, served={3: 2.0}),
                    ev.EvalResult({3: 2.5}, [], [], [], 1.0, 10, 10, served={3: 2.2})])
    monkeypatch.setattr(ev, "evaluate", lambda *a, **k: next(results))
    verdict = ev.compare(None, None, None, None, gamma=3)
    assert verdict["b_better"] and verdict["delta"] == pytest.approx(0.2) and verdict["metric"] == "served"


class FakeRunner:
    def __init__(self, failures: int, finished: float):
        self.busy = False
        self.stats = RunStats(consecutive_failures=failures)
        self.last_outcome = TrainingOutcome("r", "t", finished_unix_s=finished) if failures else None
        self.settings = SimpleNamespace(min_tokens=10, min_tokens_growth=0.0)
        self.triggered: list[str] = []

    def target_model(self, timeout_s=None):
        return "t"

    def trigger(self, target, reason="", force=False):
        self.triggered.append(reason)
        return TriggerResult(True, "run-x", "ok")


def test_auto_trigger_backs_off_after_failed_runs():
    manifest = SimpleNamespace(buffered_totals=lambda target: (3, 50))
    now = time.time()
    fresh = FakeRunner(0, 0)
    assert auto.AutoTrigger(fresh, manifest).check().accepted
    assert fresh.triggered == ["auto: 50 tokens buffered (>= 10)"]
    failing = FakeRunner(3, now)  # third failure in a row just now: wait 4 x retry_min_s
    trig = auto.AutoTrigger(failing, manifest, retry_min_s=30, retry_max_s=600)
    assert trig.retry_at() == pytest.approx(now + 120) and trig.check() is None and failing.triggered == []
    failing.last_outcome = TrainingOutcome("r", "t", finished_unix_s=now - 121)
    assert trig.check().accepted
    assert auto.AutoTrigger(FakeRunner(10, now), manifest, retry_min_s=30, retry_max_s=600).retry_at() == \
        pytest.approx(now + 600)  # capped
    assert auto.AutoTrigger(FakeRunner(0, 0), SimpleNamespace(buffered_totals=lambda t: (1, 9))).check() is None


def test_automatic_cycles_grow_with_the_tokens_trained_on():
    """With TIDE_TRAINER_MIN_TOKENS_GROWTH = 0.5 a run waits for half the tokens earlier runs trained
    on (at least TIDE_TRAINER_MIN_TOKENS): 10, then 10 after 16 trained, then 50 after 100."""
    trained: list = []
    buffered = [40]
    manifest = SimpleNamespace(buffered_totals=lambda target: (1, buffered[0]),
                               trained=lambda target: list(trained))
    runner = FakeRunner(0, 0)
    runner.settings.min_tokens_growth = 0.5
    trig = auto.AutoTrigger(runner, manifest)
    assert trig.tokens_needed("t") == 10 and trig.check().accepted
    trained[:] = [SimpleNamespace(num_tokens=8), SimpleNamespace(num_tokens=8)]
    assert trig.tokens_needed("t") == 10
    trained.append(SimpleNamespace(num_tokens=84))
    assert trig.tokens_needed("t") == 50 and trig.check() is None  # 40 buffered < 50
    buffered[0] = 50
    assert trig.check().accepted and runner.triggered[-1] == "auto: 50 tokens buffered (>= 50)"
    assert TrainerSettings.from_env({}).min_tokens_growth == 0.0
    assert TrainerSettings.from_env({"TIDE_TRAINER_MIN_TOKENS_GROWTH": "0.5"}).min_tokens_growth == 0.5
    with pytest.raises(ValueError):
        TrainerSettings.from_env({"TIDE_TRAINER_MIN_TOKENS_GROWTH": "-1"})


def test_settings_of_the_cycle():
    s = TrainerSettings.from_env({"TIDE_TRAINER_AUTO_PROMOTE": "0", "TIDE_TRAINER_PROMOTE_MARGIN": "0.5",
                                  "TIDE_TRAINER_AUTO_TRAIN": "false", "TIDE_TRAINER_CPUS": "0,2-3",
                                  "TIDE_TRAINER_NICE": "10", "TIDE_REGISTRY_ADDR": "registry:50055",
                                  "TIDE_TRAINER_MAX_EPOCHS": "3", "TIDE_TRAINER_REPLAY_RECENT": "0.75"})
    assert (s.auto_promote, s.promote_margin, s.auto_train, s.nice, s.registry_addr) == (
        False, 0.5, False, 10, "registry:50055")
    assert (s.max_epochs, s.replay_recent) == (3.0, 0.75)
    assert s.cpu_set == {0, 2, 3} and parse_cpus("") == frozenset()
    d = TrainerSettings.from_env({})
    assert (d.auto_promote, d.promote_margin, d.auto_train, d.nice, d.cpus) == (True, 0.02, True, 0, "")
    assert (d.max_epochs, d.replay_recent) == (0.0, 0.0)  # no cap; replay sampled over the whole history
    assert d.eval_history_tokens == 8192  # earlier held-out chunks join the eval set
    for key, value in (("TIDE_TRAINER_CPUS", "3-1"), ("TIDE_TRAINER_CPUS", "a"), ("TIDE_TRAINER_NICE", "-1"),
                       ("TIDE_TRAINER_NICE", "20"), ("TIDE_TRAINER_AUTO_PROMOTE", "maybe"),
                       ("TIDE_TRAINER_PROMOTE_MARGIN", "nan"), ("TIDE_TRAINER_EVAL_GAMMA", "6"),
                       ("TIDE_REGISTRY_ADDR", "nohost"), ("TIDE_TRAINER_REPLAY_RECENT", "1.5"),
                       ("TIDE_TRAINER_MAX_EPOCHS", "-1"), ("TIDE_TRAINER_MAX_EPOCHS", "inf")):
        with pytest.raises(ValueError):
            TrainerSettings.from_env({key: value})


def test_status_follows_the_phases_of_a_run(tiny_dir):
    from services.trainer.cycle import PROMOTED, RunResult
    from services.trainer.manifest import ManifestEntry
    from services.trainer.runs import TrainingRunner

    gates, reached = [threading.Event(), threading.Event()], threading.Event()

    class Cycle:
        def run(self, run_id, target, entries, reason, train_draft, config_cls, phase):
            phase("training", 0.1)
            reached.set()
            gates[0].wait(10)
            phase("evaluating", 0.8)
            reached.set()
            gates[1].wait(10)
            return RunResult(TrainingOutcome(run_id, target, candidate_version="t/v0001", promoted=True,
                                             eval_accept_length_candidate=2.0, eval_accept_length_base=1.0,
                                             duration_s=1.5), PROMOTED, loss=0.25)

    entry = ManifestEntry("c0", "b", "k", "0" * 64, 10, 5000, tiny_dir.name, "", "", "", 0.0, 0.0)
    manifest = SimpleNamespace(buffered=lambda target: [entry])
    runner = TrainingRunner(TrainerSettings(target=str(tiny_dir), min_tokens=1000), Cycle(), manifest)
    r = runner.trigger(reason="test")
    assert r.accepted and reached.wait(10)
    st = runner.status()
    assert (st.state, st.run_id, st.phase, st.progress) == ("training", r.run_id, "training", 0.1)
    reached.clear()
    gates[0].set()
    assert reached.wait(10)
    st = runner.status()
    assert (st.state, st.phase, st.progress) == ("evaluating", "evaluating", 0.8)
    gates[1].set()
    runner.wait(10)
    st = runner.status()
    assert (st.state, st.run_id, st.loss, st.last_outcome.candidate_version) == ("idle", "", 0.25, "t/v0001")
    assert runner.stats.results[PROMOTED] == 1 and runner.stats.seconds == 1.5
    assert (runner.stats.last_candidate, runner.stats.last_base) == (2.0, 1.0)

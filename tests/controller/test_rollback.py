"""Automatic rollback without transport: a promoted draft is watched for `window` verifications and
rolled back (through the registry port) only when its acceptance rate per checked draft token is
below the previous version's by more than the margin; manual promotions are noticed from the
telemetry's serving version."""

from __future__ import annotations

from controller.svc import FakeRegistry

from services.controller.app import Controller
from services.controller.collection import CollectionControl
from services.controller.decisions import StaticDecision
from services.controller.outcomes import TrainingOutcome
from services.controller.rollback import RegistryUnavailable, RollbackGuard, RollbackRefused
from services.controller.stats import FleetStats
from tide.telemetry import StepRecord


class Fleet:
    """Telemetry as the controller sees it: steps of one worker on target "m"."""

    def __init__(self, registry, window=200, margin=0.05, long_horizon=100, z=3.0) -> None:
        self.stats = FleetStats(short_horizon=10, long_horizon=long_horizon)
        self.ctl = Controller(StaticDecision(), self.stats, collection=CollectionControl(),
                              rollback=RollbackGuard(registry, window, margin, z), clock=lambda: 5.0)
        self.t = 1000.0

    def steps(self, n: int, accepted: int, version: str, gamma: int = 3) -> None:
        for _ in range(n):
            self.t += 1
            self.stats.observe(StepRecord(worker_id="w1", step=int(self.t), time_unix_s=self.t, batch_size=1,
                                          request_ids=["r"], gammas=[gamma], accepted=[accepted], draft_ms=1,
                                          verify_ms=5, other_ms=1, drafter="eagle3", draft_version=version,
                                          target_model="m"))
        self.ctl.evaluate()

    def promote(self, run="run-1", new="v2", old="v1") -> None:
        assert self.ctl.report_outcome(TrainingOutcome(run, "m", new, old, 3.2, 3.0, promoted=True))

    @property
    def guard(self) -> RollbackGuard:
        return self.ctl.rollback


def test_a_worse_version_is_rolled_back_to_the_previous_one_once_the_window_is_full():
    reg = FakeRegistry()
    f = Fleet(reg, window=200, margin=0.05)
    f.steps(300, accepted=2, version="v1")  # accept length 3; 2 of 3 checked draft tokens accepted
    f.promote()
    f.steps(150, accepted=0, version="v2")  # accept length 1, rate 0, but the window is not full yet
    assert reg.calls == [] and f.guard.watching("m").verify_steps == 150
    f.steps(50, accepted=0, version="v2")
    ((target, to_version, reason),) = reg.calls
    assert (target, to_version) == ("m", "v1")
    assert "v2 accepted 0.000 of its checked draft tokens over 200 verifications" in reason
    assert "v1's 0.667" in reason and "(1.000 vs 3.000 tokens/step)" in reason
    last = f.guard.last("m")
    assert (last.from_version, last.to_version, last.verify_steps, last.live_accept_length) == ("v2", "v1", 200, 1.0)
    assert last.live_acceptance_rate == 0.0 and abs(last.previous_acceptance_rate - 2 / 3) < 1e-9
    assert last.reason == reason and f.guard.counts() == ({"m": 1}, {})
    assert f.guard.watching("m") is None
    f.steps(300, accepted=0, version="v2")  # stragglers of the bad version: no second rollback
    f.steps(10, accepted=2, version="v1")
    assert len(reg.calls) == 1


def test_a_version_that_is_not_worse_stays():
    reg = FakeRegistry()
    f = Fleet(reg, window=100, margin=0.05)
    f.steps(300, accepted=2, version="v1")
    f.promote()
    assert (f.guard.watching("m").version, f.guard.watching("m").previous) == ("v2", "v1")
    # slightly below v1 (rate 0.664 vs 0.667: within the margin), over more than the window
    for i in range(60):
        f.steps(1, accepted=2, version="v2")
        f.steps(1, accepted=1 if i % 20 == 0 else 2, version="v2")
    assert reg.calls == [] and f.guard.watching("m") is None and f.guard.last("m") is None


def test_a_drop_within_the_noise_of_two_short_windows_is_not_a_rollback():
    """bench adapt's case: at γ = 1, 0.322 vs 0.372 over ≈ 200 checked tokens each is about one
    standard error; the margin alone rolled back a draft that had evaluated better. A drop of 0.1 over
    four times the window is 4.3 standard errors: rolled back."""
    def run(window: int, v2_hits: int, z: float) -> list:
        reg = FakeRegistry()
        f = Fleet(reg, window=window, margin=0.05, z=z)
        for i in range(window):  # v1 accepts 372 of every 1000 single draft tokens
            f.steps(1, accepted=int((i + 1) * 0.372) - int(i * 0.372), version="v1", gamma=1)
        f.promote()
        for i in range(window):
            f.steps(1, accepted=int(i < v2_hits), version="v2", gamma=1)
        return reg.calls

    assert run(200, v2_hits=62, z=3.0) == []  # 0.310 vs 0.370: 1.3 standard errors
    assert [c[1] for c in run(200, v2_hits=62, z=0.0)] == ["v1"]  # the margin alone: rolled back
    calls = run(800, v2_hits=217, z=3.0)  # 0.271 vs 0.371
    assert [c[1] for c in calls] == ["v1"] and "standard errors" in calls[0][2]


def test_a_version_served_at_a_smaller_gamma_is_not_mistaken_for_a_worse_one():
    """The adaptive policy moves γ: v1 served at γ = 5, v2 at γ = 1, both accepting every draft token
    they check. v2's accept length (2) is far below v1's (6), its acceptance rate is not: it stays.
    Judged on the accept length, as before, it was rolled back."""
    reg = FakeRegistry()
    f = Fleet(reg, window=100, margin=0.05)
    f.steps(300, accepted=5, version="v1", gamma=5)
    f.promote()
    f.steps(150, accepted=1, version="v2", gamma=1)
    assert reg.calls == [] and f.guard.last("m") is None and f.guard.watching("m") is None
    # the same γ = 1 with half of the checked tokens rejected is worse: rolled back
    reg2 = FakeRegistry()
    g = Fleet(reg2, window=100, margin=0.05)
    g.steps(300, accepted=5, version="v1", gamma=5)
    g.promote()
    for _ in range(60):
        g.steps(1, accepted=1, version="v2", gamma=1)
        g.steps(1, accepted=0, version="v2", gamma=1)
    assert [c[:2] for c in reg2.calls] == [("m", "v1")] and g.guard.last("m").live_acceptance_rate == 0.5


def test_after_a_domain_shift_the_new_version_is_compared_with_the_old_one_on_the_new_traffic():
    """v1 accepts every checked token on domain A for 2000 verifications, then half on domain B (the
    shift). v2, promoted 300 verifications into B, accepts half on B too: the same as v1 on the same
    traffic, so it stays. v1's long EMA (the controller's default 1000-observation horizon) still
    remembers A (≈ 0.8): against it, as before, v2 was rolled back. A v3 that accepts a third on
    B is worse than v1 there and is rolled back."""
    def fleet(registry):
        f = Fleet(registry, window=200, margin=0.05, long_horizon=1000)
        for _ in range(20):  # the controller evaluates every 100 verifications
            f.steps(100, accepted=3, version="v1", gamma=3)  # rate 3/3
        for _ in range(3):
            f.steps(100, accepted=1, version="v1", gamma=3)  # rate 1/2 (2 checked, 1 accepted)
        assert next(d for d in f.stats.drafts("m") if d.draft_version == "v1").rate_long.value > 0.75
        return f

    reg = FakeRegistry()
    f = fleet(reg)
    f.promote()
    f.steps(250, accepted=1, version="v2", gamma=3)
    assert reg.calls == [] and f.guard.watching("m") is None

    reg3 = FakeRegistry(current="v3")
    g = fleet(reg3)
    g.promote(new="v3")
    for _ in range(125):
        g.steps(1, accepted=1, version="v3", gamma=3)
        g.steps(1, accepted=0, version="v3", gamma=1)  # rate (1 + 0) / (2 + 1) = 1/3 < 1/2 - 0.05
    ((_, to_version, reason),) = reg3.calls
    assert to_version == "v1" and "v1's 0.500 over its last 200" in reason


def test_a_manual_promotion_is_noticed_from_the_serving_version():
    reg = FakeRegistry(current="v7")
    f = Fleet(reg, window=50, margin=0.05)
    f.steps(200, accepted=3, version="v1")  # accept length 4, rate 1
    f.steps(1, accepted=1, version="v7")  # workers moved to v7 without a training outcome (rate 0.5)
    assert f.guard.watching("m").previous == "v1"
    f.steps(60, accepted=1, version="v7")
    assert [c[:2] for c in reg.calls] == [("m", "v1")] and "serving version changed from v1" in reg.calls[0][2]


def regressed(registry, error: Exception | None = None) -> Fleet:
    """v1 served well for 100 verifications, v2 promoted, then 30 verifications of v2 (past the
    window of 20) accepting nothing, with `registry` raising `error` (if any) meanwhile."""
    f = Fleet(registry, window=20)
    f.steps(100, accepted=2, version="v1")
    f.promote()
    if error is not None:
        registry.error = error
    f.steps(30, accepted=0, version="v2")
    return f


def test_no_rollback_when_the_registry_moved_on_or_is_pinned():
    for reg in (FakeRegistry(current="v3"), FakeRegistry(current="v2", pinned="v2")):
        f = regressed(reg)
        assert reg.calls == [] and f.guard.watching("m") is None and f.guard.last("m") is None


class PromotedMeanwhile(FakeRegistry):
    """An operator promotes v3 between the guard's pointer check and its rollback call."""

    def pointer(self, target_model):
        seen = super().pointer(target_model)
        self.current = "v3"
        return seen


def test_a_promotion_racing_the_rollback_wins():
    reg = PromotedMeanwhile()
    f = regressed(reg)
    assert reg.calls == [] and reg.current == "v3"  # v3 was not undone
    assert f.guard.last("m") is None and f.guard.counts() == ({}, {"m": 1})


def test_registry_errors_retry_or_give_up():
    reg = FakeRegistry()
    f = regressed(reg, RegistryUnavailable("down"))
    assert reg.calls == [] and f.guard.watching("m") is not None and f.guard.counts() == ({}, {"m": 1})
    reg.error = None
    f.steps(1, accepted=0, version="v2")  # the next evaluation retries
    assert [c[:2] for c in reg.calls] == [("m", "v1")]

    f = regressed(FakeRegistry(), RollbackRefused("FAILED_PRECONDITION: no previous draft"))
    assert f.guard.watching("m") is None and f.guard.counts() == ({}, {"m": 1})  # not retried forever


def test_disabled_without_a_registry():
    f = regressed(None)
    assert not f.guard.enabled and f.guard.watching("m") is None and f.guard.last("m") is None

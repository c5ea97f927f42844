"""Collection control (TIDE Algorithm 1) and the decisions it leads to, without transport: cold start
below the γ policy's break-even, shift, learning the traffic, no gain after training, the hysteresis
of both edges, forced modes, and decision ids that are never reused."""

from __future__ import annotations

import dataclasses

import pytest

from services.controller.app import Controller
from services.controller.collection import CollectionConfig, CollectionControl, Signal
from services.controller.decisions import DecisionIssuer, StaticDecision
from services.controller.outcomes import TrainingOutcome
from services.controller.stats import DraftStats, Ema, FleetStats
from tide.telemetry import StepRecord

# Algorithm 1 as written: no learning rule, no hysteresis (tests of those replace the fields)
CFG = CollectionConfig(shift_epsilon=0.15, min_observations=50, no_gain_runs=2, gain_margin=0.02,
                       tokens_needed=1000, learn=False, min_on_s=0.0, shift_hold_s=0.0)


def draft(version="v1", accept=3.0, short=0.7, long=0.7, n=100) -> DraftStats:
    """`accept`: the accept-length EMAs; `short` / `long`: the acceptance-rate EMAs (shift; long: cold start)."""
    d = DraftStats(version, Ema(50, accept, n), Ema(1000, accept, n), verify_steps=n, tokens=int(accept * n))
    for rate, value in ((d.rate_short, short), (d.rate_long, long)):
        rate.update(value, 1.0)
    return d


def sig(version="v1", accept=3.0, short=0.7, long=0.7, n=100, emitted=0) -> Signal:
    return Signal(version, draft(version, accept, short, long, n), emitted)


def no_gain(run: str, promoted=False, cand=1.5, base=1.5) -> TrainingOutcome:
    return TrainingOutcome(run, "m", "c-" + run, "v1", cand, base, promoted)


def state(ctl: CollectionControl):
    s = ctl.state("m")
    return s.enabled, s.reason


def test_cold_start_turns_collection_on():
    ctl = CollectionControl(CFG)
    assert not ctl.evaluate("m", Signal("", None, 0), now=1.0)  # no telemetry yet: undecided
    assert state(ctl) == (None, "waiting for telemetry")
    assert ctl.evaluate("m", Signal("", draft(""), 10), now=2.0)  # steps without a draft version: n-gram
    assert state(ctl) == (True, "cold start") and ctl.state("m").since_unix_s == 2.0

    weak = CollectionControl(CFG)
    weak.evaluate("m", sig(accept=1.6, n=10), now=1.0)  # too few verifications to judge the draft
    assert state(weak) == (None, "waiting for 50 verifications of v1")
    weak.evaluate("m", sig(accept=1.1, short=0.15, long=0.15, n=60), now=2.0)  # below break-even (0.19)
    assert state(weak) == (True, "cold start")
    assert weak.change_counts() == {("m", "cold start"): 1}


def test_cold_start_is_the_gamma_policys_break_even_on_these_step_costs():
    """A draft accepting 30 % of its tokens pays where a draft step is cheap and does not where it
    costs half a target step: break-even = (1 + min_gain)(verify[1] + draft) - 1."""
    from tide.policies.costs import StepCosts

    cheap, dear = StepCosts(draft=0.05), StepCosts(draft=0.5)
    assert cheap.break_even_rate() == pytest.approx(1.05 * 1.06 - 1) and dear.break_even_rate() > 0.5
    assert StepCosts().break_even_rate() == pytest.approx(0.19, abs=0.005)  # the reference CPU
    for costs, expected in ((cheap, (False, "no shift")), (dear, (True, "cold start"))):
        ctl = CollectionControl(CFG, break_even=lambda _t, c=costs: c.break_even_rate())
        ctl.evaluate("m", sig(accept=1.4, short=0.3, long=0.3), now=1.0)
        assert state(ctl) == expected


def test_shift_turns_collection_on_and_tokens_are_counted():
    ctl = CollectionControl(CFG)
    ctl.evaluate("m", sig(short=0.7, long=0.7, emitted=500), now=1.0)
    assert state(ctl) == (False, "no shift") and ctl.state("m").tokens_collected == 0
    ctl.evaluate("m", sig(short=0.6, long=0.7, emitted=600), now=2.0)  # within epsilon: no shift
    assert state(ctl) == (False, "no shift")
    assert ctl.evaluate("m", sig(short=0.5, long=0.7, emitted=700), now=3.0)
    assert state(ctl) == (True, "shift detected")
    ctl.evaluate("m", sig(short=0.7, long=0.7, emitted=1900), now=4.0)  # on until training says otherwise
    s = ctl.state("m")
    assert (s.enabled, s.tokens_collected, s.tokens_needed, s.since_unix_s) == (True, 1200, 1000, 3.0)


def test_no_gain_twice_turns_collection_off_until_a_later_shift():
    ctl = CollectionControl(CFG)
    ctl.evaluate("m", sig(short=0.4, long=0.7, emitted=100), now=1.0)
    assert state(ctl) == (True, "shift detected")
    assert not ctl.on_outcome(no_gain("r1"), "v1", now=2.0)  # one run without gain: still on
    assert not ctl.on_outcome(no_gain("r2", promoted=True, cand=2.0, base=1.0), "v1", now=3.0)  # a gain resets
    assert not ctl.on_outcome(no_gain("r3", promoted=True, cand=1.51, base=1.5), "v1", now=4.0)  # < gain margin
    ctl.evaluate("m", sig(short=0.4, long=0.7, emitted=300), now=5.0)
    assert state(ctl) == (True, "shift detected")
    assert ctl.on_outcome(no_gain("r4"), "v1", now=6.0)  # second in a row
    assert state(ctl) == (False, "no gain after training") and ctl.state("m").tokens_collected == 200
    ctl.evaluate("m", sig(short=0.4, long=0.7), now=7.0)  # the same shift persists: stays off
    assert state(ctl) == (False, "no gain after training")
    ctl.evaluate("m", sig(short=0.7, long=0.7), now=8.0)  # the shift is over
    assert state(ctl) == (False, "no gain after training")
    assert ctl.evaluate("m", sig(short=0.5, long=0.7), now=9.0)  # a later shift
    assert state(ctl) == (True, "shift detected")
    assert ctl.change_counts() == {("m", "shift detected"): 2, ("m", "no gain after training"): 1}


def test_learning_collects_a_good_draft_on_unshifted_traffic_until_training_stops_gaining():
    """A draft trained elsewhere serves a new domain from the start: its EMAs begin on that traffic, so
    there is no shift to see and it is not weak, yet fine-tuning on the traffic is what the loop is for
    (issue 34). With `learn`, collection opens at the first judgement and the no-gain rule ends it."""
    plain = CollectionControl(CFG)
    plain.evaluate("m", sig(accept=1.8, emitted=100), now=1.0)
    assert state(plain) == (False, "no shift")  # Algorithm 1 as written: nothing to learn from
    assert CollectionConfig().learn  # the default learns
    ctl = CollectionControl(dataclasses.replace(CFG, learn=True))
    ctl.evaluate("m", sig(accept=1.8, n=10), now=1.0)
    assert state(ctl) == (None, "waiting for 50 verifications of v1")  # not judged yet
    assert ctl.evaluate("m", sig(accept=1.8, emitted=100), now=2.0)
    assert state(ctl) == (True, "learning the traffic")
    assert not ctl.on_outcome(no_gain("r1", promoted=True, cand=2.1, base=1.8), "v2", now=3.0)  # a gain
    assert not ctl.on_outcome(no_gain("r2"), "v2", now=4.0)
    assert ctl.on_outcome(no_gain("r3"), "v2", now=5.0)  # two in a row without gain: off
    assert state(ctl) == (False, "no gain after training")
    for now, s in ((6.0, sig(version="v2", accept=2.1)), (7.0, sig(version="v2", accept=2.1, short=0.7))):
        assert not ctl.evaluate("m", s, now=now)  # learning is spent: no flapping back on
        assert state(ctl) == (False, "no gain after training")
    assert ctl.evaluate("m", sig(version="v2", accept=2.1, short=0.4, long=0.7), now=8.0)  # a later shift
    assert state(ctl) == (True, "shift detected")


def test_no_gain_waits_for_min_on_s_and_a_gain_in_between_cancels_it():
    """Two small cycles missing the margin right after collection opened are noise, not a plateau
    (the quick horizon run turned collection off 110 s after it opened while the draft was still
    learning): the off waits until collection has been on for `min_on_s`."""
    ctl = CollectionControl(dataclasses.replace(CFG, learn=True, min_on_s=300.0))
    ctl.evaluate("m", sig(emitted=100), now=0.0)
    assert state(ctl) == (True, "learning the traffic")
    assert not ctl.on_outcome(no_gain("r1"), "v1", now=60.0)
    assert not ctl.on_outcome(no_gain("r2"), "v1", now=110.0)  # the verdict, but too early
    assert not ctl.evaluate("m", sig(emitted=200), now=200.0) and state(ctl) == (True, "learning the traffic")
    assert ctl.evaluate("m", sig(emitted=300), now=300.0)  # on for min_on_s: now it goes off
    assert state(ctl) == (False, "no gain after training")

    gained = CollectionControl(dataclasses.replace(CFG, learn=True, min_on_s=300.0))
    gained.evaluate("m", sig(emitted=100), now=0.0)
    gained.on_outcome(no_gain("r1"), "v1", now=60.0)
    gained.on_outcome(no_gain("r2"), "v1", now=110.0)
    gained.on_outcome(no_gain("r3", promoted=True, cand=1.7, base=1.5), "v2", now=200.0)  # it was learning
    for now in (300.0, 400.0):
        assert not gained.evaluate("m", sig("v2", emitted=400), now=now)
    assert state(gained) == (True, "learning the traffic")
    assert not gained.on_outcome(no_gain("r4"), "v2", now=410.0)  # one non-gain after the gain: still on
    assert gained.on_outcome(no_gain("r5"), "v2", now=420.0)  # two, and on for long enough: off at once
    assert state(gained) == (False, "no gain after training")


def test_a_shift_must_hold_for_shift_hold_s():
    """A few seconds of hard prompts dip the short EMA: collection opens for a shift only when the
    condition holds continuously for `shift_hold_s`; an interruption restarts the clock."""
    ctl = CollectionControl(dataclasses.replace(CFG, shift_hold_s=30.0))
    ctl.evaluate("m", sig(short=0.7, long=0.7), now=0.0)
    assert state(ctl) == (False, "no shift")
    for now, short in ((10.0, 0.4), (25.0, 0.4), (30.0, 0.7), (35.0, 0.4), (60.0, 0.4)):
        assert not ctl.evaluate("m", sig(short=short, long=0.7), now=now)
        assert state(ctl) == (False, "no shift")
    assert ctl.evaluate("m", sig(short=0.4, long=0.7), now=65.0)  # 30 s since 35 s
    assert state(ctl) == (True, "shift detected")

@pytest.mark.parametrize("mode", ["on", "off"])
def test_forced_modes_ignore_signals_and_outcomes(mode):
    ctl = CollectionControl(CollectionConfig(mode=mode, no_gain_runs=1))
    assert ctl.evaluate("m", Signal("", None, 0), now=1.0)
    expected = (mode == "on", f"forced {mode} (TIDE_CONTROLLER_COLLECTION={mode})")
    for s in (sig(short=0.1, long=0.7), sig(accept=1.0), sig()):
        assert not ctl.evaluate("m", s, now=2.0)
        assert state(ctl) == expected
    assert not ctl.on_outcome(no_gain("r1"), "v1", now=3.0)
    assert state(ctl) == expected
    late = CollectionControl(CollectionConfig(mode=mode, no_gain_runs=1))
    late.on_outcome(no_gain("r1"), "v1", now=1.0)  # a target first heard of through a training outcome
    assert late.evaluate("m", sig(), now=2.0) and state(late) == expected
    with pytest.raises(ValueError):
        CollectionControl(CollectionConfig(mode="sometimes"))


def test_issuer_never_reuses_an_id():
    issuer = DecisionIssuer(StaticDecision())
    a, new_a = issuer.issue("m", True, "cold start")
    assert new_a and a.decision_id.startswith(f"ctl-{issuer.nonce}-") and a.collection_enabled is True
    assert issuer.issue("m", True, "cold start") == (a, False)  # same content: same decision
    b, _ = issuer.issue("m", False, "no gain after training")
    c, new_c = issuer.issue("m", True, "shift detected")  # back to a content issued before
    assert new_c and len({a.decision_id, b.decision_id, c.decision_id}) == 3
    assert "shift detected" in c.reason and c.policy == StaticDecision().policy
    other, _ = issuer.issue("n", True, "cold start")
    assert other.decision_id not in {a.decision_id, c.decision_id}
    restarted = DecisionIssuer(StaticDecision())  # a restarted controller: a new nonce
    assert restarted.nonce != issuer.nonce and restarted.issue("m", True, "x")[0].decision_id != a.decision_id


def step(t: float, accepted: int, version: str = "v1", gamma: int = 3) -> StepRecord:
    return StepRecord(worker_id="w1", step=int(t), time_unix_s=t, batch_size=1, request_ids=["r"], gammas=[gamma],
                      accepted=[accepted], draft_ms=1, verify_ms=5, other_ms=1, drafter="eagle3",
                      draft_version=version, target_model="m")


def test_controller_issues_a_new_decision_on_each_toggle():
    stats = FleetStats(short_horizon=10, long_horizon=200)
    ctl = Controller(StaticDecision(), stats, collection=CollectionControl(CFG))
    undecided = ctl.decision_for("m")
    assert undecided.collection_enabled is None
    for i in range(100):
        stats.observe(step(1000 + i, accepted=2))  # a good draft, stable traffic
    assert ctl.evaluate()
    off = ctl.decision_for("m")
    assert off.collection_enabled is False and off.decision_id != undecided.decision_id
    assert not ctl.evaluate() and ctl.decision_for("m") is off  # nothing changed: no new decision
    for i in range(10):
        stats.observe(step(2000 + i, accepted=0))  # the traffic shifts
    assert ctl.evaluate()
    on = ctl.decision_for("m")
    assert on.collection_enabled is True and "shift detected" in on.reason
    assert ctl.report_outcome(no_gain("r1")) and ctl.decision_for("m") is on
    assert not ctl.report_outcome(no_gain("r1"))  # a retried report counts once
    assert ctl.report_outcome(no_gain("r2"))
    off_again = ctl.decision_for("m")
    assert off_again.collection_enabled is False and "no gain after training" in off_again.reason
    assert len({d.decision_id for d in (undecided, off, on, off_again)}) == 4  # never an id twice


def test_a_change_of_gamma_is_not_a_shift_but_a_drop_in_acceptance_is():
    """The adaptive policy moves γ all the time: the same draft on the same traffic accepts fewer
    tokens per verification at γ = 1 than at γ = 3. Only a lower per-token acceptance is a shift."""
    stats = FleetStats(short_horizon=30, long_horizon=1000)
    ctl = CollectionControl(CFG)
    t = 1000.0
    # Per-token acceptance 2/3 at both γ: accepted / checked = (3+1+0) / (3+2+1) and (1+1+0) / (1+1+1).
    for gamma, pattern, repeats in ((3, (3, 1, 0), 100), (1, (1, 1, 0), 30)):
        for _ in range(repeats):
            for a in pattern:
                t += 1
                stats.observe(step(t, accepted=a, gamma=gamma))
    (d,) = stats.drafts("m")
    assert d.short.value < d.long.value - 0.5  # accept length: 1.67 at γ = 1 against 2.33 at γ = 3
    assert abs(d.rate_short.value - 2 / 3) < 0.03 and abs(d.rate_long.value - 2 / 3) < 0.03
    ctl.evaluate("m", Signal("v1", d, 1000), now=t)
    assert state(ctl) == (False, "no shift")
    for _ in range(20):  # the traffic changes: per-token acceptance 1/4 at γ = 3, (0+0+1) / (1+1+2)
        for a in (0, 0, 1):
            t += 1
            stats.observe(step(t, accepted=a))
    (d,) = stats.drafts("m")
    assert d.rate_short.value < 0.35 < 0.6 < d.rate_long.value
    assert ctl.evaluate("m", Signal("v1", d, 2000), now=t)
    assert state(ctl) == (True, "shift detected")


# Step costs measured on a 2-vCPU AVX2 guest (the worker's latency profile; docs/results/horizon, Zen 3): a verified
# row costs almost a plain step's worth at batch 4, and little at batch 1.
AVX2_B1 = dict(verify=(1.0, 1.30, 1.62, 1.75, 2.20, 2.35), draft=0.113)
AVX2_B4 = dict(verify=(1.0, 1.47, 1.94, 2.41, 2.82, 3.32), draft=0.102)


def test_a_draft_pays_at_batch_1_and_no_reachable_draft_pays_at_batch_4_on_avx2_step_costs():
    from tide.policies.costs import MIN_GAIN, StepCosts

    b1, b4 = StepCosts(**AVX2_B1), StepCosts(**AVX2_B4)
    assert b1.best_speedup(0.6) > 1 + MIN_GAIN > b4.best_speedup(0.6)
    assert b4.best_speedup(0.7) > 1 + MIN_GAIN  # a draft at 0.7 per token would pay even there
    assert b4.best_speedup(0.6) == pytest.approx(1.6 / (1.47 + 0.102))  # γ = 1 is its best
    assert b1.best_speedup(0.0) < 1.0  # a draft that accepts nothing never pays


def test_from_profile_reads_the_costs_at_the_batch():
    from tide.policies.costs import StepCosts
    from tide.policies.profile import LatencyProfile

    profile = LatencyProfile(T_ms={1: {1: 10.0, 2: 11.0, 7: 20.0}, 4: {1: 20.0, 2: 30.0, 7: 80.0}},
                             D_ms={1: 1.0, 4: 2.0})
    b1, b4 = StepCosts.from_profile(profile, "p"), StepCosts.from_profile(profile, "p", batch=4)
    assert b1.verify[1] == pytest.approx(1.1) and b1.draft == pytest.approx(0.1)
    assert b4.verify[1] == pytest.approx(1.5) and b4.draft == pytest.approx(0.1)


def test_load_rule_holds_collection_off_while_no_draft_would_pay_and_lifts_when_the_load_falls():
    """The load rule holds collection off once its condition has held for load_hold_s, and lifts it
    only after the condition has cleared for as long; meanwhile the state machine keeps its state."""
    asked = []

    def pays_at(target, batch, rate):
        asked.append(rate)
        return batch < 2  # a draft pays at one stream only

    cfg = dataclasses.replace(CFG, learn=True, load_hold_s=60.0, reachable_rate=0.6)
    ctl = CollectionControl(cfg, pays_at=pays_at)

    def at(now, batch, emitted=0, rate=0.3):
        return ctl.evaluate("m", dataclasses.replace(sig(long=rate, emitted=emitted), batch=batch), now=now)

    assert at(0.0, 4.0) and state(ctl) == (True, "learning the traffic")  # not held yet
    assert not at(59.0, 4.0, emitted=100)
    assert at(61.0, 4.0, emitted=200) and state(ctl) == (False, "a draft would not pay at this load")
    assert ctl.state("m").since_unix_s == 61.0
    assert asked[-1] == 0.6  # the serving draft's 0.3 is below the reachable rate
    assert not at(100.0, 1.0, emitted=500)  # the load falls ...
    assert not at(130.0, 4.0, emitted=600)  # ... and comes back within load_hold_s: still held
    assert not at(180.0, 1.0, emitted=700)
    assert ctl.state("m").tokens_collected == 200  # nothing counted while held
    assert not at(239.0, 1.0, emitted=800)
    assert at(240.0, 1.0, emitted=900) and state(ctl) == (True, "learning the traffic")
    assert ctl.change_counts()[("m", "a draft would not pay at this load")] == 1
    assert ctl.change_counts()[("m", "load low enough for a draft to pay")] == 1
    at(250.0, 4.0, rate=0.8)
    assert asked[-1] == 0.8  # a draft already better than the reachable rate is judged at its own


def test_load_rule_off_without_a_batch_a_cost_model_or_a_reachable_rate():
    never = lambda target, batch, rate: False  # noqa: E731
    cfg = dataclasses.replace(CFG, learn=True, load_hold_s=0.0)
    for ctl, batch in ((CollectionControl(cfg, pays_at=never), None),
                       (CollectionControl(cfg), 4.0),
                       (CollectionControl(dataclasses.replace(cfg, reachable_rate=0.0), pays_at=never), 4.0)):
        ctl.evaluate("m", dataclasses.replace(sig(long=0.3), batch=batch), now=1.0)
        ctl.evaluate("m", dataclasses.replace(sig(long=0.3), batch=batch), now=2.0)
        assert state(ctl) == (True, "learning the traffic")


def test_controller_feeds_the_workers_running_batch_to_the_load_rule():
    now = [1000.0]
    batches = []

    def pays_at(target, batch, rate):
        batches.append(batch)
        return batch < 2

    stats = FleetStats(short_horizon=10, long_horizon=200, window_s=30.0)
    cfg = dataclasses.replace(CFG, learn=True, load_hold_s=10.0)
    ctl = Controller(StaticDecision(), stats, collection=CollectionControl(cfg, pays_at=pays_at),
                     clock=lambda: now[0])
    for i in range(100):
        stats.observe(dataclasses.replace(step(now[0] - 20 + i * 0.2, accepted=1), batch_size=4))
    assert ctl.evaluate() and ctl.decision_for("m").collection_enabled is True
    assert batches[-1] == pytest.approx(4.0)
    now[0] += 11
    for i in range(10):
        stats.observe(dataclasses.replace(step(now[0] - 2 + i * 0.2, accepted=1), batch_size=4))
    assert ctl.evaluate()
    held = ctl.decision_for("m")
    assert held.collection_enabled is False and "a draft would not pay at this load" in held.reason

"""Seed 004 Method 1: analytical γ (Eq. 1) from per-request MLE α̂ (Eq. 2) and measured times."""

import pytest

from tide.policies.base import RequestView, StepContext, StepFeedback
from tide.policies.estimators import expected_accept_len
from tide.policies.onthefly import OnTheFlyPolicy, best_gamma
from tide.policies.profile import LatencyProfile


def test_eq1_argmax_by_hand():
    verify = lambda g: 40.0 + 2.0 * g  # b_p(γ) ms
    a_q = 2.0
    # α = 0.1: E(1) = 1.1 over 44 ms < 1/40 → γ* = 0 ; α = 0.9: long windows pay
    assert best_gamma(0.1, 8, a_q, verify) == 0
    vals = [expected_accept_len(0.9, g) / (g * a_q + verify(g)) for g in range(9)]
    assert best_gamma(0.9, 8, a_q, verify) == max(range(9), key=vals.__getitem__) > 4


def test_policy_uses_measured_times_and_per_request_alpha():
    pol = OnTheFlyPolicy(profile=None, h=4, init_gamma=2)
    reqs = (RequestView("good"), RequestView("bad"))
    ctx = StepContext(2, reqs, max_gamma=6)
    assert pol.decide(ctx) == [2, 2]  # no data yet: init γ
    pol.observe(StepFeedback(2, (2, 2), (2, 0), step_ms=50.0, draft_ms=4.0, verify_ms=46.0))
    for _ in range(6):
        g = pol.decide(ctx)
        acc = (g[0], 0)  # "good" accepts everything, "bad" nothing
        pol.observe(StepFeedback(2, tuple(g), acc, step_ms=50.0, draft_ms=2.0 * max(g), verify_ms=46.0))
    assert pol.times.draft[2] == pytest.approx(2.0, rel=0.3)
    g = pol.decide(ctx)
    assert g[0] >= 4 and g[1] == 0


def test_new_request_borrows_the_pooled_window():
    prof = LatencyProfile(T_ms={1: {n: 40.0 + n for n in range(1, 10)}}, D0_ms=1.0)
    pol = OnTheFlyPolicy(profile=prof, h=4)
    ctx = StepContext(1, (RequestView("a"),))
    for _ in range(4):
        pol.decide(ctx)
        pol.observe(StepFeedback(1, (3,), (3,), step_ms=45.0, draft_ms=3.0, verify_ms=42.0))
    pol.decide(StepContext(1, (RequestView("new"),)))
    assert pol.alpha_for(pol.requests._states["new"].hist) == 0.98


def test_request_stuck_at_zero_is_probed():
    pol = OnTheFlyPolicy(profile=None, h=2, probe_interval=5)
    ctx = StepContext(1, (RequestView("r"),), max_gamma=4)
    played = []
    for _ in range(40):
        g = pol.decide(ctx)
        pol.observe(StepFeedback(1, tuple(g), (0,), step_ms=40.0, draft_ms=2.0 * g[0], verify_ms=38.0 + g[0]))
        played.append(g[0])
    assert played.count(0) > 20 and 1 in played[10:]

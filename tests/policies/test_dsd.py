"""DSD / SmartSpec goodput model: latency fit, argmax, and its decision deadlock."""

import pytest

from tide.policies.base import RequestView, StepContext, StepFeedback
from tide.policies.dsd import DecayedLeastSquares, DSDPolicy
from tide.policies.profile import synthetic_profile


def test_least_squares_recovers_a_linear_latency_model():
    fit = DecayedLeastSquares(3, decay=0.999)
    for b in (1, 4, 16, 32):
        for n in (1, 2, 4):
            fit.add([1.0, b, b * n], 30.0 + 4.0 * b + 0.5 * b * n)
    assert fit.coef() == pytest.approx([30.0, 4.0, 0.5], abs=1e-3)
    assert DecayedLeastSquares(3).predict([1.0, 1.0, 1.0]) is None


def test_goodput_argmax_turns_speculation_off_for_a_bad_draft():
    pol = DSDPolicy(synthetic_profile())
    reqs = tuple(RequestView(f"r{i}") for i in range(8))
    assert pol.decide(StepContext(8, reqs)) == [3] * 8  # no acceptance history yet: init γ
    for _ in range(8):
        pol.observe(StepFeedback(8, (3,) * 8, (3,) * 8, step_ms=80.0, draft_ms=6.0, verify_ms=74.0))
    assert pol.decide(StepContext(8, reqs))[0] >= 3
    for _ in range(8):
        pol.observe(StepFeedback(8, (3,) * 8, (0,) * 8, step_ms=80.0, draft_ms=6.0, verify_ms=74.0))
    assert pol.decide(StepContext(8, reqs)) == [0] * 8


def test_decision_deadlock_is_faithfully_reproduced():
    """Seed 001's criticism of DSD: once k = 0 wins, α̂ never moves again."""
    pol = DSDPolicy(synthetic_profile())
    reqs = tuple(RequestView(f"r{i}") for i in range(4))
    for _ in range(10):
        pol.observe(StepFeedback(4, (2,) * 4, (0,) * 4, step_ms=60.0, draft_ms=4.0, verify_ms=56.0))
    for _ in range(500):  # the draft would now be perfect, but k = 0 produces no evidence
        g = pol.decide(StepContext(4, reqs))
        pol.observe(StepFeedback(4, tuple(g), tuple(g), step_ms=55.0, draft_ms=0.0, verify_ms=55.0))
        assert g == [0] * 4

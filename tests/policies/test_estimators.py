"""Shared estimators: seed 004 Eq. 2 MLE with the 0.98 cap, windows, ageing EMA, buckets, probes."""

import pytest

from tide.policies.base import RequestView, StepContext
from tide.policies.estimators import (
    ALPHA_CAP,
    AcceptanceEMA,
    History,
    OffProbe,
    RequestStates,
    batch_bucket,
    expected_accept_len,
    mle_alpha,
)


def test_expected_accept_len_is_eq2():
    assert expected_accept_len(0.6, 3) == pytest.approx((1 - 0.6**4) / 0.4)
    assert expected_accept_len(0.6, 0) == 1.0
    assert expected_accept_len(1.0, 3) == 4.0


def test_mle_is_eq2_by_hand():
    # γ=3 V=3 (no rejection), γ=3 V=1 (rejected), γ=2 V=0 (rejected): ΣV = 4, Σ1(V<γ) = 2 → 4/6
    assert mle_alpha([3, 3, 2], [3, 1, 0]) == pytest.approx(4 / 6)
    assert mle_alpha([0, 0], [0, 0], default=None) is None  # γ = 0 steps carry no information
    assert mle_alpha([4, 0], [1, 0]) == pytest.approx(0.5)


def test_mle_is_capped_at_098():
    assert ALPHA_CAP == 0.98
    assert mle_alpha([5] * 10, [5] * 10) == 0.98  # all accepted: raw estimate 1 → capped
    h = History(4)
    for _ in range(6):
        h.add(3, 3)
    assert h.alpha() == 0.98
    assert expected_accept_len(0.98, 3) < 4.0


def test_history_window_drops_old_steps():
    h = History(2)
    h.add(3, 0)  # rejected at depth 1
    h.add(0, 0)  # ignored
    h.add(2, 2)
    h.add(2, 2)  # pushes out the rejection
    assert h.counts() == (4, 0)
    assert list(h.gammas) == [2, 2]


def test_acceptance_ema_ages_toward_its_prior():
    est = AcceptanceEMA(decay=0.9, prior=0.5, prior_weight=2.0)
    for _ in range(50):
        est.update([3] * 8, [0] * 8)
    assert est.value < 0.02  # 1 / (80 + 2): steady-state 8 failures per step / (1 − 0.9)
    for _ in range(100):  # no speculation: the old evidence fades
        est.update([0] * 8, [0] * 8)
    assert est.value == pytest.approx(0.5, abs=0.01)


def test_batch_buckets_are_powers_of_two():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 7, 8, 63, 64)] == [1, 2, 2, 4, 4, 8, 32, 64]


def test_probe_fires_after_interval_and_rotates():
    probe = OffProbe(interval=3, requests=2, fraction=0.25)
    for _ in range(3):
        assert not probe.due()
        probe.record([0, 0])
    assert probe.due()
    first, second = probe.pick(16), probe.pick(16)
    assert len(first) == 4 and first.isdisjoint(second)  # ⌈0.25·16⌉, rotating
    assert len(probe.pick(3)) == 2
    probe.record([0, 1])
    assert not probe.due()


def test_request_states_follow_the_batch_and_guard_observe():
    states: RequestStates[list] = RequestStates()
    ctx = StepContext(2, (RequestView("a"), RequestView("b")))
    a, b = states.begin(ctx, lambda r: [r.request_id])
    assert states.take(2) == [a, b]
    assert states.take(2) == []  # observe without a new decide updates nobody
    states.begin(StepContext(1, (RequestView("b"),)), lambda r: [r.request_id])
    assert len(states) == 1 and states.take(3) == []  # length mismatch: ignored

"""LatencyProfile: interpolation, the synthetic BRIEF §5 profile, JSON shapes."""

import json

import pytest

from tide.policies.profile import BRIEF_ANCHORS_MS, LatencyProfile, interp1, synthetic_profile


def test_interp1_is_piecewise_linear_and_never_decreases_when_extrapolating():
    pts = [(1.0, 10.0), (4.0, 16.0), (8.0, 40.0)]
    assert interp1(pts, 1.0) == 10.0
    assert interp1(pts, 2.5) == pytest.approx(13.0)
    assert interp1(pts, 6.0) == pytest.approx(28.0)
    assert interp1(pts, 10.0) == pytest.approx(52.0)  # last slope 6 ms/token carried on
    falling = [(1.0, 10.0), (2.0, 9.0)]
    assert interp1(falling, 5.0) == pytest.approx(9.0)  # measured noise never makes more work cheaper
    assert interp1([(3.0, 7.0)], 100.0) == 7.0


def test_synthetic_profile_hits_the_brief_measurements():
    prof = synthetic_profile()
    for (b, n), ms in BRIEF_ANCHORS_MS.items():
        assert prof.target_ms(b, n) == pytest.approx(ms, abs=0.05)


def test_synthetic_profile_is_memory_bound_small_and_compute_bound_large():
    prof = synthetic_profile()
    beta = lambda b: prof.target_ms(b, 4) / prof.target_ms(b, 1)  # seed 000 β(b) at γ = 3
    assert beta(1) < 1.1
    assert beta(64) > 1.6
    assert all(beta(b1) <= beta(b2) + 1e-9 for b1, b2 in [(1, 4), (4, 16), (16, 32), (32, 64)])
    for b in (1, 8, 32, 64):
        row = [prof.target_ms(b, n) for n in range(1, 10)]
        assert row == sorted(row)
    assert prof.draft_ms(1) == pytest.approx(1.7)
    assert prof.draft_ms(64) > prof.draft_ms(1)


def test_fractional_tokens_and_batches_interpolate():
    prof = synthetic_profile()
    lo, hi = prof.target_ms(20, 2), prof.target_ms(20, 3)
    assert lo < prof.target_ms(20, 2.5) < hi
    assert prof.target_ms(16, 1) < prof.target_ms(20, 1) < prof.target_ms(24, 1)


def test_engine_benchmark_shape_loads_and_defaults_apply():
    text = json.dumps({"T_ms": {"1": {"1": 42.0, "4": 45.0}, "16": {"1": 103.0, "4": 121.0}}, "D0_ms": 1.7})
    prof = LatencyProfile.from_json(text)
    assert prof.target_ms(1, 4) == 45.0
    assert prof.target_ms(8.5, 1) == pytest.approx(72.5)  # halfway between b = 1 and 16
    assert prof.draft_ms(16) == 1.7  # D(b) ≈ D0 (seed 000 §4.1)
    assert prof.catchup_ms(0, 16) == 0.0
    assert prof.catchup_ms(10, 4) == pytest.approx(1.7)  # catchup_ms_per_token defaults to 0
    assert prof.step_ms(1, 3) == pytest.approx(45.0 + 3 * 1.7)
    assert prof.batches == [1, 16]


def test_round_trip_keeps_every_table(tmp_path):
    prof = LatencyProfile(
        T_ms={1: {1: 10.0, 2: 11.0}, 8: {1: 20.0, 2: 30.0}},
        D0_ms=1.0,
        D_ms={1: 1.0, 8: 2.0},
        C_ms={8: {10: 5.0, 100: 40.0}},
        prefill_ms_per_token=0.5,
        meta={"target": "x"},
    )
    path = tmp_path / "p.json"
    prof.save(path)
    back = LatencyProfile.load(path)
    assert back.to_dict() == prof.to_dict()
    assert back.catchup_ms(55, 8) == pytest.approx(22.5)
    assert back.draft_ms(4.5) == pytest.approx(1.5)
    assert back.prefill_ms(10) == 5.0


def test_table5_shape_uses_total_tokens():
    prof = LatencyProfile(T_total_ms={1: 3.416, 4: 4.341, 16: 6.123, 64: 9.345}, D0_ms=0.393)
    assert prof.target_ms(4, 4) == pytest.approx(6.123)  # T(b(γ+1)) with b = 4, γ = 3
    assert prof.target_ms(1, 1) == pytest.approx(3.416)


def test_profile_needs_a_target_table():
    with pytest.raises(ValueError):
        LatencyProfile(D0_ms=1.0)
    with pytest.raises(ValueError):
        LatencyProfile.from_dict({"T_ms": {"1": {"1": 1.0}}})

"""No decision deadlock: after a phase with a useless draft, speculation comes back.

Trace: α = 0.7 for 40 s, the draft useless (α = 0) for 40 s, α = 0.7 again for 40 s (all draft
quality changes apply to every running request at once). After the good phase starts, each
adaptive policy must speculate on most steps again within a bounded number of steps and stay
there. DSD is the documented exception (seed 001: it deadlocks); Nightjar is only checked at low
load: its cumulative-average goodput remembers the bad phase, so at b = 32 it needs far longer
than this trace to come back (its exploration still plays γ > 0, which is checked).
"""

import pytest

from tide.policies.profile import synthetic_profile
from tide.policies.registry import ADAPTIVE_NAMES, make_policy
from tide.policies.simulator import simulate
from tide.policies.workload import shifting_alpha

PROFILE = synthetic_profile()
BOUND_STEPS = 150  # ≈ 6 s at b = 4, ≈ 30 s at b = 32


def recovery(name: str, concurrency: int) -> tuple[int | None, float, float]:
    wl = shifting_alpha((1.0, 0.0, 1.0), concurrency=concurrency, phase_s=40.0)
    res = simulate(make_policy(name, {}, PROFILE), wl, PROFILE, record_trace=True)
    bad = [g for t, _, g in res.trace if 50.0 <= t < 80.0]
    good = [g for t, _, g in res.trace if 80.0 <= t < 120.0]
    first = next((i for i, g in enumerate(good) if g >= 0.5), None)
    tail = good[len(good) // 2 :]
    return first, sum(bad) / len(bad), sum(1 for g in tail if g >= 0.5) / len(tail)


@pytest.mark.parametrize("name", [n for n in ADAPTIVE_NAMES if n != "dsd"])
def test_returns_at_low_load(name):
    first, _, on = recovery(name, 4)
    assert first is not None and first <= BOUND_STEPS
    assert on >= 0.8


@pytest.mark.parametrize("name", [n for n in ADAPTIVE_NAMES if n not in ("dsd", "nightjar")])
def test_returns_at_high_load(name):
    first, _, on = recovery(name, 32)
    assert first is not None and first <= BOUND_STEPS
    assert on >= 0.8


@pytest.mark.parametrize("name", ["tide", "onthefly", "adaptive"])
def test_model_policies_do_switch_off_in_the_bad_phase(name):
    _, bad_gamma, _ = recovery(name, 4)
    assert bad_gamma < 0.5


def test_dsd_deadlocks_as_seed_001_says():
    first, bad_gamma, on = recovery("dsd", 4)
    assert bad_gamma < 0.1 and first is None and on == 0.0

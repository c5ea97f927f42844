"""Workload generators: phases, per-request acceptance traces, arrivals, replay from telemetry."""

import pytest

from tide.policies.workload import (
    DEFAULT_DOMAINS,
    Domain,
    Phase,
    RequestSpec,
    Workload,
    fixed_workload,
    low_high,
    replay_workload,
    requests_from_step_records,
)
from tide.telemetry import StepRecord


def test_phase_needs_exactly_one_arrival_mode():
    with pytest.raises(ValueError):
        Phase("x", 1.0)
    with pytest.raises(ValueError):
        Phase("x", 1.0, concurrency=2, rate_rps=1.0)


def test_requests_are_a_pure_function_of_seed_phase_and_index():
    wl = low_high()
    a, b = wl.request(1, 7), wl.request(1, 7)
    assert a == b
    assert wl.request(1, 8) != a
    assert low_high(seed=1).request(1, 7) != a
    assert len(a.u) == len(a.accept_p) == a.output_len >= 16


def test_per_domain_alpha_and_mix():
    wl = Workload(phases=(Phase("c", 1.0, concurrency=1, mix={"code": 1.0}),), domains=DEFAULT_DOMAINS)
    reqs = [wl.request(0, k) for k in range(400)]
    assert {r.domain for r in reqs} == {"code"}
    mean = sum(r.accept_p[0] for r in reqs) / len(reqs)
    assert mean == pytest.approx(DEFAULT_DOMAINS["code"].alpha, abs=0.02)


def test_accepted_runs_until_the_first_rejection_with_depth_decay_and_scale():
    spec = RequestSpec("r", "d", 0, 6, accept_p=[0.5] * 6, u=[0.0, 0.1, 0.45, 0.2, 0.9, 0.0])
    assert spec.accepted(1, 4, depth_decay=1.0) == 3  # u = 0.1, 0.45, 0.2 < 0.5; 0.9 rejects
    assert spec.accepted(1, 4, depth_decay=0.8) == 1  # depth 2 needs u < 0.4
    assert spec.accepted(1, 4, depth_decay=1.0, scale=0.0) == 0  # a useless draft
    assert spec.accepted(5, 4, depth_decay=1.0) == 1  # never past the end of the output


def test_poisson_and_bursty_arrivals():
    poisson = Workload(phases=(Phase("p", 200.0, rate_rps=2.0),), domains={"d": Domain("d", 0.5)})
    times = poisson.arrivals(0)
    assert len(times) == pytest.approx(400, rel=0.15) and times == sorted(times)
    bursty = Workload(phases=(Phase("b", 200.0, rate_rps=2.0, burst=5.0),), domains={"d": Domain("d", 0.5)})
    bt = bursty.arrivals(0)
    assert len(bt) == pytest.approx(400, rel=0.35)
    assert len(set(bt)) < len(bt) / 2  # arrivals share timestamps: bursts


def test_replay_rebuilds_acceptance_from_step_records():
    recs = [
        StepRecord("w", 1, 100.0, 2, ["a", "b"], [3, 2], [3, 0], 1.0, 10.0, 0.0),
        StepRecord("w", 2, 100.1, 2, ["a", "b"], [3, 2], [1, 2], 1.0, 10.0, 0.0),
        StepRecord("w", 3, 100.3, 1, ["b"], [0], [0], 0.0, 10.0, 0.0),
    ]
    reqs = dict((spec.rid, (t, spec)) for t, spec in requests_from_step_records(recs))
    t_a, a = reqs["a"]
    assert t_a == 0.0 and a.output_len == 4 + 2
    assert a.accept_p[:3] == [1.0, 1.0, 1.0]  # step 1 accepted 3
    assert a.accept_p[4] == 1.0 and a.accept_p[5] == 0.0  # step 2: 1 accepted then a rejection
    _, b = reqs["b"]
    assert b.accept_p[0] == 0.0  # rejected at once
    assert a.accepted(0, 3, depth_decay=1.0) == 3
    wl = replay_workload(recs)
    assert len(wl.replay) == 2 and wl.phases[0].rate_rps == 0.0


def test_explicit_per_token_traces_run_in_the_simulator():
    from tide.policies.base import FixedGamma
    from tide.policies.profile import synthetic_profile
    from tide.policies.simulator import simulate

    easy = RequestSpec.from_probs("easy", [1.0] * 41)
    hard = RequestSpec.from_probs("hard", [0.0] * 41)
    wl = fixed_workload([(0.0, easy), (0.5, hard)])
    res = simulate(FixedGamma(4), wl, synthetic_profile())
    assert res.tokens_emitted == 82 and res.requests == 2
    # easy: the 40 tokens after the first in 8 steps of 5; hard: 39 speculating steps of 1, and
    # its last token decoded with γ capped to 0 (not a speculation step)
    assert res.overall.steps == 8 + 40
    assert res.overall.accept_len == (8 * 5 + 39) / (8 + 39)

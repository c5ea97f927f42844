"""Seed 004 §4.2: FSM and cache-FSM γ counters."""

from tide.policies.base import RequestView, StepContext, StepFeedback
from tide.policies.fsm import CacheFSMPolicy, FSMPolicy


def run(policy, accepted_fn, hits_fn=None, steps=6):
    ctx = StepContext(1, (RequestView("r"),), max_gamma=8)
    played = []
    for _ in range(steps):
        g = policy.decide(ctx)[0]
        v = accepted_fn(g)
        hits = () if hits_fn is None else (hits_fn(g, v),)
        policy.observe(StepFeedback(1, (g,), (v,), step_ms=10.0, cache_hits=hits))
        played.append(g)
    return played


def test_fsm_counts_up_on_full_acceptance_and_down_on_rejection():
    assert run(FSMPolicy(init_gamma=3, max_gamma=5), lambda g: g) == [3, 4, 5, 5, 5, 5]
    assert run(FSMPolicy(init_gamma=3), lambda g: 0) == [3, 2, 1, 0, 1, 0]  # γ = 0 "accepts all" → 1


def test_fsm_state_is_per_request():
    pol = FSMPolicy(init_gamma=2)
    ctx = StepContext(2, (RequestView("a"), RequestView("b")))
    g = pol.decide(ctx)
    pol.observe(StepFeedback(2, tuple(g), (2, 0), step_ms=10.0))
    assert pol.decide(ctx) == [3, 1]
    assert pol.decide(StepContext(1, (RequestView("c"),))) == [2]  # finished requests are dropped


def test_cache_fsm_moves_on_cache_hits():
    # hit + all accepted: +2 ; hit, partial: +1 ; no hit: −1
    pol = CacheFSMPolicy(init_gamma=2, max_gamma=8)
    assert run(pol, lambda g: g, lambda g, v: 1, steps=3) == [2, 4, 6]
    pol = CacheFSMPolicy(init_gamma=4)
    assert run(pol, lambda g: 1, lambda g, v: 1, steps=3) == [4, 5, 6]
    pol = CacheFSMPolicy(init_gamma=4)
    assert run(pol, lambda g: g, lambda g, v: 0, steps=3) == [4, 4, 4]  # −1 +1
    pol = CacheFSMPolicy(init_gamma=3)
    assert run(pol, lambda g: 0, lambda g, v: 0, steps=5) == [3, 2, 1, 0, 1]


def test_cache_fsm_without_hits_is_the_fsm():
    assert run(CacheFSMPolicy(init_gamma=3), lambda g: 0) == run(FSMPolicy(init_gamma=3), lambda g: 0)

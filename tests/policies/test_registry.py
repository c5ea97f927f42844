"""make_policy / POLICY_NAMES: every policy builds from JSON params and honours the interface."""

import json
import random

import pytest

from tide.policies.base import GammaPolicy, RequestView, StepContext, StepFeedback
from tide.policies.profile import synthetic_profile
from tide.policies.registry import ADAPTIVE_NAMES, POLICY_NAMES, make_policy

PROFILE = synthetic_profile()

PARAMS = {  # one non-default, JSON-round-tripped parameter set per policy
    "static": {"gamma": 2},
    "tide": {"gamma": 3, "optimize_gamma": True, "probe_interval": 16},
    "nightjar": {"max_gamma": 4, "seed": 3},
    "onthefly": {"h": 6, "alpha_cap": 0.95},
    "fsm": {"init_gamma": 2, "max_gamma": 6},
    "cache-fsm": {"init_gamma": 2},
    "vllm": {"num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, 64, 1]], "num_speculative_tokens": 4},
    "sglang": {"config": {"1": {"candidate_steps": [1, 3]}, "16": {"candidate_steps": [0, 1]}}},
    "dsd": {"window": 32},
    "adaptive": {"explore": 0.0, "probe_interval": 12},
}


def test_names_are_complete():
    assert set(POLICY_NAMES) == set(PARAMS)
    assert set(ADAPTIVE_NAMES) <= set(POLICY_NAMES)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_builds_from_json_and_keeps_the_contract(name):
    params = json.loads(json.dumps(PARAMS[name]))
    pol = make_policy(name, params, PROFILE)
    assert isinstance(pol, GammaPolicy)
    rng = random.Random(name)
    live: list[str] = []
    for step in range(400):
        # requests come and go like in continuous batching
        live = [r for r in live if rng.random() > 0.05] + [f"{step}-{k}" for k in range(rng.randint(0, 2))]
        live = live[:64]
        if not live:
            continue
        ctx = StepContext(len(live), tuple(RequestView(r, lag=rng.randint(0, 20)) for r in live), step, max_gamma=6)
        g = pol.decide(ctx)
        assert len(g) == len(live) and all(isinstance(x, int) and 0 <= x <= 6 for x in g)
        acc = tuple(rng.randint(0, x) for x in g)
        pol.observe(StepFeedback(len(live), tuple(g), acc, step_ms=50.0, draft_ms=2.0 * max(g), verify_ms=48.0))


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_defaults_build_with_a_profile(name):
    assert make_policy(name, None, PROFILE).name


def test_errors_are_loud():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("magic", {})
    with pytest.raises(TypeError):
        make_policy("nightjar", {"max_gama": 4}, PROFILE)  # typo in a pushed policy
    for name in ("tide", "adaptive"):
        with pytest.raises(ValueError, match="LatencyProfile"):
            make_policy(name, {}, None)
    assert make_policy("onthefly", {}, None).name == "onthefly"  # measures its own times

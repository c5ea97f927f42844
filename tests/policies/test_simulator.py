"""Replay simulator: determinism, conservation, time accounting, calling the policy like the engine."""

import pytest

from tide.policies.base import FixedGamma, StepContext, StepFeedback
from tide.policies.profile import LatencyProfile, synthetic_profile
from tide.policies.registry import make_policy
from tide.policies.simulator import simulate
from tide.policies.workload import Domain, Phase, Workload, low_high, stationary

PROFILE = synthetic_profile()


def small_trace(seed: int = 0) -> Workload:
    return low_high(phase_s=10.0, seed=seed)


def test_same_inputs_same_result():
    a = simulate(make_policy("adaptive", {}, PROFILE), small_trace(), PROFILE).to_dict()
    b = simulate(make_policy("adaptive", {}, PROFILE), small_trace(), PROFILE).to_dict()
    assert a == b
    n1 = simulate(make_policy("nightjar", {"seed": 1}, PROFILE), small_trace(), PROFILE).to_dict()
    n2 = simulate(make_policy("nightjar", {"seed": 1}, PROFILE), small_trace(), PROFILE).to_dict()
    assert n1 == n2
    other = simulate(make_policy("adaptive", {}, PROFILE), small_trace(seed=1), PROFILE).to_dict()
    assert other != a


@pytest.mark.parametrize("name", ["static", "adaptive", "fsm", "nightjar"])
def test_every_requested_token_comes_out(name):
    res = simulate(make_policy(name, {}, PROFILE), small_trace(), PROFILE)
    assert res.requests > 50
    assert res.tokens_emitted == res.tokens_requested
    assert res.overall.completed == res.requests
    assert sum(p.tokens for p in res.phases) <= res.tokens_emitted  # the rest: the drain after the trace


def test_time_accounting_for_one_request():
    prof = LatencyProfile(T_ms={1: {1: 10.0, 2: 12.0, 3: 14.0}}, D0_ms=1.0, prefill_ms_per_token=0.5)
    wl = Workload(
        phases=(Phase("p", 0.001, concurrency=1),),
        domains={"d": Domain("d", alpha=0.999, spread=1e6)},
        prompt_len=(10, 10),
        output_mean=1e9,
        output_range=(11, 11),
        depth_decay=1.0,
    )
    res = simulate(FixedGamma(0), wl, prof)
    assert res.sim_time_s * 1000 == pytest.approx(5.0 + 10 * 10.0)  # prefill + 10 decode steps
    res = simulate(FixedGamma(2), wl, prof)
    # an always-accepting draft: three steps emit 3 tokens each (14 + 2·1 ms); the last token is
    # decoded with γ capped to remaining − 1 = 0 (10 ms), as the engine does
    assert res.sim_time_s * 1000 == pytest.approx(5.0 + 3 * 16.0 + 10.0)
    assert res.overall.accept_len == 3.0


class Recorder:
    """Checks the engine contract: decide, then observe for the same requests, in order."""

    name = "recorder"

    def __init__(self) -> None:
        self.pending: StepContext | None = None
        self.steps = 0

    def decide(self, ctx: StepContext) -> list[int]:
        assert self.pending is None, "decide twice without observe"
        assert ctx.batch_size == len(ctx.requests) > 0
        assert len({r.request_id for r in ctx.requests}) == ctx.batch_size
        self.pending = ctx
        return [1 if r.lag < 5 else 2 for r in ctx.requests]

    def observe(self, fb: StepFeedback) -> None:
        ctx, self.pending = self.pending, None
        assert ctx is not None and fb.batch_size == ctx.batch_size == len(fb.gammas) == len(fb.accepted)
        assert all(0 <= a <= g for a, g in zip(fb.accepted, fb.gammas, strict=True))
        assert fb.step_ms == pytest.approx(fb.draft_ms + fb.verify_ms) and fb.verify_ms > 0
        assert len(fb.cache_hits) == fb.batch_size
        self.steps += 1


def test_policy_is_called_like_the_engine():
    rec = Recorder()
    res = simulate(rec, small_trace(), PROFILE)
    assert rec.steps == res.overall.steps > 100


def test_bad_decisions_are_refused():
    class Broken:
        name = "broken"

        def decide(self, ctx):
            return [99] * ctx.batch_size

        def observe(self, fb):
            pass

    with pytest.raises(ValueError, match="broken"):
        simulate(Broken(), stationary(phase_s=1.0), PROFILE)


def test_speculation_lags_and_catch_up_cost():
    """γ = 0 steps build lag; the next γ > 0 step pays c(lag, b) in draft time."""
    seen = []

    class Toggle:
        name = "toggle"

        def __init__(self):
            self.k = 0

        def decide(self, ctx):
            self.k += 1
            seen.append(max(r.lag for r in ctx.requests))
            return [2 if self.k % 10 == 0 else 0] * ctx.batch_size

        def observe(self, fb):
            if max(fb.gammas) > 0:
                assert fb.draft_ms > 2 * PROFILE.draft_ms(fb.batch_size)  # catch-up on top

    simulate(Toggle(), stationary(phase_s=2.0, concurrency=2), PROFILE)
    assert max(seen) >= 9

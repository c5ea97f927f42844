"""profile_latency / cached_profile / LiveProfile on the tiny target (shapes and plumbing, no timing claims)."""

from __future__ import annotations

import math

import pytest
import torch

from services.inference.control import build_policy
from tide.decisions import DecisionError, PolicySpec
from tide.engine import profiling
from tide.engine.drafters import NgramDrafter
from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.profiling import (
    LiveProfile,
    cached_profile,
    default_grid,
    profile_latency,
    random_draft,
    wants_profile,
)
from tide.policies import RequestView, StepContext, StepFeedback
from tide.policies.profile import LatencyProfile, synthetic_profile
from tide.policies.registry import make_policy

BATCHES, NS, LAGS = [1, 2, 4], [1, 2, 3, 4], [1, 4]


def _ctx(b: int) -> StepContext:
    return StepContext(batch_size=b, requests=tuple(RequestView(f"r{i}") for i in range(b)), max_gamma=3)


def _finite_positive(values) -> bool:
    return all(math.isfinite(v) and v >= 0 for v in values)


@pytest.mark.parametrize("kind", ["ngram", "eagle3", "none"])
def test_profile_is_well_formed_and_drives_policies(tiny_model, kind):
    drafter = {"ngram": NgramDrafter(), "none": None,
               "eagle3": Eagle3Drafter(random_draft(tiny_model, tiny_model.cfg.vocab_size), "rand", 4, 256)}[kind]
    prof = profile_latency(tiny_model, drafter, BATCHES, NS, LAGS, reps=1)
    assert sorted(prof.T_ms) == BATCHES and all(sorted(row) == NS for row in prof.T_ms.values())
    assert _finite_positive(v for row in prof.T_ms.values() for v in row.values())
    assert all(v > 0 for row in prof.T_ms.values() for v in row.values())
    assert sorted(prof.D_ms) == BATCHES and _finite_positive(prof.D_ms.values())
    assert prof.D0_ms == prof.D_ms[1] and prof.prefill_ms_per_token > 0
    if kind == "eagle3":
        assert sorted(prof.C_ms) == BATCHES and all(sorted(r) == LAGS for r in prof.C_ms.values())
    else:
        assert prof.C_ms == {} and (kind != "none" or set(prof.D_ms.values()) == {0.0})
    assert prof.meta["drafter"]["algorithm"] == kind and prof.meta["verify_padding"] is True
    again = LatencyProfile.from_json(prof.to_json())  # JSON round trip (what decisions and the cache carry)
    assert again.T_ms == prof.T_ms and again.D_ms == prof.D_ms and again.C_ms == prof.C_ms
    # interpolation stays inside the grid's envelope (well-formed: no negative or runaway values)
    assert min(min(r.values()) for r in prof.T_ms.values()) <= prof.target_ms(3, 2.5) <= max(
        max(r.values()) for r in prof.T_ms.values())
    for name in ("tide", "adaptive", "nightjar", "dsd", "onthefly", "vllm"):
        pol = make_policy(name, {}, again)
        assert name != "adaptive" or pol.padded  # our engine pads verify forwards; the policy knows it
        for b in (1, 3, 4):
            gammas = pol.decide(_ctx(b))
            assert len(gammas) == b and all(0 <= g <= 3 for g in gammas)
            pol.observe(StepFeedback(batch_size=b, gammas=tuple(gammas), accepted=tuple(min(g, 1) for g in gammas),
                                     step_ms=1.0, draft_ms=0.1, verify_ms=0.9))


def test_cache_hit_on_second_call_and_keyed_by_drafter(tiny_model, tmp_path):
    kw = dict(model_id="tiny", batches=[1, 2], ns=[1, 2], lags=[1], reps=1, directory=tmp_path)
    first, path, hit = cached_profile(tiny_model, NgramDrafter(), **kw)
    assert not hit and path.exists() and path.parent == tmp_path
    second, path2, hit2 = cached_profile(tiny_model, NgramDrafter(), **kw)
    assert hit2 and path2 == path and second.T_ms == first.T_ms and second.D_ms == first.D_ms
    other, path3, hit3 = cached_profile(tiny_model, NgramDrafter(max_n=5), **kw)  # another drafter shape
    assert not hit3 and path3 != path
    threads = torch.get_num_threads()
    try:  # the thread count is part of the key
        torch.set_num_threads(1 if threads > 1 else 2)
        assert cached_profile(tiny_model, NgramDrafter(), **kw)[1] != path
    finally:
        torch.set_num_threads(threads)
    _, path4, hit4 = cached_profile(tiny_model, NgramDrafter(), refresh=True, **kw)
    assert not hit4 and path4 == path
    path.write_text("{not json")  # a corrupt cache file is re-measured, not fatal
    assert not cached_profile(tiny_model, NgramDrafter(), **kw)[2]


def test_live_profile_refresh_in_place_and_reprofile_decision():
    calls = []

    def remeasure() -> LatencyProfile:
        calls.append(1)
        return synthetic_profile(d0_ms=9.0)

    live = LiveProfile.wrap(synthetic_profile(), remeasure)
    assert live.draft_ms(1) == pytest.approx(1.7)
    pol = build_policy(PolicySpec("adaptive", {"reprofile": 1.0}), live)
    assert calls == [1] and live.draft_ms(1) == pytest.approx(9.0) and pol.profile is live
    build_policy(PolicySpec("adaptive", {}), live)
    assert calls == [1]
    with pytest.raises(DecisionError, match="reprofile"):
        build_policy(PolicySpec("tide", {"reprofile": 1.0}), synthetic_profile())


def test_wants_profile_and_grid():
    assert wants_profile("adaptive", "auto") and wants_profile("tide", "") and not wants_profile("static", "auto")
    assert wants_profile("static", "1") and not wants_profile("adaptive", "0")
    with pytest.raises(ValueError):
        wants_profile("tide", "sometimes")
    batches, ns, lags = default_grid(16, 6)
    assert batches == [1, 2, 4, 8, 16] and ns[0] == 1 and ns[-1] == 7 and lags
    assert default_grid(12, 3)[0] == [1, 2, 4, 8, 12] and default_grid(12, 3)[1] == [1, 2, 3, 4]


def test_a_burst_of_interference_does_not_reach_the_profile(monkeypatch):
    """A slow burst (a neighbour taking the memory bus) during one point's runs must not make that
    point look slower than a bigger one: runs go in rounds over all points and the fastest counts.
    The clock is simulated (a fake timer): a real machine cannot produce a burst on demand."""
    now, calls = [0.0], []

    def work(name: str, ms: float):
        def fn() -> None:
            calls.append(name)
            burst = 0.5 if len(calls) in (7, 8, 9) else 0.0  # three runs in a row, 500 ms slower
            now[0] += ms / 1e3 + burst
        return fn

    monkeypatch.setattr(profiling, "_TIMER", [lambda: now[0]])
    small, big = work("small", 40.0), work("big", 70.0)
    assert profiling.interleaved_min_ms([small, big], reps=3, warmup=2) == pytest.approx([40.0, 70.0])
    assert calls == ["small"] * 2 + ["big"] * 2 + ["small", "big"] * 3  # warm-ups, then rounds


def test_profile_measures_tree_verification(tiny_model):
    """T_tree(b, N) for the tree sizes asked for: a forward of N + 1 rows per sequence."""
    prof = profile_latency(tiny_model, None, [1, 2], [1, 2], [1], reps=1, tree_sizes=[4, 12])
    assert sorted(prof.tree_ms) == [1, 2] and all(sorted(r) == [4, 12] for r in prof.tree_ms.values())
    assert _finite_positive(v for r in prof.tree_ms.values() for v in r.values())
    assert LatencyProfile.from_json(prof.to_json()).tree_ms == prof.tree_ms
    assert prof.tree_target_ms(1, 4) == prof.tree_ms[1][4]


def test_large_models_profile_a_thinner_grid_at_start():
    """Past LARGE_MODEL_BYTES of weights a start profile takes 3 batches, n = 1, 2, 3 and γmax + 1,
    in fewer rounds; smaller models keep the default grid and its 5 rounds."""
    from tide.engine.profiling import LARGE_MODEL_BYTES, LARGE_MODEL_REPS, start_grid

    assert start_grid(16, 6, LARGE_MODEL_BYTES) == (*default_grid(16, 6), 5)
    batches, ns, lags, reps = start_grid(16, 6, LARGE_MODEL_BYTES + 1)
    assert batches == [1, 4, 16] and ns == [1, 2, 3, 7] and lags == default_grid(16, 6)[2]
    assert reps == LARGE_MODEL_REPS < 5


def test_a_large_models_start_profile_skips_the_rows_it_extrapolates(tiny_model, tmp_path):
    """A large model's start cost: T(b, n) past max_rows rows is not run (n = 1, 2 always are) and
    the profile extrapolates it from the batch's last slope, never below the measured points; the
    cache keys of default-cost profiles are unchanged, a light profile has a key of its own."""
    from tide.engine.profiling import LARGE_MODEL_BYTES, LARGE_MODEL_COST, ProfileCost, cache_key, start_cost

    assert start_cost(LARGE_MODEL_BYTES) == ProfileCost() and start_cost(LARGE_MODEL_BYTES + 1) == LARGE_MODEL_COST
    cost = ProfileCost(warmup=1, max_rows=4, prefill_tokens=16)
    prof = profile_latency(tiny_model, None, [1, 4], [1, 2, 3, 5], reps=1, cost=cost)
    assert sorted(prof.T_ms[1]) == [1, 2, 3] and sorted(prof.T_ms[4]) == [1, 2]
    assert prof.target_ms(4, 5) >= prof.target_ms(4, 2) > 0 and prof.prefill_ms_per_token > 0
    default_key = cache_key("m", tiny_model, None, [1], [1], [1])
    assert "cost" not in default_key and default_key == cache_key("m", tiny_model, None, [1], [1], [1], ProfileCost())
    assert cache_key("m", tiny_model, None, [1], [1], [1], cost)["cost"]["max_rows"] == 4
    light, _, hit = cached_profile(tiny_model, None, model_id="m", batches=[1, 4], ns=[1, 2, 3, 5], reps=1,
                                   directory=tmp_path, cost=cost)
    assert not hit and sorted(light.T_ms[4]) == [1, 2]
    assert cached_profile(tiny_model, None, model_id="m", batches=[1, 4], ns=[1, 2, 3, 5], reps=1,
                          directory=tmp_path, cost=cost)[2]


def test_a_speculation_memory_profiles_the_deep_verifies_its_recalls_make():
    """Recalls draft up to max_recall_gamma: their verify rows are measured, not extrapolated."""
    from tide.engine.profiling import LARGE_MODEL_BYTES, start_grid

    assert start_grid(16, 8, 1, 0) == start_grid(16, 8, 1)
    assert start_grid(16, 8, 1, 32)[1] == default_grid(16, 8)[1] + [17, 33]
    assert start_grid(16, 8, LARGE_MODEL_BYTES + 1, 32)[1] == [1, 2, 3, 9, 17, 33]
    assert start_grid(16, 8, 1, 12)[1][-1] == 13  # a shallow recall cap: its top only

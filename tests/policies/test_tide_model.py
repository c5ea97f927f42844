"""TIDE latency model (seed 000 Eq. 2–5) against hand computations from its Table 5."""

import numpy as np
import pytest

from tide.policies.base import RequestView, StepContext, StepFeedback
from tide.policies.profile import LatencyProfile
from tide.policies.tide_model import TideLatencyPolicy, min_alpha, practical_speedup, threshold_table

# Seed 000 Table 5, gpt-oss-120b on H100: T(n) for n total tokens in the forward, and D0 (ms).
GPT_OSS_T = {
    1: 3.416,
    2: 3.844,
    4: 4.341,
    8: 5.236,
    16: 6.123,
    32: 7.637,
    64: 9.345,
    128: 11.79,
    256: 15.50,
    512: 21.50,
}
GPT_OSS_D0 = 0.393
QWEN_T = {1: 9.057, 2: 10.07, 4: 11.86, 8: 14.68, 16: 17.84, 32: 23.47, 64: 26.68, 128: 31.46}
QWEN_D0 = 0.137


def table5(t: dict[int, float], d0: float) -> LatencyProfile:
    return LatencyProfile(T_total_ms=t, D0_ms=d0)


def hand_min_alpha(t: dict[int, float], d0: float, b: int, gamma: int = 3) -> float:
    """Speedup = 1 ⇔ 1 + α + … + α^γ = c·γ + β with c = D0/T(b), β = T(b(γ+1))/T(b) (Eq. 5)."""
    k = gamma * d0 / t[b] + t[b * (gamma + 1)] / t[b]
    roots = np.roots([1.0] * gamma + [1.0 - k])  # α^γ + … + α + (1 − k) = 0
    real = [r.real for r in roots if abs(r.imag) < 1e-9 and 0 < r.real < 1]
    assert len(real) == 1
    return real[0]


def test_hand_value_at_batch_1():
    # c = 0.393/3.416 = 0.11505, β = 4.341/3.416 = 1.27079 → 1 + α + α² + α³ = 1.61593 → α ≈ 0.3964
    assert min_alpha(table5(GPT_OSS_T, GPT_OSS_D0), 3, 1) == pytest.approx(0.39645, abs=1e-4)


@pytest.mark.parametrize("b", [1, 2, 4, 8, 16, 32, 64, 128])
def test_thresholds_match_hand_computation(b):
    prof = table5(GPT_OSS_T, GPT_OSS_D0)
    assert min_alpha(prof, 3, b) == pytest.approx(hand_min_alpha(GPT_OSS_T, GPT_OSS_D0, b), abs=1e-5)


@pytest.mark.parametrize("b", [1, 4, 16, 32])
def test_thresholds_qwen(b):
    assert min_alpha(table5(QWEN_T, QWEN_D0), 3, b) == pytest.approx(hand_min_alpha(QWEN_T, QWEN_D0, b), abs=1e-5)


def test_threshold_rises_with_batch_and_speedup_is_eq5():
    prof = table5(GPT_OSS_T, GPT_OSS_D0)
    table = threshold_table(prof, 3, [1, 4, 16, 64, 128])
    vals = [table[b] for b in (1, 4, 16, 64, 128)]
    assert vals == sorted(vals) and vals[0] < 0.40 < 0.51 < vals[-1]
    # Eq. 5 by hand at α = 0.6, b = 16: E = (1 − 0.6⁴)/0.4 = 2.176; c = 0.393/6.123; β = 9.345/6.123
    expected = 2.176 / (3 * 0.393 / 6.123 + 9.345 / 6.123)
    assert practical_speedup(prof, 0.6, 3, 16) == pytest.approx(expected, rel=1e-9)
    assert practical_speedup(prof, 0.6, 0, 16) == 1.0


def test_never_pays_returns_none():
    # β(b) = 5 at γ = 3: even α → 1 (E = 4 tokens) cannot pay for the verify
    prof = LatencyProfile(T_total_ms={8: 10.0, 32: 50.0}, D0_ms=0.1)
    assert min_alpha(prof, 3, 8) is None


def drive(policy: TideLatencyPolicy, b: int, accept_rate: float, steps: int) -> list[int]:
    """Feed `steps` steps where each speculating request accepts ⌊rate·γ⌋ drafts; return γ played."""
    played = []
    reqs = tuple(RequestView(f"r{i}") for i in range(b))
    for s in range(steps):
        g = policy.decide(StepContext(b, reqs, step=s))
        acc = tuple(int(accept_rate * x) if x else 0 for x in g)
        policy.observe(StepFeedback(b, tuple(g), acc, step_ms=10.0))
        played.append(max(g))
    return played


def test_policy_switches_at_the_hand_threshold():
    prof = table5(GPT_OSS_T, GPT_OSS_D0)
    # Eq. 2 counts of γ = 3 steps accepting 1 each: α̂ → 1/(1+1) = 0.5 (prior weight fades)
    pol = TideLatencyPolicy(prof, probe_interval=0)
    played = drive(pol, 16, 0.34, 60)  # 0.5 > 0.440 (b = 16): stays on
    assert pol.alpha.value == pytest.approx(0.5, abs=0.01)
    assert all(g == 3 for g in played)
    pol = TideLatencyPolicy(prof, probe_interval=0)
    played = drive(pol, 128, 0.34, 60)  # 0.5 < 0.517 (b = 128): switches off
    assert played[-1] == 0
    assert pol.threshold(128) == pytest.approx(0.51739, abs=1e-4)


def test_optimize_gamma_picks_eq5_argmax():
    prof = table5(GPT_OSS_T, GPT_OSS_D0)
    pol = TideLatencyPolicy(prof, optimize_gamma=True)
    best = max(range(1, 9), key=lambda g: practical_speedup(prof, 0.8, g, 2))
    assert pol._choose(0.8, 2, 8) == best
    assert pol._choose(0.1, 2, 8) == 0


def test_probe_refreshes_alpha_after_switch_off():
    prof = table5(GPT_OSS_T, GPT_OSS_D0)
    pol = TideLatencyPolicy(prof, probe_interval=8)
    played = drive(pol, 16, 0.0, 40)  # nothing accepted: switches off, then probes every 8 steps
    assert played[0] == 3 and 0 in played
    off = played[played.index(0) :]
    assert 1 in off  # probes at γ = 1
    played = drive(pol, 16, 1.0, 60)  # the draft is perfect again
    assert played[-1] == 3

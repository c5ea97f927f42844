"""SGLang's EMA-over-tiers adaptive num_steps, per batch-size slot."""

import pytest

from tide.policies.base import RequestView, StepContext, StepFeedback
from tide.policies.sglang_ema import SGLangEMAPolicy, _Slot


def feed(slot: _Slot, accepted: float, batches: int) -> list[int]:
    steps = []
    for _ in range(batches):
        slot.update([int(accepted)] * 4)
        steps.append(slot.steps)
    return steps


def test_ema_and_update_schedule():
    slot = _Slot(3, {"candidate_steps": [1, 3, 5, 7]})
    assert slot.steps == 3 and slot.ema == 2.0  # EMA seeded at tier − 1
    slot.update([0, 0, 0, 0])
    assert slot.ema == pytest.approx(0.8 * 2.0)  # ema_alpha = 0.2
    steps = feed(slot, 0, 14)  # warm-up: 10 batches, then a decision every 5
    assert steps[:9] == [3] * 9 and steps[14 - 1] == 1  # decided at batch 15 (10 + 5)


def test_rise_and_drop_thresholds():
    slot = _Slot(3, {"candidate_steps": [1, 3, 5, 7], "down_hysteresis": -0.25})
    slot.ema = 4.0  # > 3 − 0.5: up to 5; not > 5 − 0.5: stops there (target ≈ round(ema) + 1)
    assert slot._target() == 5
    slot.ema = 4.6  # also > 5 − 0.5: up to 7
    assert slot._target() == 7
    slot.steps, slot.ema = 5, 2.2  # ≤ 3 − 0.5 − 0.25 = 2.25: drops to 3; > 1 − 0.5 − 0.25: not to 1
    assert slot._target() == 3
    slot.steps, slot.ema = 5, 2.3  # in the dead zone: stays
    assert slot._target() == 5


def test_zero_tier_probes_up_and_zero_is_reachable():
    slot = _Slot(1, {"candidate_steps": [0, 1, 3], "down_hysteresis": 0.0})
    slot.ema = 0.4  # ≤ 0.5 (zero-tier threshold, no hysteresis): drop to 0
    assert slot._target() == 0
    slot.steps = 0
    assert slot._target() == 1  # from 0 it always tries the next tier (no deadlock)


def test_batch_sizes_route_to_lower_bound_slot():
    pol = SGLangEMAPolicy()
    assert [pol.slot_key(b) for b in (1, 7, 8, 31, 32, 63, 64, 500)] == [1, 1, 8, 8, 32, 32, 64, 64]
    reqs = tuple(RequestView(f"r{i}") for i in range(64))
    assert pol.decide(StepContext(64, reqs)) == [0] * 64  # default "64": [0]
    pol.observe(StepFeedback(64, (0,) * 64, (0,) * 64, step_ms=1.0))
    assert pol.decide(StepContext(2, reqs[:2])) == [3, 3]  # "1": initial_steps = 3 is a tier


def test_custom_config_and_shared_keys():
    pol = SGLangEMAPolicy({"ema_alpha": 0.5, "1": {"candidate_steps": [2, 4]}}, initial_steps=4)
    assert pol.slots[1].ema_alpha == 0.5 and pol.slots[1].steps == 4
    with pytest.raises(ValueError):
        SGLangEMAPolicy({"ema_alpha": 0.5})

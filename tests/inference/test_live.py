"""services/inference/live.py: tokens/s over the window, acceptance per draft version, γ per batch bucket."""

from __future__ import annotations

from services.inference.live import LiveStats, batch_bucket
from services.inference.server import live_pb
from tide.telemetry import StepRecord


def record(batch: int, gammas: list[int], accepted: list[int], version: str = "v1") -> StepRecord:
    return StepRecord(worker_id="w", step=0, time_unix_s=1e9, batch_size=batch, request_ids=["r"] * batch,
                      gammas=gammas, accepted=accepted, draft_ms=0, verify_ms=0, other_ms=0, drafter="eagle3",
                      draft_version=version)


def test_buckets_are_the_gamma_policies_buckets():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 7, 8, 16, 17)] == [(1, 1), (2, 3), (2, 3), (4, 7), (4, 7), (8, 15),
                                                                    (16, 31), (16, 31)]


def test_totals_and_the_windowed_rate():
    now = [100.0]
    live = LiveStats(window_s=10, clock=lambda: now[0])
    for _ in range(20):  # 2 steps/s of 3 rows: two speculate (γ 3, accepting 1 and 3), one decodes plainly
        now[0] += 0.5
        live.observe(record(3, [3, 3, 0], [1, 3, 0]))
    live.observe(record(1, [0], [0], version="v2"))  # no row speculated: v2 is not credited
    s = live.snapshot()
    assert s.tokens_total == 20 * 7 + 1 and s.steps_total == 21 and s.tokens_per_s == (20 * 7 + 1) / 10
    assert list(s.drafts) == ["v1"] and s.drafts["v1"].verify_rows == 40
    assert (s.drafts["v1"].draft_tokens, s.drafts["v1"].accepted_tokens) == (120, 80)
    assert s.gamma[(2, 3)].steps == 20 and s.gamma[(2, 3)].gamma_sum == 120 and s.gamma[(2, 3)].last_gamma == 3
    assert s.gamma[(1, 1)].speculative_steps == 0 and s.gamma[(1, 1)].last_gamma == 0
    now[0] += 30  # nothing for longer than the window: no rate, the totals stay
    assert live.snapshot().tokens_per_s == 0 and live.snapshot().tokens_total == 141
    pb = live_pb(live.snapshot())
    assert pb.drafts[0].draft_version == "v1" and [(g.min_batch, g.max_batch) for g in pb.gamma] == [(1, 1), (2, 3)]

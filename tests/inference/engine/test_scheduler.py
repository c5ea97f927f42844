"""Continuous batching bookkeeping: slots, budgets, chunk boundaries, cancellation (no model)."""

from __future__ import annotations

import pytest

from tide.engine.scheduler import Scheduler
from tide.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus


def _seq(rid: str, n: int, t: float = 0.0) -> Sequence:
    return Sequence(rid, list(range(n)), n, SamplingParams(), arrival_s=t)


def test_admits_up_to_max_batch_and_queues_the_rest():
    s = Scheduler(max_batch=2, max_tokens_per_step=1000, max_seq_len=100)
    for i in range(3):
        s.add(_seq(f"r{i}", 5, t=i))
    plan = s.schedule()
    assert [q.request_id for q, _ in plan.prefill] == ["r0", "r1"]
    assert [q.slot for q, _ in plan.prefill] == [0, 1]
    assert s.get("r2").status is SequenceStatus.WAITING


def test_cancel_frees_the_slot_for_the_next_request():
    s = Scheduler(max_batch=1, max_tokens_per_step=1000, max_seq_len=100)
    a, b = _seq("a", 5), _seq("b", 5, t=1)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(a, FinishReason.CANCELLED)
    assert a.slot == -1 and a.status.is_finished()
    plan = s.schedule()
    assert [q.request_id for q, _ in plan.prefill] == ["b"] and b.slot == 0


def test_prefill_chunks_fall_on_fixed_boundaries_whatever_the_budget():
    s = Scheduler(max_batch=4, max_tokens_per_step=300, max_seq_len=2000, prefill_chunk=256)
    long = _seq("long", 600)
    s.add(long)
    sizes = []
    while long.remaining_prefill:
        plan = s.schedule()
        (seq, n), = plan.prefill
        sizes.append(n)
        seq.num_cached += n
    assert sizes == [256, 256, 88]


def test_decode_rows_count_against_the_budget_but_prefill_is_not_starved():
    s = Scheduler(max_batch=8, max_tokens_per_step=64, max_seq_len=1000, prefill_chunk=32)
    running = []
    for i in range(6):
        q = _seq(f"run{i}", 3)
        s.add(q)
        running.append(q)
    for q, n in s.schedule().prefill:
        q.num_cached += n
        q.status = SequenceStatus.RUNNING
        q.token_ids.append(1)
    s.add(_seq("new", 100, t=9))
    plan = s.schedule()
    assert len(plan.decode) == 6
    assert plan.prefill and plan.prefill[0][0].request_id == "new" and plan.prefill[0][1] == 32


def test_rejects_prompts_that_do_not_fit_and_duplicate_ids():
    s = Scheduler(max_batch=2, max_tokens_per_step=100, max_seq_len=10)
    with pytest.raises(ValueError, match="does not fit"):
        s.add(_seq("big", 10))
    s.add(_seq("x", 3))
    with pytest.raises(ValueError, match="duplicate"):
        s.add(_seq("x", 3))

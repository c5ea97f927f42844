"""The shared control-plane and speculation types (tide.decisions, tide.speculation) and their tide.v1 forms."""

from __future__ import annotations

import pytest

from tide.decisions import (
    Decision,
    DecisionError,
    PolicySpec,
    SpeculationBucket,
    SpeculationSchedule,
    decision_from_pb,
    decision_pb,
)
from tide.proto.tide.v1 import inference_pb2
from tide.speculation import SpeculationStats, stats_from_pb, stats_pb


def test_decision_round_trip_keeps_unset_parts_unset():
    full = Decision("d1", "m", SpeculationSchedule((SpeculationBucket(1, 4, True), SpeculationBucket(5, 0, False))),
                    PolicySpec("static", {"gamma": 2.0}, '{"x": 1}'), False, "none", "why", 12.5)
    assert decision_from_pb(decision_pb(full)) == full
    bare = Decision("d2")
    pb = decision_pb(bare)
    assert not any(pb.HasField(f) for f in ("speculation", "gamma_policy", "collection_enabled", "drafter"))
    assert decision_from_pb(pb) == bare
    off = Decision("d3", speculation=SpeculationSchedule(()))  # no buckets: speculation off everywhere, still set
    pb = decision_pb(off)
    assert pb.HasField("speculation") and decision_from_pb(pb) == off
    assert not off.speculation.enabled(1)


def test_invalid_schedule_from_the_wire_is_a_decision_error():
    pb = inference_pb2.Decision(decision_id="bad", speculation=inference_pb2.SpeculationSchedule(buckets=[
        inference_pb2.SpeculationBucket(min_batch=1, max_batch=0, enabled=True),
        inference_pb2.SpeculationBucket(min_batch=3, max_batch=4, enabled=True)]))
    with pytest.raises(DecisionError, match="overlap"):
        decision_from_pb(pb)
    assert issubclass(DecisionError, ValueError)


def test_speculation_stats_round_trip():
    s = SpeculationStats(2.5, 6, 3, 2, 1, "v7", "eagle3")
    assert stats_from_pb(stats_pb(s)) == s
    assert SpeculationStats().drafter == "none" and stats_from_pb(inference_pb2.SpeculationStats()).drafter == ""

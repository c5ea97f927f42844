"""A draft version's live acceptance is its own tokens': a hybrid worker's copies of the context
(StepRecord.sources "ngram") are not counted for the EAGLE-3 draft beside them."""

from __future__ import annotations

import json

from services.controller.stats import FleetStats
from tide.streams import decode, encode
from tide.telemetry import StepRecord


def _record(step: int, sources: list[str], drafter: str = "eagle3") -> StepRecord:
    # Two requests, γ = 3: the first always copies and is accepted in full, the second drafts and is rejected.
    return StepRecord(worker_id="w", step=step, time_unix_s=float(step), batch_size=2, request_ids=["a", "b"],
                      gammas=[3, 3], accepted=[3, 0], draft_ms=1.0, verify_ms=10.0, other_ms=0.0,
                      drafter=drafter, draft_version="v1", target_model="m", sources=sources)


def test_copies_do_not_count_toward_the_drafts_acceptance():
    hybrid, mixed = FleetStats(), FleetStats()
    for step in range(50):
        hybrid.observe(_record(step, ["ngram", "eagle3"]))
        mixed.observe(_record(step, []))  # a record that does not say: every request counted
    (own,), (both,) = hybrid.drafts("m"), mixed.drafts("m")
    assert own.rate_long.value < 0.05  # the draft's chains: rejected at their first token
    assert both.rate_long.value > 0.5
    assert _record(0, ["ngram", "eagle3"]).drafted_by_draft() == [(3, 0)]
    # A weightless drafter on its own: its copies are its acceptance.
    assert _record(0, [], drafter="ngram").drafted_by_draft() == [(3, 3), (3, 0)]


def test_sources_travel_on_the_stream_and_old_records_still_decode():
    rec = _record(7, ["ngram", "eagle3"])
    assert decode(encode(rec), StepRecord) == rec
    fields = encode(rec)
    data = json.loads(fields["data"])
    del data["sources"]  # a record from a worker that predates the field
    fields["data"] = json.dumps(data)
    old = decode(fields, StepRecord)
    assert old.sources == [] and old.drafted_by_draft() == [(3, 3), (3, 0)]

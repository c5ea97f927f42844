"""The automatic cycle against a real registry, real S3/Redis and the tiny copy target: fine-tune
from the version the workers run, compare on the served accept length, register with metrics and
provenance, promote by the margin (or not), report, and start by itself once enough is buffered."""

from __future__ import annotations

import json
import time

import pytest
from trainer.service.svc import ADMIN_TOKEN, metric, publish, renamed, status, trigger, wait_for

from services.controller.app import build as build_controller
from services.controller.settings import ControllerSettings
from tide.proto.tide.v1 import trainer_pb2
from tide.registry_client import target_key

TARGET = "tiny-llama"  # copy_dir's name: the model id of the target and of its chunks
# a few steps at a high learning rate learn the copy target well (served accept length ~3 at γ=3)
FAST = dict(steps=10, batch_rows=4, max_len=64, lr=3e-3, warmup_steps=2, eval_fraction=0.25, min_tokens=1000)


@pytest.fixture
def copy_trainer(make_trainer, copy_dir, draft_registry):
    return lambda **kw: make_trainer(**{"target": str(copy_dir), "registry_addr": draft_registry.address, **FAST,
                                        **kw})


@pytest.fixture
def feed(redis_client, s3_client, s3_bucket, unique_prefix, copy_chunks):
    """feed(svc, tag, n): publish n of the copy chunks under fresh ids, wait until svc buffered them."""

    def go(svc, tag: str, n: int = len(copy_chunks), wait: bool = True) -> int:
        before = svc.manifest.buffered_totals(TARGET)
        for i, blob in enumerate(copy_chunks[:n]):
            cid = f"{tag}-{i}"
            publish(redis_client, s3_client, s3_bucket, unique_prefix, TARGET, cid, renamed(blob, cid))
        tokens = before[1] + 256 * n
        if wait:
            wait_for(lambda: svc.manifest.buffered_totals(TARGET) == (before[0] + n, tokens), 120, f"{tag} buffered")
        return tokens

    return go


def run(svc, **kw) -> trainer_pb2.TrainingOutcome:
    r = trigger(svc, **kw)
    assert r.accepted, r.detail
    svc.runner.wait(240)
    st = status(svc)
    assert st.state == trainer_pb2.TrainerStatus.STATE_IDLE and st.last_outcome.run_id == r.run_id
    return st.last_outcome


def provenance(reg, version: str) -> dict:
    return json.loads(reg.client(token=ADMIN_TOKEN).get(version).provenance_json)


@pytest.mark.timeout(600)
def test_first_run_promotes_and_the_next_fine_tunes_from_it(copy_trainer, feed, draft_registry, trainer_storage):
    controller = build_controller(ControllerSettings(listen="127.0.0.1:0", metrics_port=0, admin_token=ADMIN_TOKEN,
                                                     storage=trainer_storage))
    try:
        svc = copy_trainer(controller_addr=controller.target)
        reg = draft_registry.client(token=ADMIN_TOKEN)
        feed(svc, "a")
        first = run(svc, reason="first")

        # (a) from scratch: registered, beats no draft (1.0) by the margin, promoted
        assert first.base_version == "" and first.candidate_version.startswith(f"{TARGET}/v"), first
        assert first.promoted and first.detail.startswith(f"promoted {first.candidate_version}"), first.detail
        assert first.eval_accept_length_base == 1.0 and first.eval_accept_length_candidate > 1.02
        assert first.train_tokens > 0 and first.eval_tokens > 0 and first.duration_s > 0
        pointer = reg.pointer(TARGET)
        assert pointer.current == pointer.effective == first.candidate_version
        reason = pointer.history[0].reason
        assert first.run_id in reason and f"{first.eval_accept_length_candidate:.3f}" in reason, reason
        assert pointer.history[0].actor == "trainer"
        v1 = reg.get(first.candidate_version)
        assert v1.parent_version == "" and v1.eval_metrics["accept_length"] == pytest.approx(
            first.eval_accept_length_candidate)
        assert v1.eval_metrics["accept_length_base"] == 1.0 and v1.eval_metrics["train_steps"] == 10
        assert v1.eval_metrics["train_tokens"] == first.train_tokens
        prov = provenance(draft_registry, v1.version)
        assert prov["run_id"] == first.run_id and prov["reason"] == "first" and prov["chunk_count"] == 5
        assert sorted(prov["chunk_ids"]) == [f"a-{i}" for i in range(5)] and prov["config"]["lr"] == 3e-3
        wait_for(lambda: (o := controller.controller.outcomes.last(TARGET)) and o.run_id == first.run_id,
                 60, "the outcome at the controller")
        seen = controller.controller.outcomes.last(TARGET)
        assert (seen.candidate_version, seen.promoted) == (first.candidate_version, True)
        assert seen.eval_accept_length_candidate == pytest.approx(first.eval_accept_length_candidate)
        assert metric(svc, "tide_trainer_runs_total", result="promoted") == 1
        assert metric(svc, "tide_trainer_eval_accept_length", draft="candidate") == pytest.approx(
            first.eval_accept_length_candidate)
        assert status(svc).loss > 0

        # (b) the next run starts from the promoted version: downloaded (verified), evaluated as the base
        feed(svc, "b")
        second = run(svc, reason="second")
        assert second.base_version == first.candidate_version, second
        assert (svc.registry.cache_dir / target_key(first.candidate_version) / "model.safetensors").exists()
        # the base is the trained draft, not a fresh one (which would be near 1.0 on this data)
        assert second.eval_accept_length_base > 1.02
        assert second.candidate_version and second.candidate_version != first.candidate_version
        v2 = reg.get(second.candidate_version)
        assert v2.parent_version == first.candidate_version
        assert provenance(draft_registry, v2.version)["base_version"] == first.candidate_version
        assert sorted(provenance(draft_registry, v2.version)["chunk_ids"]) == [f"b-{i}" for i in range(5)]
        # rehearsal: the first run's chunks (as many tokens as the new ones: all five) are trained on
        # again and recorded as replayed, while the run's own chunk list (the buffer accounting) has
        # only the new ones
        record = svc.manifest.runs[TARGET][second.run_id]
        assert sorted(record["chunk_ids"]) == [f"b-{i}" for i in range(5)]
        assert sorted(record["replayed_chunk_ids"]) == [f"a-{i}" for i in range(5)]
        assert provenance(draft_registry, v2.version)["replayed_chunk_count"] == 5
        gain = second.eval_accept_length_candidate - second.eval_accept_length_base
        assert second.promoted == (gain >= 0.02), second
        assert reg.pointer(TARGET).current == (second.candidate_version if second.promoted else first.candidate_version)
    finally:
        controller.stop(grace_s=0.2)


@pytest.mark.timeout(600)
def test_register_only_and_a_margin_not_met_leave_the_pointer(copy_trainer, feed, draft_registry):
    reg = draft_registry.client(token=ADMIN_TOKEN)
    # (d) auto-promotion off: a candidate that clearly beats no draft is registered, not promoted
    manual = copy_trainer(auto_promote=False)
    feed(manual, "a")
    out = run(manual)
    assert out.candidate_version and not out.promoted and out.eval_accept_length_candidate > 1.02, out
    assert "TIDE_TRAINER_AUTO_PROMOTE=0" in out.detail
    assert reg.pointer(TARGET).current == "" and [d.version for d in reg.list(TARGET).drafts] == [out.candidate_version]
    assert metric(manual, "tide_trainer_runs_total", result="registered") == 1
    assert metric(manual, "tide_trainer_runs_total", result="promoted") == 0
    manual.stop(grace_s=0.2)

    # promoted by hand (as with tidectl); then (c) a candidate not better by the margin stays registered only
    reg.promote(out.candidate_version, TARGET, reason="by hand")
    strict = copy_trainer(consumer="t-strict", promote_margin=100.0)
    feed(strict, "b")
    out2 = run(strict)
    assert out2.base_version == out.candidate_version and out2.candidate_version and not out2.promoted, out2
    assert "not promoted" in out2.detail and "margin 100.000" in out2.detail, out2.detail
    assert reg.get(out2.candidate_version).parent_version == out.candidate_version
    pointer = reg.pointer(TARGET)
    assert pointer.current == out.candidate_version and pointer.history[0].reason == "by hand"


@pytest.mark.timeout(600)
def test_auto_trigger_starts_a_run_once_enough_is_buffered(copy_trainer, feed, draft_registry):
    svc = copy_trainer(auto_train=True, auto_check_s=60.0)  # only the intake wakes it within the test
    feed(svc, "a", n=3)  # 768 tokens < 1000
    time.sleep(1.0)
    assert not svc.runner.busy and svc.runner.last_outcome is None
    assert status(svc).buffered_tokens == 768
    feed(svc, "b", n=1, wait=False)  # 1024 tokens: a run starts without TriggerTraining
    wait_for(lambda: svc.runner.last_outcome is not None, 240, "an automatic run")
    out = status(svc).last_outcome
    assert out.candidate_version and out.promoted, out
    record = svc.manifest.runs[TARGET][out.run_id]
    assert record["reason"] == "auto: 1024 tokens buffered (>= 1000)" and len(record["chunk_ids"]) == 4
    assert draft_registry.client(token=ADMIN_TOKEN).pointer(TARGET).current == out.candidate_version
    assert status(svc).buffered_tokens == 0


@pytest.mark.timeout(600)
def test_unreachable_registry_fails_the_run_and_keeps_the_chunks(make_trainer, copy_dir, feed):
    svc = make_trainer(target=str(copy_dir), registry_addr="127.0.0.1:1")
    tokens = feed(svc, "a", n=2)
    out = run(svc, force=True)
    assert out.detail.startswith("failed: registry at 127.0.0.1:1") and "UNAVAILABLE" in out.detail, out.detail
    assert not out.candidate_version and not out.promoted
    assert svc.manifest.buffered_totals(TARGET) == (2, tokens) and TARGET not in svc.manifest.runs
    assert metric(svc, "tide_trainer_runs_total", result="failed") == 1
    assert trigger(svc, force=True).accepted  # the chunks are still there to train on


def test_a_run_over_many_chunks_keeps_its_provenance_within_the_registrys_limit():
    """A run over hundreds of chunks (the trainer at idle priority buffers many between runs) once
    failed to register: its provenance listed up to 1000 chunk ids, past the registry's 4096
    characters. The ids now go in while they fit; the run record in S3 keeps them all."""
    from services.trainer.cycle import MAX_PROVENANCE_CHARS, _with_ids

    ids = [f"run-20261126-095436-9785c7-chunk-{i:05d}" for i in range(438)]
    doc = _with_ids({"run_id": "r", "chunk_count": len(ids)}, {"chunk_ids": ids, "eval_chunk_ids": ids[:3]})
    text = json.dumps(doc)
    assert len(text) <= MAX_PROVENANCE_CHARS < 4096
    assert doc["chunk_ids"] == ids[:len(doc["chunk_ids"])] and doc["chunk_ids"] and doc["chunk_ids_truncated"]
    few = _with_ids({"run_id": "r"}, {"chunk_ids": ids[:5], "eval_chunk_ids": []})
    assert few["chunk_ids"] == ids[:5] and not few["chunk_ids_truncated"] and not few["eval_chunk_ids_truncated"]

"""The training-set manifest's replay: the newest chunks first, then a sample of the whole history;
the same picks after a restart re-reads the manifest from S3."""

from __future__ import annotations

import dataclasses

from services.trainer.manifest import Manifest, ManifestEntry

TARGET = "tiny"


def entry(cid: str, tokens: int = 100) -> ManifestEntry:
    return ManifestEntry(chunk_id=cid, bucket="b", key=f"k/{cid}", sha256="0" * 64, size_bytes=1000, num_tokens=tokens,
                         target_model=TARGET, draft_version="", workload="", worker_id="", created_unix_s=0.0,
                         added_unix_s=0.0)


def test_replay_takes_the_newest_chunks_first_then_samples_the_history(s3_client, s3_bucket):
    manifest = Manifest(s3_client, s3_bucket, "trainer")
    for run in range(4):  # four runs of five 100-token chunks, r0-* the oldest
        manifest.record_run(TARGET, f"run-2026112{run}", [entry(f"r{run}-{i}") for i in range(5)], {})

    picked = manifest.replay_sample(TARGET, 1000, seed="s", recent_share=0.5)
    ids = [e.chunk_id for e in picked]
    assert sum(e.num_tokens for e in picked) == 1000 and len(set(ids)) == 10
    assert ids[:5] == [f"r3-{i}" for i in reversed(range(5))]  # half the budget: the newest run's chunks
    assert not set(ids[5:]) & set(ids[:5])  # the rest drawn from the others, each once

    uniform = [e.chunk_id for e in manifest.replay_sample(TARGET, 1000, seed="s")]
    assert len(uniform) == 10 and uniform != ids  # no recent share: a sample over the whole history
    assert [e.chunk_id for e in manifest.replay_sample(TARGET, 1000, seed="s", recent_share=1.0)] == [
        f"r{run}-{i}" for run in (3, 2) for i in reversed(range(5))]

    reread = Manifest(s3_client, s3_bucket, "trainer").load()  # a restarted trainer picks the same
    assert [e.chunk_id for e in reread.replay_sample(TARGET, 1000, seed="s", recent_share=0.5)] == ids


def test_earlier_held_out_chunks_newest_first_join_the_eval_set(s3_client, s3_bucket):
    """A run's eval set also holds earlier runs' held-out chunks (services.trainer.cycle): the ones the
    training split's hash holds out, newest first, up to the token budget; never a trained one."""
    from services.trainer.training.data import Dataset, is_heldout, split

    target = "tiny-heldout"
    manifest = Manifest(s3_client, s3_bucket, "trainer")
    runs = [[dataclasses.replace(entry(f"h{run}-{i}"), target_model=target) for i in range(40)] for run in range(3)]
    for run, entries in enumerate(runs):
        manifest.record_run(target, f"run-2026112{run}", entries, {})
    held = [e.chunk_id for e in reversed([e for r in runs for e in r]) if is_heldout(e.chunk_id, 0.1)]
    assert 3 <= len(held) < 40  # about a tenth of 120

    picked = manifest.heldout_history(target, 300, lambda cid: is_heldout(cid, 0.1))
    assert [e.chunk_id for e in picked] == held[:3]  # 100 tokens each: three reach 300
    everything = manifest.heldout_history(target, 10**6, lambda cid: is_heldout(cid, 0.1))
    assert [e.chunk_id for e in everything] == held
    # the split that trains a run holds exactly these out again: they are judged on, never trained on
    ids = [e.chunk_id for r in runs for e in r]
    _, eval_set = split(Dataset([], ids, []), 0.1)
    assert sorted(eval_set.chunk_ids) == sorted(held)

"""The training-set manifest's replay: the newest chunks first, then a sample of the whole history;
the same picks after a restart re-reads the manifest from S3."""

from __future__ import annotations

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

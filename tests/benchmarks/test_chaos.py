"""`tide chaos`'s short form: a real stack (tiny target, two workers, every service a process) under
load while the trainer, Redis, a worker and S3 are killed with SIGKILL in turn (benchmarks.chaos),
and the suite's targets asserted per scenario: chunks flowed, none lost, duplicated or dropped (from
S3, the streams and the trainer's manifest; the exporters' drop counters), the killed process came
back, and serving held (>= 99 % of the requests ok; for the worker, only requests in flight at the
kill failed and no 30 s went by without a successful answer). A target that fails for a known
missing piece is an xfail naming it (KNOWN_GAPS). The accounting itself is checked on a hand-made
data plane (real Redis and S3)."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import chaos
from benchmarks.chaos_accounting import Ledger, account, settled
from tide import blobs, streams
from tide.streams import ChunkRef

SUBSET = ("kill-trainer", "kill-redis", "kill-worker", "kill-s3")
# (scenario, check) -> the missing piece that makes it fail today; remove an entry when it lands.
KNOWN_GAPS: dict[tuple[str, str], str] = {}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    chaos.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> dict[str, dict]:
    data = tmp_path_factory.mktemp("chaos")
    args = _args("--quick", "--scenarios", ",".join(SUBSET), "--data-dir", str(data), "--pre-s", "3",
                 "--post-s", "3", "--drain-s", "20")
    res = chaos.run(args)
    print(chaos.table(res["scenarios"]))
    json.dumps(res)  # JSON-ready
    return {r["scenario"]: r for r in res["scenarios"]}


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", SUBSET)
def test_a_killed_process_costs_no_chunk_and_almost_no_request(suite, name):
    r = suite[name]
    c = r["chunks"]
    assert set(r["requests"]) == {"sent", "ok", "failed"} and r["requests"]["sent"] > 0
    assert {"written", "trained", "dead_lettered", "dropped_counted", "lost", "duplicated"} <= set(c)
    assert c["blobs"] > 0 and r["flowing_at_fault"], r  # the fault hit while chunks were flowing
    assert r["restarts"].get(chaos.BY_NAME[name].unit) == 1, r
    failed = [k for k, ok in r["checks"].items() if not ok]
    for check in failed:
        if (name, check) in KNOWN_GAPS:
            pytest.xfail(f"{name}: {check} fails until {KNOWN_GAPS[name, check]} lands: {r}")
    assert not failed, f"{name} missed {failed}:\n{json.dumps(r, indent=1)}"


# ---------------------------------------------------------------------------------- accounting


def _ref(chunk_id: str, key: str) -> ChunkRef:
    return ChunkRef(chunk_id=chunk_id, bucket="b", key=key, size_bytes=3, sha256="0" * 64, num_tokens=1,
                    target_model="t", draft_version="", workload="", worker_id="w", created_unix_s=0.0)


def test_the_ledger_finds_each_chunk_where_it_is(s3_client, s3_bucket, redis_client, unique_prefix):
    """One chunk at each step: recorded, dead-lettered, waiting, pending, acked without a record,
    never announced, announced without a blob; plus a chunk recorded under two ids (same SHA-256)."""
    names = streams.StreamNames(unique_prefix)
    ids = ["rec", "dead", "wait", "pend", "acked", "orphan", "noblob", "twin"]
    for cid in ids:
        if cid != "noblob":
            blobs.put_bytes(s3_client, s3_bucket, f"chunks/t/w/{cid}.safetensors", b"abc")
    for cid, sha in (("rec", "a" * 64), ("twin", "a" * 64)):
        blobs.put_pointer(s3_client, s3_bucket, f"trainer/targets/t/chunks/{cid}.json",
                          {**_ref(cid, f"chunks/t/w/{cid}.safetensors").__dict__, "sha256": sha,
                           "added_unix_s": 0.0}, expected_etag=None)
    entry = {cid: streams.add(redis_client, names.chunks, _ref(cid, f"chunks/t/w/{cid}.safetensors"))
             for cid in ("rec", "dead", "pend", "acked", "noblob", "twin")}
    redis_client.xgroup_create(names.chunks, streams.TRAINER_GROUP, id="0")
    redis_client.xreadgroup(streams.TRAINER_GROUP, "c", {names.chunks: ">"})  # all delivered, all pending
    for cid in ("rec", "dead", "acked", "noblob", "twin"):
        redis_client.xack(names.chunks, streams.TRAINER_GROUP, entry[cid])
    streams.add(redis_client, names.chunks, _ref("wait", "chunks/t/w/wait.safetensors"))  # after the group read
    streams.add(redis_client, names.dead_letter, streams.DeadLetter(
        reason="invalid chunk: nan", consumer="trainer/c", source_stream=names.chunks, source_id=entry["dead"],
        ref=_ref("dead", "chunks/t/w/dead.safetensors")))

    led = Ledger.read(s3_client, s3_bucket, redis_client, names)
    assert led.known == set(ids)
    got = account(led, set(ids))
    assert {k: got[k] for k in ("blobs", "trained", "dead_lettered", "in_stream", "lost", "duplicated")} == {
        "blobs": 7, "trained": 2, "dead_lettered": 1, "in_stream": 2, "lost": 3, "duplicated": 1}
    assert got["lost_why"] == {"acked_unrecorded": 1, "unannounced": 1, "blob_missing": 1}
    assert not settled(led, set(ids)) and settled(led, {"rec", "dead", "twin"})
    assert account(led, {"rec"})["duplicated"] == 0

"""tide.streams against a real redis-server (the shared `redis_server` fixture)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import redis

from tide import streams
from tide.servers import SYSTEM_REDIS_SERVER, RedisServer
from tide.streams import ChunkRef, Consumer, ConsumerThread, DeadLetter, PayloadError, Reject, StreamNames, Transient
from tide.telemetry import StepRecord

SHA = "ab" * 32


def make_ref(i: int = 0, **overrides) -> ChunkRef:
    fields = dict(
        chunk_id=f"c{i}",
        bucket="chunks",
        key=f"smollm2/c{i}.safetensors",
        size_bytes=1000 + i,
        sha256=SHA,
        num_tokens=64,
        target_model="smollm2-135m",
        draft_version="v1",
        workload="chat",
        worker_id="w0",
        created_unix_s=1700000000.5,
    )
    return ChunkRef(**{**fields, **overrides})


def make_step(step: int = 0) -> StepRecord:
    return StepRecord(
        worker_id="w0",
        step=step,
        time_unix_s=1700000000.0,
        batch_size=2,
        request_ids=["a", "b"],
        gammas=[3, 3],
        accepted=[2, 0],
        draft_ms=1.5,
        verify_ms=40.0,
        other_ms=0.5,
        workload=["chat", "gsm8k"],
    )


@pytest.fixture
def names(unique_prefix: str) -> StreamNames:
    return StreamNames(unique_prefix)


def consumer(client, names: StreamNames, name: str = "c1", **kwargs) -> Consumer[ChunkRef]:
    kwargs = {"block_ms": 10, "reclaim_every_s": 0.0, **kwargs}
    return Consumer(client, names.chunks, "trainer", name, ChunkRef, dead_letter_stream=names.dead_letter, **kwargs)


def dead_letters(client, names: StreamNames) -> list[DeadLetter]:
    return [streams.decode(f, DeadLetter) for _, f in client.xrange(names.dead_letter)]


def pending(client, names: StreamNames) -> int:
    return client.xpending(names.chunks, "trainer")["pending"]


# ----------------------------------------------------------------------------- schemas


def test_names_are_prefixed_and_distinct():
    n = StreamNames("tide")
    assert (n.telemetry, n.chunks, n.dead_letter) == ("tide:telemetry", "tide:chunks", "tide:dead-letter")
    assert streams.default_maxlen(n.telemetry) == streams.TELEMETRY_MAXLEN
    assert streams.default_maxlen(n.chunks) == streams.CHUNKS_MAXLEN


@pytest.mark.parametrize(
    "payload",
    [
        make_step(),
        make_ref(),
        DeadLetter("bad", "trainer/c1", "tide:chunks", "1-0", ref=make_ref(), deliveries=2, time_unix_s=1.0),
        DeadLetter("unparseable", "trainer/c1", "tide:chunks", "1-1", raw={"type": "x"}),
    ],
)
def test_roundtrip(payload):
    fields = streams.encode(payload)
    assert set(fields) == {"type", "v", "data"}
    assert streams.decode(fields, type(payload)) == payload
    as_bytes = {k.encode(): v.encode() for k, v in fields.items()}  # what a bytes client returns
    assert streams.decode(as_bytes, type(payload)) == payload


def _fields(data: dict, type_: str = "chunk_ref", v: str = "1") -> dict[str, str]:
    return {"type": type_, "v": v, "data": json.dumps(data)}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"size_bytes": "12"}, "size_bytes must be int"),
        ({"size_bytes": True}, "size_bytes must be int"),
        ({"created_unix_s": "now"}, "created_unix_s must be a number"),
        ({"sha256": "XYZ"}, "sha256"),
        ({"bucket": ""}, "bucket must not be empty"),
        ({"num_tokens": -1}, ">= 0"),
    ],
)
def test_decode_rejects_bad_fields(change, message):
    data = {**json.loads(streams.encode(make_ref())["data"]), **change}
    with pytest.raises(PayloadError, match=message):
        streams.decode(_fields(data), ChunkRef)


def test_decode_rejects_bad_envelopes():
    good = json.loads(streams.encode(make_ref())["data"])
    with pytest.raises(PayloadError, match="expected type"):
        streams.decode(_fields(good, type_="step_record"), ChunkRef)
    with pytest.raises(PayloadError, match="schema version"):
        streams.decode(_fields(good, v="2"), ChunkRef)
    with pytest.raises(PayloadError, match="not JSON"):
        streams.decode({"type": "chunk_ref", "v": "1", "data": "{"}, ChunkRef)
    with pytest.raises(PayloadError, match="missing"):
        streams.decode(_fields({k: v for k, v in good.items() if k != "sha256"}), ChunkRef)
    with pytest.raises(PayloadError, match="JSON object"):
        streams.decode(_fields([1, 2]), ChunkRef)  # type: ignore[arg-type]


def test_decode_ignores_unknown_fields_and_fills_defaults():
    data = json.loads(make_step().to_json())
    data["added_by_a_newer_worker"] = 1
    del data["workload"]  # has a default
    record = streams.decode(_fields(data, type_="step_record"), StepRecord)
    assert record.workload == [] and record.accepted == [2, 0]


# ---------------------------------------------------------------------------- producer


def test_add_trims_approximately(redis_client, names):
    for i in range(1000):
        streams.add(redis_client, names.telemetry, make_step(i), maxlen=100)
    assert 100 <= redis_client.xlen(names.telemetry) < 1000


# ---------------------------------------------------------------------------- consumer


def test_ensure_group_is_idempotent(redis_client, names):
    c = consumer(redis_client, names)
    c.ensure_group()
    c.ensure_group()
    consumer(redis_client, names, "c2").ensure_group()
    assert [g["name"] for g in redis_client.xinfo_groups(names.chunks)] == [b"trainer"]


def test_reads_in_order_and_acks_after_handler(redis_client, names):
    c = consumer(redis_client, names)
    c.ensure_group()
    for i in range(5):
        streams.add(redis_client, names.chunks, make_ref(i))
    seen: list[str] = []

    def handler(msg):
        assert pending(redis_client, names) >= 1  # not acked before the handler returns
        seen.append(msg.payload.chunk_id)
        assert msg.deliveries == 1

    while c.poll(handler):
        pass
    assert seen == [f"c{i}" for i in range(5)]
    assert pending(redis_client, names) == 0
    assert c.stats.handled == 5 and c.stats.dead_lettered == 0


def _xack_calls(client) -> int:
    return int(client.info("commandstats").get("cmdstat_xack", {}).get("calls", 0))


def test_a_read_is_acked_in_one_round_trip(redis_client, names):
    """The controller reads one step record per engine step: one XACK per read, not one per entry
    (each is a round trip that wakes Redis and the reader on the engine's cores)."""
    c = consumer(redis_client, names, count=16)
    c.ensure_group()
    for i in range(10):
        streams.add(redis_client, names.chunks, make_ref(i))
    before = _xack_calls(redis_client)
    assert c.poll(lambda msg: None) == 10
    assert _xack_calls(redis_client) - before == 1
    assert pending(redis_client, names) == 0 and c.stats.handled == 10


def test_entries_handled_before_a_transient_retry_are_acked_first(redis_client, names, monkeypatch):
    """While one entry of a read is retried, the ones before it in that read are already acked:
    no consumer may reclaim and process them again."""
    monkeypatch.setattr(streams, "TRANSIENT_FIRST_S", 0.05)
    c = consumer(redis_client, names, block_ms=20)
    c.ensure_group()
    for i in range(3):
        streams.add(redis_client, names.chunks, make_ref(i))
    pending_during_retry: list[int] = []
    calls: list[str] = []

    def handler(msg):
        calls.append(msg.payload.chunk_id)
        if msg.payload.chunk_id == "c1" and calls.count("c1") == 1:
            raise Transient("object store unreachable")
        if msg.payload.chunk_id == "c1":
            pending_during_retry.append(pending(redis_client, names))

    thread = ConsumerThread(c, handler, name="ack test").start()
    try:
        _wait_for(lambda: c.stats.handled == 3)
    finally:
        thread.stop()
    assert calls == ["c0", "c1", "c1", "c2"]
    assert pending_during_retry == [2]  # c0 acked; c1 (in hand) and c2 pending
    assert pending(redis_client, names) == 0


def test_unparseable_entries_are_dead_lettered_not_dropped(redis_client, names):
    c = consumer(redis_client, names)
    c.ensure_group()
    streams.add(redis_client, names.chunks, make_ref(0))
    redis_client.xadd(names.chunks, {"type": "chunk_ref", "v": "1", "data": "{not json"})
    redis_client.xadd(names.chunks, {"something": "else"})
    streams.add(redis_client, names.chunks, make_ref(3))
    seen: list[str] = []
    while c.poll(lambda m: seen.append(m.payload.chunk_id)):
        pass
    assert seen == ["c0", "c3"]
    assert c.stats.dead_lettered == 2
    letters = dead_letters(redis_client, names)
    assert [d.raw.get("data") for d in letters] == ["{not json", None]
    assert letters[1].raw == {"something": "else"}
    assert all(d.source_stream == names.chunks and d.consumer == "trainer/c1" for d in letters)
    assert "unparseable" in letters[0].reason
    assert pending(redis_client, names) == 0


def test_rejected_chunks_carry_their_ref(redis_client, names):
    c = consumer(redis_client, names)
    c.ensure_group()
    streams.add(redis_client, names.chunks, make_ref(7))

    def handler(msg):
        raise Reject("checksum mismatch for smollm2/c7.safetensors")

    c.poll(handler)
    [letter] = dead_letters(redis_client, names)
    assert letter.ref == make_ref(7)
    assert letter.raw == {}
    assert letter.reason.startswith("checksum mismatch")
    assert pending(redis_client, names) == 0


def test_failing_handler_is_retried_then_dead_lettered(redis_client, names):
    c = consumer(redis_client, names, claim_idle_ms=0, max_deliveries=3)
    c.ensure_group()
    streams.add(redis_client, names.chunks, make_ref(1))
    deliveries: list[int] = []

    def handler(msg):
        deliveries.append(msg.deliveries)
        raise RuntimeError("transient")

    for _ in range(6):
        c.poll(handler)
    assert deliveries == [1, 2, 3]
    assert c.stats.handler_errors == 3 and c.stats.dead_lettered == 1
    [letter] = dead_letters(redis_client, names)
    assert letter.ref == make_ref(1) and letter.deliveries == 4
    assert pending(redis_client, names) == 0



def test_an_outage_retries_the_entry_in_hand_without_counting_deliveries(redis_client, names, monkeypatch):
    """A dependency down for longer than max_deliveries attempts: the entry is kept in hand and
    retried until the handler succeeds; Redis sees one delivery, nothing is dead-lettered, and the
    entry behind it waits its turn."""
    monkeypatch.setattr(streams, "TRANSIENT_FIRST_S", 0.01)
    monkeypatch.setattr(streams, "TRANSIENT_MAX_S", 0.02)
    c = consumer(redis_client, names, max_deliveries=2, block_ms=20)
    c.ensure_group()
    streams.add(redis_client, names.chunks, make_ref(1))
    streams.add(redis_client, names.chunks, make_ref(2))
    calls: list[tuple[str, int]] = []
    done = threading.Event()

    def handler(msg):
        calls.append((msg.payload.chunk_id, msg.deliveries))
        if len(calls) <= 6:  # the store is down for the first six attempts
            raise Transient("object store unreachable")
        if msg.payload.chunk_id == "c2":
            done.set()

    thread = ConsumerThread(c, handler, name="outage test").start()
    try:
        assert done.wait(10), calls
    finally:
        thread.stop()
    assert calls == [("c1", 1)] * 7 + [("c2", 1)]
    assert c.stats.transient_retries == 6 and c.stats.handled == 2 and c.stats.dead_lettered == 0
    assert dead_letters(redis_client, names) == [] and pending(redis_client, names) == 0


def test_stopping_during_an_outage_leaves_the_entry_pending_for_a_restart(redis_client, names, monkeypatch):
    monkeypatch.setattr(streams, "TRANSIENT_FIRST_S", 0.01)
    monkeypatch.setattr(streams, "TRANSIENT_MAX_S", 0.02)
    c = consumer(redis_client, names, "trainer-0", block_ms=20)
    c.ensure_group()
    streams.add(redis_client, names.chunks, make_ref(1))
    attempts = threading.Semaphore(0)

    def down(msg):
        attempts.release()
        raise Transient

    thread = ConsumerThread(c, down, name="outage test").start()
    for _ in range(3):
        assert attempts.acquire(timeout=10)
    thread.stop()
    assert pending(redis_client, names) == 1 and dead_letters(redis_client, names) == []
    [info] = redis_client.xpending_range(names.chunks, "trainer", min="-", max="+", count=1)
    assert info["times_delivered"] == 1  # the retries were not deliveries
    restarted = consumer(redis_client, names, "trainer-0")
    seen: list[str] = []
    while restarted.poll(lambda m: seen.append(m.payload.chunk_id)):
        pass
    assert seen == ["c1"] and pending(redis_client, names) == 0


DYING_CONSUMER = textwrap.dedent(
    """
    import os, sys, redis
    from tide.streams import ChunkRef, Consumer
    url, stream, dead = sys.argv[1:4]
    c = Consumer(redis.Redis.from_url(url), stream, "trainer", "doomed", ChunkRef,
                 dead_letter_stream=dead, block_ms=10)
    def handler(msg):
        os._exit(3)  # the process dies mid-handler: no ack, no cleanup
    c.poll(handler)
    """
)


def test_entries_of_a_dead_consumer_are_reclaimed(redis_server, redis_client, names):
    consumer(redis_client, names).ensure_group()
    streams.add(redis_client, names.chunks, make_ref(1))
    streams.add(redis_client, names.chunks, make_ref(2))
    proc = subprocess.run(
        [sys.executable, "-c", DYING_CONSUMER, redis_server.url, names.chunks, names.dead_letter],
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr.decode()
    assert pending(redis_client, names) == 2  # both were delivered to the doomed consumer

    survivor = consumer(redis_client, names, "survivor", claim_idle_ms=200)
    seen: list[tuple[str, int]] = []
    survivor.poll(lambda m: seen.append((m.payload.chunk_id, m.deliveries)))
    assert seen == []  # not idle long enough yet: a live consumer might still be working on them
    time.sleep(0.3)
    while survivor.poll(lambda m: seen.append((m.payload.chunk_id, m.deliveries))):
        pass
    assert seen == [("c1", 2), ("c2", 2)]
    assert survivor.stats.reclaimed == 2
    assert pending(redis_client, names) == 0


def test_restart_under_same_name_resumes_own_pending(redis_client, names):
    first = consumer(redis_client, names, "trainer-0")
    first.ensure_group()
    for i in range(3):
        streams.add(redis_client, names.chunks, make_ref(i))

    class Crash(BaseException):
        pass

    def crash(msg):
        raise Crash

    with pytest.raises(Crash):
        first.poll(crash)
    restarted = consumer(redis_client, names, "trainer-0", claim_idle_ms=3_600_000)
    seen: list[str] = []
    while restarted.poll(lambda m: seen.append(m.payload.chunk_id)):
        pass
    assert seen == ["c0", "c1", "c2"]
    assert pending(redis_client, names) == 0


@pytest.fixture(scope="module")
def redis7(tmp_path_factory):
    if not Path(SYSTEM_REDIS_SERVER).exists():
        pytest.skip("no system redis-server >= 7")
    with RedisServer(binary=SYSTEM_REDIS_SERVER, workdir=tmp_path_factory.mktemp("redis7")) as server:
        yield server


@pytest.mark.parametrize("server", ["wheel", "system"])
def test_trimmed_pending_entries_are_counted_and_cleared(request, server, redis_client, names):
    client = redis_client if server == "wheel" else redis.Redis.from_url(request.getfixturevalue("redis7").url)
    consumer(client, names).ensure_group()
    ids = [streams.add(client, names.chunks, make_ref(i)) for i in range(3)]
    client.xreadgroup("trainer", "gone", {names.chunks: ">"}, count=3)  # delivered, never acked
    client.xdel(names.chunks, ids[1])  # trimmed away before anyone processed it
    survivor = consumer(client, names, "survivor", claim_idle_ms=0)
    seen: list[str] = []
    while survivor.poll(lambda m: seen.append(m.payload.chunk_id)):
        pass
    assert seen == ["c0", "c2"]
    assert survivor.stats.missing == 1
    assert client.xpending(names.chunks, "trainer")["pending"] == 0
    if server == "system":
        client.delete(names.chunks)


def test_run_rides_out_a_redis_restart(tmp_path):
    names = StreamNames("restart")
    server = RedisServer(workdir=tmp_path / "a").start()
    port = server.port
    client = redis.Redis(port=port, socket_timeout=1)
    c = consumer(client, names, block_ms=50)
    c.ensure_group()
    seen: list[str] = []
    stop = threading.Event()
    thread = threading.Thread(target=c.run, args=(lambda m: seen.append(m.payload.chunk_id), stop))
    thread.start()
    try:
        streams.add(client, names.chunks, make_ref(1))
        _wait_for(lambda: seen == ["c1"])
        server.stop()  # Redis goes away (data included: no persistence)
        time.sleep(0.3)
        assert thread.is_alive()
        server = RedisServer(port=port, workdir=tmp_path / "b").start()
        # The new server is empty: the consumer must notice its group is gone and recreate it.
        streams.add(client, names.chunks, make_ref(2))
        _wait_for(lambda: seen == ["c1", "c2"])
    finally:
        stop.set()
        thread.join(10)
        server.stop()


def _wait_for(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)

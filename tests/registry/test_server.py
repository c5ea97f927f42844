"""RegistryService over a real gRPC socket and the real S3 server: status codes, auth, watch, downloads."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from registry.harness import TARGET, TOKEN, start_registry

from services.registry.store import RegistryStore
from tide import blobs, grpcutil
from tide.proto.tide.v1 import common_pb2, registry_pb2
from tide.proto.tide.v1 import registry_pb2_grpc as registry_grpc
from tide.registry_client import fetch_version, upload_checkpoint


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


@pytest.fixture
def client(registry):
    c = registry.client()
    yield c
    c.close()


def test_register_list_get_and_health(registry, client, drafts):
    d1 = client.register_dir(
        drafts(0),
        TARGET,
        s3=registry.s3,
        bucket=registry.bucket,
        eval_metrics={"accept_length": 1.73},
        provenance={"run": "r1"},
    )
    d2 = client.register_dir(drafts(1), TARGET, s3=registry.s3, bucket=registry.bucket, parent_version=d1.version)
    assert (d1.version, d2.version, d2.parent_version) == (f"{TARGET}/v0001", f"{TARGET}/v0002", d1.version)
    assert d1.eval_metrics["accept_length"] == pytest.approx(1.73) and '"run": "r1"' in d1.provenance_json
    assert client.register_dir(drafts(0), TARGET, s3=registry.s3, bucket=registry.bucket).version == d1.version
    listing = client.list(TARGET)
    assert [d.version for d in listing.drafts] == [d1.version, d2.version]
    assert listing.pointer.target_model == TARGET and listing.pointer.generation == 0
    assert [d.version for d in client.list().drafts] == [d1.version, d2.version]
    assert client.get(d2.version).artifact.prefix == d2.artifact.prefix
    health = health_pb2_grpc.HealthStub(client.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="tide.v1.RegistryService"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_status_codes(registry, client, drafts, tmp_path):
    art = upload_checkpoint(registry.s3, registry.bucket, drafts(0), TARGET)
    bad = common_pb2.DraftArtifact(bucket=art.bucket, prefix=art.prefix, files=art.files)
    bad.files[1].sha256 = "0" * 64
    assert _code(lambda: client.register(TARGET, bad)) == grpc.StatusCode.INVALID_ARGUMENT
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{}")
    (tmp_path / "junk" / "model.safetensors").write_bytes(b"not safetensors")
    junk = lambda: client.register_dir(tmp_path / "junk", TARGET, s3=registry.s3, bucket=registry.bucket)  # noqa: E731
    assert _code(junk) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: client.get(f"{TARGET}/v0009")) == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: client.get("whatever")) == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: client.pin(f"{TARGET}/v0009", TARGET)) == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: client.promote(f"{TARGET}/v0009")) == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: client.rollback(TARGET, "why not")) == grpc.StatusCode.FAILED_PRECONDITION
    v1 = client.register(TARGET, art).version
    assert _code(lambda: client.pin(v1, "other-target")) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: client.pointer("bad target")) == grpc.StatusCode.INVALID_ARGUMENT
    client.promote(v1, reason="first")
    stale = lambda: client.promote(v1, expected_current="")  # noqa: E731  (v1 is current: a no-op is not checked first)
    assert _code(stale) == grpc.StatusCode.FAILED_PRECONDITION
    assert _code(lambda: client.rollback(TARGET)) == grpc.StatusCode.FAILED_PRECONDITION
    v2 = client.register(TARGET, upload_checkpoint(registry.s3, registry.bucket, drafts(1), TARGET)).version
    client.promote(v2)
    assert _code(lambda: client.rollback(TARGET, expected_current=v1)) == grpc.StatusCode.FAILED_PRECONDITION
    assert client.pointer(TARGET).current == v2  # the stale rollback changed nothing
    assert client.rollback(TARGET, expected_current=v2).current == v1


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_admin_calls_need_the_token(registry, drafts, token):
    art = upload_checkpoint(registry.s3, registry.bucket, drafts(0), TARGET)
    with registry.client() as admin:
        v1 = admin.register(TARGET, art).version
        admin.promote(v1)
    with registry.client(token=token) as c:
        for call in (
            lambda: c.register(TARGET, art),
            lambda: c.promote(v1),
            lambda: c.pin(v1),
            lambda: c.unpin(TARGET),
            lambda: c.rollback(TARGET),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert ("invalid bearer token" if token else "send metadata") in info.value.details()
        # Reads and watches need no token.
        assert c.get(v1).version == v1 and c.pointer(TARGET).current == v1
        assert next(c.watch(TARGET)).version == v1


def test_server_without_a_token_refuses_admin_calls(s3_client, s3_bucket):
    reg = start_registry(s3_client, s3_bucket, token=None)
    try:
        with reg.client(token="anything") as c:
            assert _code(lambda: c.unpin(TARGET)) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        reg.stop()


def _watch(client, target):
    """Start a watch in a thread; returns (queue of assignments, stop event)."""
    q, stop = queue.Queue(), threading.Event()

    def run():
        for a in client.watch(target, stop):
            q.put((time.monotonic(), a))

    threading.Thread(target=run, daemon=True).start()
    return q, stop


def _next(q, timeout=5.0):
    return q.get(timeout=timeout)


def test_watch_pushes_each_change_within_a_second(registry, client, drafts):
    v1 = client.register_dir(drafts(0), TARGET, s3=registry.s3, bucket=registry.bucket).version
    v2 = client.register_dir(drafts(1), TARGET, s3=registry.s3, bucket=registry.bucket).version
    q, stop = _watch(client, TARGET)
    try:
        _, first = _next(q)
        assert (first.version, first.generation, first.pinned) == ("", 0, False)  # nothing promoted yet
        for action, expected, pinned in [
            (lambda: client.promote(v1), v1, False),
            (lambda: client.promote(v2), v2, False),
            (lambda: client.pin(v1, reason="hold"), v1, True),
            (lambda: client.unpin(TARGET), v2, False),
            (lambda: client.rollback(TARGET, "regressed"), v1, False),
        ]:
            t0 = time.monotonic()
            state = action()
            at, a = _next(q)
            assert (a.version, a.pinned, a.generation) == (expected, pinned, state.generation)
            assert at - t0 < 1.0
            assert [f.name for f in a.artifact.files] == ["config.json", "model.safetensors"]
        # A change written by another replica (a second store on the same bucket) arrives by polling.
        other = RegistryStore(registry.s3, registry.bucket)
        t0 = time.monotonic()
        other.promote(TARGET, v2, "from another replica")
        at, a = _next(q)
        assert a.version == v2 and at - t0 < 1.0
        # Promoting while pinned does not change what workers run: no message.
        client.pin(v2)
        assert _next(q)[1].pinned
        client.promote(v1)
        with pytest.raises(queue.Empty):
            q.get(timeout=0.5)
    finally:
        stop.set()


def test_watch_reconnects_after_a_registry_restart(s3_client, s3_bucket, drafts):
    reg = start_registry(s3_client, s3_bucket)
    address = reg.address
    with reg.client() as c:
        v1 = c.register_dir(drafts(0), TARGET, s3=s3_client, bucket=s3_bucket).version
        c.promote(v1)
    watcher = reg.client(token=None)
    q, stop = _watch(watcher, TARGET)
    try:
        assert _next(q)[1].version == v1
        reg.stop()
        time.sleep(0.3)
        reg = start_registry(s3_client, s3_bucket, address=address)
        with reg.client() as c:
            grpcutil.wait_ready(c.channel)  # the address was down a moment ago: wait out gRPC's connect backoff
            v2 = c.register_dir(drafts(1), TARGET, s3=s3_client, bucket=s3_bucket).version
            c.promote(v2)
        assert _next(q, timeout=15)[1].version == v2
    finally:
        stop.set()
        watcher.close()
        reg.stop()


def test_download_verifies_checksums_and_caches(registry, client, drafts, tmp_path):
    d = client.register_dir(drafts(0), TARGET, s3=registry.s3, bucket=registry.bucket)
    cache = tmp_path / "cache"
    path = fetch_version(registry.s3, d.version, d.artifact, cache)
    assert (path / "model.safetensors").read_bytes() == (drafts(0) / "model.safetensors").read_bytes()
    assert fetch_version(registry.s3, d.version, d.artifact, cache) == path  # cached: no download
    # Corrupt the stored weights: a fresh download fails loudly and leaves no cache entry behind.
    key = f"{d.artifact.prefix}/model.safetensors"
    data = bytearray(blobs.get_bytes(registry.s3, registry.bucket, key))
    data[len(data) // 2] ^= 0xFF
    registry.s3.put_object(registry.bucket, key, __import__("io").BytesIO(bytes(data)), len(data))
    with pytest.raises(blobs.ChecksumMismatch, match="model.safetensors"):
        fetch_version(registry.s3, d.version, d.artifact, tmp_path / "fresh")
    assert list((tmp_path / "fresh").iterdir()) == []
    # The cached copy stays valid; re-verifying it locally detects local damage and re-downloads (and fails).
    (path / "model.safetensors").write_bytes(b"damaged")
    with pytest.raises(blobs.ChecksumMismatch):
        fetch_version(registry.s3, d.version, d.artifact, cache, verify_cached=True)


def test_register_idempotent_under_concurrency(registry, drafts):
    arts = [upload_checkpoint(registry.s3, registry.bucket, drafts(i), TARGET) for i in range(3)]
    results: list[str] = []

    def register(art):
        with registry.client() as c:
            results.append(c.register(TARGET, art).version)

    threads = [threading.Thread(target=register, args=(arts[i % 3],)) for i in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 9 and sorted(set(results)) == [f"{TARGET}/v000{i}" for i in (1, 2, 3)]
    with registry.client() as c:
        assert [d.version for d in c.list(TARGET).drafts] == sorted(set(results))


def test_list_refuses_malformed_target_names(registry):
    ch = grpcutil.channel(registry.address, token=TOKEN)
    stub = registry_grpc.RegistryServiceStub(ch)
    with pytest.raises(grpc.RpcError) as info:
        stub.ListDrafts(registry_pb2.ListDraftsRequest(target_model="../etc"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ch.close()
    with registry.client() as c, pytest.raises(grpc.RpcError) as info:  # not retried: it cannot get better
        next(c.watch("../etc"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_oversized_names_and_versions_are_invalid_not_internal(registry, client, drafts):
    """A 5,000-digit version once reached int() and came back INTERNAL with a traceback in the log."""
    v1 = client.register(TARGET, upload_checkpoint(registry.s3, registry.bucket, drafts(0), TARGET)).version
    huge = f"{TARGET}/v" + "1" * 5000
    assert _code(lambda: client.get(huge)) in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    assert _code(lambda: client.get(f"{TARGET}/v" + "1" * 3000)) == grpc.StatusCode.NOT_FOUND  # below the bound
    assert _code(lambda: client.promote(huge, TARGET)) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: client.promote(v1, TARGET, reason="x" * 100_000)) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: client.pointer("t" * 100_000)) == grpc.StatusCode.INVALID_ARGUMENT
    assert client.promote(v1, TARGET, reason="a normal reason").current == v1

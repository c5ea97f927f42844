"""RegistryStore on the real S3 server: registration checks, immutability, idempotency, pointers."""

from __future__ import annotations

import json

import pytest
from registry.harness import TARGET

from services.registry.model import Artifact, FailedPrecondition, FileEntry, InvalidArgument, NotFound
from services.registry.store import RegistryStore
from tide import blobs
from tide.eagle3.testing import TINY_TARGET
from tide.registry_client import artifact_digest, artifact_prefix, checkpoint_files, upload_checkpoint


def _artifact(pb) -> Artifact:
    return Artifact(pb.bucket, pb.prefix, tuple(FileEntry(f.name, f.sha256, f.size_bytes) for f in pb.files))


@pytest.fixture
def store(s3_client, s3_bucket):
    return RegistryStore(s3_client, s3_bucket)


def _register(store, path, target=TARGET, **kwargs):
    art = _artifact(upload_checkpoint(store.s3, store.bucket, path, target))
    return store.register(target, art, **kwargs)


def test_register_records_an_immutable_manifest(store, drafts):
    first = _register(store, drafts(0), eval_metrics={"accept_length": 1.7}, provenance_json='{"run": "r1"}')
    assert first.version == f"{TARGET}/v0001"
    assert first.artifact.prefix == artifact_prefix(TARGET, first.content_digest)
    assert {f.name for f in first.artifact.files} == {"config.json", "model.safetensors"}
    assert first.eval_metrics == {"accept_length": 1.7} and first.drafter == "eagle3"
    assert first.config["vocab_size"] == TINY_TARGET["vocab_size"] and first.config["draft_vocab_size"] == 40
    second = _register(store, drafts(1), parent_version=first.version)
    assert second.version == f"{TARGET}/v0002" and second.parent_version == first.version
    # Idempotent: the same bytes again (a retry) give the same version, nothing new is allocated.
    assert _register(store, drafts(0), eval_metrics={"other": 1.0}) == first
    assert [d.version for d in store.list(TARGET)] == [first.version, second.version]
    # A fresh store (another replica) reads the same manifests; they cannot be overwritten.
    other = RegistryStore(store.s3, store.bucket)
    assert other.get(second.version) == second and other.targets() == [TARGET]
    with pytest.raises(NotFound):
        other.get(f"{TARGET}/v00002")  # no aliases of a version id
    key = f"registry/targets/{TARGET}/versions/v0001.json"
    with pytest.raises(blobs.PointerConflict):
        blobs.put_pointer(store.s3, store.bucket, key, {"tampered": True}, expected_etag=None)


def test_register_copies_files_from_any_prefix(store, drafts):
    path = drafts(0)
    files = checkpoint_files(path)
    for f in files:
        blobs.put_file(store.s3, store.bucket, f"uploads/job-17/{f.name}", path / f.name)
    src = Artifact(store.bucket, "uploads/job-17", tuple(FileEntry(f.name, f.sha256, f.size_bytes) for f in files))
    d = store.register(TARGET, src)
    assert d.artifact.prefix.startswith(f"registry/targets/{TARGET}/artifacts/")
    copied = blobs.get_bytes(store.s3, store.bucket, f"{d.artifact.prefix}/config.json")
    assert copied == (path / "config.json").read_bytes()


def _refused(store, art, match, target=TARGET, **kwargs):
    with pytest.raises(InvalidArgument, match=match):
        store.register(target, art, **kwargs)


def test_malformed_requests_are_refused(store, drafts):
    good = _artifact(upload_checkpoint(store.s3, store.bucket, drafts(0), TARGET))
    no_weights = Artifact(good.bucket, good.prefix, tuple(f for f in good.files if f.name == "config.json"))
    _refused(store, no_weights, r"lacks \['model.safetensors'\]")
    bad_name = Artifact(good.bucket, good.prefix, (*good.files, FileEntry("../x", "0" * 64, 1)))
    _refused(store, bad_name, "invalid file name")
    _refused(store, good, "invalid target_model", target="bad target")
    _refused(store, good, "finite", eval_metrics={"accept_length": float("nan")})
    _refused(store, good, "not valid JSON", provenance_json="{nope")
    _refused(store, good, "drafter", drafter="medusa")
    with pytest.raises(NotFound):
        store.register(TARGET, good, parent_version=f"{TARGET}/v0042")
    assert store.list(TARGET) == []


def test_checksum_and_size_mismatches_are_refused(store, drafts):
    good = _artifact(upload_checkpoint(store.s3, store.bucket, drafts(0), TARGET))
    wrong_sha = tuple(
        FileEntry(f.name, "ab" * 32, f.size_bytes) if f.name == "model.safetensors" else f for f in good.files
    )
    _refused(store, Artifact(good.bucket, good.prefix, wrong_sha), "checksum mismatch.*model.safetensors")
    path = drafts(0)
    for f in good.files:
        blobs.put_file(store.s3, store.bucket, f"uploads/u1/{f.name}", path / f.name)
    wrong_size = tuple(FileEntry(f.name, f.sha256, f.size_bytes + 1) for f in good.files)
    _refused(store, Artifact(good.bucket, "uploads/u1", wrong_size), r"has \d+ bytes, declared")
    missing = Artifact(good.bucket, "uploads/nothing-here", good.files)
    _refused(store, missing, "does not exist")
    assert store.list(TARGET) == []


def test_invalid_checkpoints_are_refused(store, drafts, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(InvalidArgument, match="not a valid EAGLE-3 checkpoint: .*architectures"):
        _register(store, broken)
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_bytes((drafts(0) / "config.json").read_bytes())
    (truncated / "model.safetensors").write_bytes((drafts(0) / "model.safetensors").read_bytes()[:500])
    with pytest.raises(InvalidArgument, match="not a valid EAGLE-3 checkpoint"):
        _register(store, truncated)
    # Copies the registry made of a refused checkpoint are removed again.
    (truncated / "model.safetensors").write_bytes((drafts(0) / "model.safetensors").read_bytes()[:400])
    files = tuple(FileEntry(f.name, f.sha256, f.size_bytes) for f in checkpoint_files(truncated))
    for f in files:
        blobs.put_file(store.s3, store.bucket, f"uploads/t/{f.name}", truncated / f.name)
    with pytest.raises(InvalidArgument):
        store.register(TARGET, Artifact(store.bucket, "uploads/t", files))
    assert blobs.list_keys(store.s3, store.bucket, artifact_prefix(TARGET, artifact_digest(files))) == []
    assert len(blobs.list_keys(store.s3, store.bucket, "uploads/t/")) == 2  # the caller's upload is untouched
    assert store.list(TARGET) == []


def test_checkpoints_that_do_not_fit_the_target_are_refused(store, drafts):
    _register(store, drafts(0))
    other_vocab = dict(TINY_TARGET, vocab_size=320)
    with pytest.raises(InvalidArgument, match="vocab_size 320 != 300"):
        _register(store, drafts(1, target=other_vocab))
    with pytest.raises(InvalidArgument, match="trained for target 'someone-else'"):
        _register(store, drafts(2, extra={"target_model": "someone-else"}))
    assert len(store.list(TARGET)) == 1


def test_pointer_operations(store, drafts):
    v1, v2 = _register(store, drafts(0)).version, _register(store, drafts(1)).version
    assert store.pointer(TARGET).generation == 0 and store.pointer(TARGET).effective == ""
    with pytest.raises(FailedPrecondition):
        store.rollback(TARGET, "nothing yet")
    with pytest.raises(NotFound):
        store.promote(TARGET, f"{TARGET}/v0099")
    with pytest.raises(NotFound):
        store.pin(TARGET, "no-such-version")
    with pytest.raises(InvalidArgument, match="draft of 'tiny-llama', not 'other'"):
        store.pin("other", v1)
    store.promote("", v1, "first", "trainer")  # target inferred from the version
    s = store.promote(TARGET, v2, "better", "trainer")
    assert (s.current, s.previous, s.generation) == (v2, (v1,), 2)
    s = store.pin(TARGET, v1, "hold", "op")
    assert s.effective == v1
    s = store.rollback(TARGET, "regressed", "controller")
    assert (s.current, s.pinned, s.previous, s.generation) == (v1, v1, (), 4)
    stored = blobs.get_pointer(store.s3, store.bucket, f"registry/targets/{TARGET}/pointer.json").value
    assert json.loads(json.dumps(stored))["history"][0]["reason"] == "regressed"
    assert store.unpin(TARGET, "ok", "op").effective == v1

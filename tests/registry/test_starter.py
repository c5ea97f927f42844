"""Starter drafts: the first version of a target with none, registered and promoted at start — and
never again once the target has versions (the seeding a real registry runs before it serves)."""

from __future__ import annotations

import json

from registry.harness import TARGET

from services.registry import starter
from services.registry.store import RegistryStore

ROOT = "registry"


def _starter(drafts, tmp_path, name="tiny", **card):
    path = drafts(7)
    (path / starter.CARD).write_text(json.dumps({"target_model": TARGET, "eval_metrics": {"accept_length_g3": 2.1},
                                                 "command": "tide draft bootstrap ...", **card}))
    root = tmp_path / "starters"
    root.mkdir(parents=True, exist_ok=True)
    if not (root / name).exists():
        (root / name).symlink_to(path, target_is_directory=True)
    return root


def test_a_target_without_versions_gets_the_starter_promoted(s3_client, s3_bucket, drafts, tmp_path):
    store = RegistryStore(s3_client, s3_bucket, ROOT)
    (version,) = starter.seed(store, s3_client, s3_bucket, ROOT, _starter(drafts, tmp_path))
    pointer = store.pointer(TARGET)
    assert pointer.current == version and pointer.effective == version
    manifest = store.get(version)
    assert json.loads(manifest.provenance_json)["source"] == "starter"
    assert manifest.eval_metrics == {"accept_length_g3": 2.1}
    # a restart seeds nothing more: the target has a version
    assert starter.seed(RegistryStore(s3_client, s3_bucket, ROOT), s3_client, s3_bucket, ROOT,
                        _starter(drafts, tmp_path / "again")) == []
    assert [m.version for m in store.list(TARGET)] == [version]


def test_a_target_with_versions_keeps_them(s3_client, s3_bucket, drafts, tmp_path):
    """Rolled back to "no draft" or not: a target that had versions never gets the starter back."""
    store = RegistryStore(s3_client, s3_bucket, ROOT)
    from registry.harness import start_registry

    reg = start_registry(s3_client, s3_bucket, root=ROOT)
    try:
        with reg.client() as client:
            registered = client.register_dir(drafts(1), TARGET, s3=s3_client, bucket=s3_bucket, root=ROOT)
    finally:
        reg.stop()
    assert starter.seed(store, s3_client, s3_bucket, ROOT, _starter(drafts, tmp_path)) == []
    assert [m.version for m in store.list(TARGET)] == [registered.version]
    assert store.pointer(TARGET).current == ""


def test_an_unreadable_card_is_skipped(s3_client, s3_bucket, tmp_path):
    bad = tmp_path / "starters" / "broken"
    bad.mkdir(parents=True)
    (bad / starter.CARD).write_text("{not json")
    store = RegistryStore(s3_client, s3_bucket, ROOT)
    assert starter.seed(store, s3_client, s3_bucket, ROOT, tmp_path / "starters") == []

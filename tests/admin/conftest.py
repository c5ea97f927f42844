"""A running registry with two registered drafts of one target, and TIDE_* env pointing at it."""

from __future__ import annotations

import pytest
from registry.harness import TARGET, TOKEN, start_registry, write_draft

from tide.registry_client import upload_checkpoint


@pytest.fixture
def seeded(s3_client, s3_bucket, tmp_path, monkeypatch):
    reg = start_registry(s3_client, s3_bucket)
    versions = []
    with reg.client() as c:
        for i in range(3):
            art = upload_checkpoint(s3_client, s3_bucket, write_draft(tmp_path / f"d{i}", seed=i), TARGET)
            parent = versions[-1] if versions else ""
            versions.append(
                c.register(
                    TARGET,
                    art,
                    eval_metrics={"accept_length": 1.5 + i / 10},
                    provenance={"run": f"run-{i}"},
                    parent_version=parent,
                ).version
            )
    monkeypatch.setenv("TIDE_REGISTRY_ADDR", reg.address)
    monkeypatch.setenv("TIDE_ADMIN_TOKEN", TOKEN)
    yield reg, versions
    reg.stop()

"""Fixtures: `registry` (a running registry on the shared S3 server) and `drafts` (checkpoint dirs)."""

from __future__ import annotations

import json

import pytest
from registry.harness import Registry, start_registry, write_draft


@pytest.fixture
def registry(s3_client, s3_bucket):
    reg: Registry = start_registry(s3_client, s3_bucket)
    yield reg
    reg.stop()


@pytest.fixture
def drafts(tmp_path):
    """drafts(i) -> path of a distinct valid checkpoint (seed i), written once."""
    made = {}

    def get(i: int = 0, **kwargs):
        key = (i, json.dumps(kwargs, sort_keys=True))
        if key not in made:
            made[key] = write_draft(tmp_path / f"draft-{i}-{len(made)}", seed=i, **kwargs)
        return made[key]

    return get

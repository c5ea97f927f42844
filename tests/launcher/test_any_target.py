"""`tide up --target DIR` for a target of any family, with no draft of its own: nothing in the
launcher assumes the reference model's starter draft. The workers run the "eagle3" drafter (the
registry's current draft for their target, n-gram prompt lookup until one loads), the registry seeds
only starters whose card names the target, and the shipped one names the reference model alone, so
such a stack starts on prompt lookup, which the controller reads as the loop's cold start."""

from __future__ import annotations

import json

import pytest
from support.engine import FAMILY_TARGETS, save_tiny_target

from services.registry.settings import SHIPPED_STARTERS
from services.registry.starter import CARD, starter_dirs
from tide.target import REFERENCE_MODEL_ID, resolve_target
from tools.launcher import Endpoints, StackConfig, service_env, unservable

EP = Endpoints(redis_url="redis://127.0.0.1:1/0", s3_endpoint="127.0.0.1:2", s3_access_key="a", s3_secret_key="s",
               admin_token="t", registry="127.0.0.1:3", trainer="127.0.0.1:4", controller="127.0.0.1:5",
               workers=("127.0.0.1:6",), gateway_host="127.0.0.1", gateway_port=8000)


def test_the_shipped_starters_are_for_the_reference_model_only():
    cards = [json.loads((d / CARD).read_text()) for d in starter_dirs(SHIPPED_STARTERS)]
    assert cards and {c["target_model"] for c in cards} == {REFERENCE_MODEL_ID}


@pytest.mark.parametrize("family", sorted(set(FAMILY_TARGETS) - {"llama"}))
def test_a_target_of_another_family_starts_on_prompt_lookup(tmp_path, family):
    path = tmp_path / f"Tiny-{family}"
    save_tiny_target(path, arch=family, layers=4)
    assert unservable(str(path)) is None
    model_id = resolve_target(path).model_id
    assert model_id != REFERENCE_MODEL_ID  # no shipped starter is registered for it
    cfg = StackConfig(target=str(path))
    worker = service_env("inference", cfg, EP)
    assert worker["TIDE_TARGET"] == str(path) and worker["TIDE_DRAFTER"] == "eagle3"
    # the registry keeps its default starters directory: a starter there is seeded for its own target only
    assert "TIDE_REGISTRY_STARTER_DRAFTS" not in service_env("registry", cfg, EP)
    assert service_env("trainer", cfg, EP)["TIDE_TARGET"] == str(path)  # the trainer trains for the same target

"""The full chain for a non-Llama target (Gemma 2: (1 + w) norms, soft-capped logits, sliding
windows): a worker started with no draft for it serves n-gram prompt lookup (what the controller
reads as the loop's cold start), then `tide draft bootstrap`'s draft, registered and promoted in a real
registry, is picked up and speculates, greedy output unchanged and draft tokens proposed."""

from __future__ import annotations

import pytest
import torch
from inference.service.svc import ADMIN_TOKEN, request, run_stream, stub, wait_for
from registry.harness import start_registry

from services.inference.app import build
from services.inference.settings import InferenceSettings
from tide.engine.llama import LlamaModel
from tide.target import resolve_target

FAMILY = "gemma2"
PROMPT = [5, 17, 42, 8, 63, 5, 17, 42, 9, 30, 12]


@pytest.fixture
def registry(s3_client, s3_bucket):
    reg = start_registry(s3_client, s3_bucket, poll_s=0.05)
    yield reg
    reg.stop()


def test_bootstrapped_gemma2_draft_registers_and_serves(real_storage, registry, tmp_path):
    from trainer.test_family_drafts import bootstrap_family

    target = resolve_target(bootstrap_family(tmp_path, FAMILY).path)  # named as `tide up --target PATH` names it
    model = LlamaModel.load(target, dtype=torch.float32)
    kw = dict(target=str(target.path), dtype="fp32", max_batch=4, max_seq_len=256, max_tokens_per_step=64,
              max_queue=8, listen="127.0.0.1:0", metrics_port=0, worker_id="family-worker",
              telemetry_interval_s=0.05, telemetry_batch=8, flush_interval_s=0.3, chunk_tokens=64,
              admin_token=ADMIN_TOKEN, storage=real_storage, chunk_spool_dir=str(tmp_path / "spool"),
              policy="static", policy_params={"gamma": 3}, registry_addr=registry.address,
              draft_cache_dir=str(tmp_path / "cache"), drafter="eagle3", prompt_lookup=False)
    svc = build(InferenceSettings(**kw), model=model, tokenizer=None, model_id=target.model_id)
    try:
        client = stub(svc)
        plain, _, _ = run_stream(client, request("plain", PROMPT, max_tokens=32, speculative=False))
        # no draft for this target anywhere: the "eagle3" drafter is its n-gram fallback (prompt lookup)
        assert svc.worker.status().draft_version == "ngram"
        tokens, _, last = run_stream(client, request("cold", PROMPT, max_tokens=32, speculative=True))
        assert tokens == plain and last.final.speculation.draft_version == "ngram"
        admin = registry.client()
        try:
            version = admin.register_dir(tmp_path / "out" / "draft", target.model_id, s3=registry.s3,
                                         bucket=registry.bucket).version
            admin.promote(version, target.model_id, reason="bootstrap")
        finally:
            admin.close()
        wait_for(lambda: svc.worker.status().draft_version == version, 10, f"the worker to serve {version}")
        tokens, _, last = run_stream(client, request("spec", PROMPT, max_tokens=32, speculative=True))
        spec = last.final.speculation
        assert tokens == plain
        assert spec.drafter == "eagle3" and spec.draft_version == version and spec.draft_tokens > 0
    finally:
        svc.stop(grace_s=0.5)

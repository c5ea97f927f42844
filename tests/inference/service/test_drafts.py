"""Registry-driven drafts on a real worker: a real registry and S3, tiny random EAGLE-3 drafts that
fit the tiny target, registered and moved with RegistryClient like tidectl does; the worker picks
each effective version up within seconds, in-flight requests are unharmed, bad drafts are refused."""

from __future__ import annotations

import io
import threading
import time

import grpc
import pytest
from inference.service.svc import ADMIN_TOKEN, request, run_stream, stub, wait_for
from prometheus_client import REGISTRY as PROM
from registry.harness import start_registry

from tide.eagle3 import save_checkpoint
from tide.eagle3.testing import TINY_TARGET, make_draft
from tide.proto.tide.v1 import inference_pb2

TARGET = "tiny-llama-0"  # the model id make_service gives the worker
PROMPT = [5, 17, 42, 8, 63, 5, 17, 42, 9]


@pytest.fixture
def registry(s3_client, s3_bucket):
    reg = start_registry(s3_client, s3_bucket, poll_s=0.05)
    yield reg
    reg.stop()


@pytest.fixture
def admin(registry):
    client = registry.client()
    yield client
    client.close()


def fitting(model) -> dict:
    """HF-style config of the worker's tiny target (what a draft for it is shaped by)."""
    c = model.cfg
    return {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings}


def register(admin, registry, tmp_path, seed: int, target: dict) -> str:
    draft, _ = make_draft(dtype="float32", seed=seed, target=target, draft_vocab_size=32)
    path = save_checkpoint(draft, tmp_path / f"draft-{seed}", extra={"target_model": TARGET})
    return admin.register_dir(path, TARGET, s3=registry.s3, bucket=registry.bucket).version


def serving(svc, version: str, timeout_s: float = 5.0) -> None:
    wait_for(lambda: svc.worker.status().draft_version == version, timeout_s, f"the worker to serve {version}")


def refusals(reason: str) -> float:
    return PROM.get_sample_value("tide_inference_draft_refusals_total", {"reason": reason}) or 0.0


def plain(client, rid: str, max_tokens: int = 40) -> list[int]:
    tokens, _, _ = run_stream(client, request(rid, PROMPT, max_tokens=max_tokens, speculative=False))
    return tokens


def start(make_service, registry, tmp_path, **kw):
    return make_service(registry_addr=registry.address, draft_cache_dir=str(tmp_path / "cache"), **kw)


def test_promote_pin_unpin_rollback_hot_swap(make_service, registry, admin, tiny_model, tmp_path):
    svc = start(make_service, registry, tmp_path, drafter="eagle3")
    client = stub(svc)
    st = client.GetStatus(inference_pb2.GetWorkerStatusRequest(), timeout=10)
    assert st.drafter == "eagle3" and st.draft_version == "ngram"  # no draft yet: n-gram
    v1, v2 = (register(admin, registry, tmp_path, seed, fitting(tiny_model)) for seed in (1, 2))
    reference = plain(client, "plain")

    t0 = time.monotonic()
    admin.promote(v1, TARGET, reason="test")
    serving(svc, v1)
    log = [("promote v1", time.monotonic() - t0)]
    assert client.GetStatus(inference_pb2.GetWorkerStatusRequest(), timeout=10).draft_version == v1
    tokens, _, last = run_stream(client, request("e1", PROMPT, max_tokens=40))
    assert tokens == reference and last.final.speculation.draft_version == v1

    for what, move, version in (("promote v2", lambda: admin.promote(v2, TARGET), v2),
                                ("pin v1", lambda: admin.pin(v1, TARGET), v1),
                                ("unpin", lambda: admin.unpin(TARGET), v2),
                                ("rollback", lambda: admin.rollback(TARGET), v1)):
        t0 = time.monotonic()
        move()
        serving(svc, version)
        log.append((what, time.monotonic() - t0))
        tokens, _, _ = run_stream(client, request(f"after-{what}", PROMPT, max_tokens=40))
        assert tokens == reference, what
    print("swap latencies:", [(w, round(s, 3)) for w, s in log])
    assert svc.drafts.refusals == [] and all(s < 5 for _, s in log)


def test_request_in_flight_during_a_swap_is_unharmed(make_service, registry, admin, tiny_model, tmp_path):
    svc = start(make_service, registry, tmp_path, drafter="eagle3", max_seq_len=320)
    client = stub(svc)
    v1, v2 = (register(admin, registry, tmp_path, seed, fitting(tiny_model)) for seed in (3, 4))
    admin.promote(v1, TARGET)
    serving(svc, v1)
    reference = plain(client, "plain", max_tokens=200)

    versions: dict[str, set[str]] = {}

    def slow_step(record) -> None:  # a slow engine, so that the swap lands mid-request
        for rid in record.request_ids:
            versions.setdefault(rid, set()).add(record.draft_version)
        time.sleep(0.01)

    svc.worker.engine.step_listeners.append(slow_step)
    out: dict = {}
    th = threading.Thread(target=lambda: out.update(r=run_stream(client, request("long", PROMPT, max_tokens=200))))
    th.start()
    wait_for(lambda: v1 in versions.get("long", ()), 10, "the request to decode with v1")
    admin.promote(v2, TARGET)
    serving(svc, v2)
    assert svc.worker.status().running_requests == 1  # the swap happened while it ran
    th.join(timeout=60)
    tokens, _, last = out["r"]
    assert last.HasField("final") and tokens == reference
    assert versions["long"] == {v1, v2}


def test_incompatible_draft_is_refused_and_the_worker_keeps_serving(make_service, registry, admin, tmp_path):
    """The registry cannot know the target's shape (this is the target's first version), so it
    accepts a draft for a 300-token vocabulary; the worker refuses it and stays on n-gram."""
    svc = start(make_service, registry, tmp_path, drafter="eagle3")
    client = stub(svc)
    reference = plain(client, "plain")
    bad = register(admin, registry, tmp_path, 5, TINY_TARGET)
    before = refusals("incompatible")
    admin.promote(bad, TARGET)
    wait_for(lambda: svc.drafts.refusals, 5, "the refusal")
    (r,) = svc.drafts.refusals
    assert (r.version, r.reason) == (bad, "incompatible") and "vocab" in r.detail
    assert refusals("incompatible") == before + 1
    time.sleep(0.5)  # not retried in a loop
    assert svc.drafts.stats["refusals"] == 1 and svc.worker.status().draft_version == "ngram"
    tokens, _, last = run_stream(client, request("after", PROMPT, max_tokens=40))
    assert last.HasField("final") and tokens == reference


def test_corrupt_draft_is_refused_and_the_old_draft_keeps_serving(make_service, registry, admin, tiny_model,
                                                                  s3_client, tmp_path):
    """v2 passed the registry's checks, then its stored weights changed: the worker's checksummed
    download refuses it and v1 keeps serving; a later good v3 is picked up."""
    svc = start(make_service, registry, tmp_path, drafter="eagle3")
    client = stub(svc)
    v1, v2, v3 = (register(admin, registry, tmp_path, seed, fitting(tiny_model)) for seed in (6, 7, 8))
    admin.promote(v1, TARGET)
    serving(svc, v1)
    reference = plain(client, "plain")
    art = admin.get(v2).artifact
    key = f"{art.prefix}/model.safetensors"
    data = s3_client.get_object(art.bucket, key).read()
    flipped = data[:-1] + bytes([data[-1] ^ 0xFF])
    s3_client.put_object(art.bucket, key, io.BytesIO(flipped), len(flipped))
    before = refusals("checksum")
    admin.promote(v2, TARGET)
    wait_for(lambda: svc.drafts.refusals, 5, "the refusal")
    assert [(r.version, r.reason) for r in svc.drafts.refusals] == [(v2, "checksum")]
    assert refusals("checksum") == before + 1
    assert svc.worker.status().draft_version == v1
    tokens, _, last = run_stream(client, request("after-bad", PROMPT, max_tokens=40))
    assert last.HasField("final") and tokens == reference
    admin.promote(v3, TARGET)
    serving(svc, v3)


def test_eagle3_decision_runs_the_registry_draft(make_service, registry, admin, tiny_model, tmp_path):
    """A worker started on n-gram: the "eagle3" decision means the registry's draft too."""
    from inference.service.test_control import decision

    svc = start(make_service, registry, tmp_path)
    v1 = register(admin, registry, tmp_path, 9, fitting(tiny_model))
    admin.promote(v1, TARGET)
    resp = stub(svc, ADMIN_TOKEN).ApplyDecision(decision("to-eagle3", drafter="eagle3"))
    assert resp.status.drafter == "eagle3"
    serving(svc, v1)
    resp = stub(svc, ADMIN_TOKEN).ApplyDecision(decision("to-ngram", drafter="ngram"))
    assert resp.status.draft_version == "ngram"
    v2 = register(admin, registry, tmp_path, 10, fitting(tiny_model))
    admin.promote(v2, TARGET)
    wait_for(lambda: svc.drafts.version == v2, 5, "v2 loaded")
    assert svc.worker.status().draft_version == "ngram"  # loaded, not swapped in: the worker runs n-gram
    resp = stub(svc, ADMIN_TOKEN).ApplyDecision(decision("back", drafter="eagle3"))
    assert resp.status.draft_version == v2


def test_registry_outage_and_s3_errors_are_survived(make_service, registry, admin, tiny_model, tmp_path):
    """The registry goes away and comes back at the same address: the worker keeps serving its draft,
    reconnects, and follows a promotion made after; downloads that fail are retried, not refused."""
    svc = start(make_service, registry, tmp_path, drafter="eagle3")
    client = stub(svc)
    v1, v2 = (register(admin, registry, tmp_path, seed, fitting(tiny_model)) for seed in (11, 12))
    admin.promote(v1, TARGET)
    serving(svc, v1)
    reference = plain(client, "plain")
    address = registry.address
    registry.stop()
    tokens, _, _ = run_stream(client, request("registry-down", PROMPT, max_tokens=40))
    assert tokens == reference and svc.worker.status().draft_version == v1
    time.sleep(1.0)  # a few reconnect attempts fail
    again = start_registry(registry.s3, registry.bucket, poll_s=0.05, address=address)
    try:
        flaky = Flaky(svc.drafts.s3, failures=2)
        svc.drafts.s3 = flaky
        with again.client() as c:  # (gRPC's shared subchannel may still be backing off: retry)
            wait_for(lambda: promoted(c, v2), 10, "the registry to answer again")
        serving(svc, v2, timeout_s=10)
        assert flaky.failed == 2 and svc.drafts.stats["fetch_errors"] == 2 and svc.drafts.refusals == []
    finally:
        again.stop()


def promoted(client, version: str) -> bool:
    try:
        client.promote(version, TARGET)
        return True
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return False


class Flaky:
    """An S3 client whose first `failures` downloads fail as if the server were unreachable."""

    def __init__(self, inner, failures: int) -> None:
        self.inner, self.left, self.failed = inner, failures, 0

    def get_object(self, *args, **kwargs):
        if self.left:
            self.left -= 1
            self.failed += 1
            raise ConnectionError("S3 unreachable (test)")
        return self.inner.get_object(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_worker_starting_with_a_draft_in_the_registry_serves_it_from_the_first_request(
        make_service, registry, admin, tiny_model, tmp_path):
    v1 = register(admin, registry, tmp_path, 1, fitting(tiny_model))
    admin.promote(v1, TARGET, reason="test")
    svc = start(make_service, registry, tmp_path, drafter="eagle3", draft_wait_s=30)
    client = stub(svc)  # no waiting here: the worker waited for the registry's draft before serving
    _, _, last = run_stream(client, request("first", PROMPT, max_tokens=8, speculative=True))
    assert last.final.speculation.drafter == "eagle3" and last.final.speculation.draft_version == v1


@pytest.mark.parametrize("prompt_lookup", [True, False])
def test_the_registry_draft_serves_with_prompt_lookup_unless_turned_off(
        make_service, registry, admin, tiny_model, tmp_path, prompt_lookup):
    """TIDE_PROMPT_LOOKUP (on by default): the registry's draft copies where a request's context
    repeats (PROMPT repeats its first three tokens) and drafts elsewhere; output stays the plain one."""
    v1 = register(admin, registry, tmp_path, 1, fitting(tiny_model))
    admin.promote(v1, TARGET, reason="test")
    svc = start(make_service, registry, tmp_path, drafter="eagle3", draft_wait_s=30, prompt_lookup=prompt_lookup)
    client = stub(svc)

    def proposals(source: str) -> float:
        return PROM.get_sample_value("tide_inference_draft_proposals_total", {"source": source}) or 0.0

    before = proposals("copy") + proposals("draft")
    tokens, _, last = run_stream(client, request("spec", PROMPT, max_tokens=40, speculative=True))
    assert tokens == plain(client, "plain")
    assert last.final.speculation.drafter == "eagle3" and last.final.speculation.draft_version == v1
    counted = proposals("copy") + proposals("draft") - before
    assert (counted > 0) == prompt_lookup

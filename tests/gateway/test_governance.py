"""Training opt-out through the OpenAI API: a real gateway, a real worker process collecting into real
Redis and S3. `store: false`, a no-train API key and the operator's exclusions keep a request out of
every chunk, stream entry and spool file (scanned byte for byte); the X-TIDE-Training header says
which requests were eligible; captured rows carry the response id and the API key's id, never the key."""

from __future__ import annotations

import shutil
import uuid

import httpx
import pytest
from support import scan
from support.engine import save_tiny_target
from support.services import wait_for

from gateway.harness import MAX_MODEL_LEN, MODEL_NAME, serve_gateway, start_worker
from services.gateway.governance import TRAINING_HEADER, key_id
from services.gateway.settings import GatewaySettings
from tide import streams

KEY, NO_TRAIN_KEY = "key-trains", "key-never-trains"
SECRET = [901, 3077, 12012, 6161, 4444, 901, 3077, 12012]  # prompts as token ids: exact ids to scan for
SECRET2 = [777, 8888, 2323, 777, 8888, 2323, 505]
OPEN = [1500, 1501, 1502, 1503, 1500, 1501, 1502]


@pytest.fixture(scope="module")
def collecting_worker(chat_target, redis_server, s3_server, tmp_path_factory):
    """A worker collecting into real Redis and S3; its target has the 4 layers capture needs (the
    session's chat target has 2), the same vocabulary and chat template."""
    target = tmp_path_factory.mktemp("gov-target")
    save_tiny_target(target, vocab=49152, layers=4, max_position_embeddings=MAX_MODEL_LEN)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(chat_target / name, target / name)
    prefix = f"t-gov-{uuid.uuid4().hex[:8]}"
    client = s3_server.client()
    client.make_bucket(prefix)
    spool = tmp_path_factory.mktemp("gov-spool")
    w = start_worker(
        target,
        tmp_path_factory.mktemp("gov-logs"),
        env={
            "TIDE_REDIS_URL": redis_server.url,
            "TIDE_S3_ENDPOINT": s3_server.endpoint,
            "TIDE_S3_ACCESS_KEY": s3_server.access_key,
            "TIDE_S3_SECRET_KEY": s3_server.secret_key,
            "TIDE_S3_BUCKET": prefix,
            "TIDE_STREAM_PREFIX": prefix,
            "TIDE_COLLECTION": "1",
            "TIDE_CHUNK_TOKENS": "32",
            "TIDE_FLUSH_INTERVAL_S": "0.2",
            "TIDE_CHUNK_SPOOL_DIR": str(spool),
        },
    )
    yield w, prefix, spool
    w.kill()
    for obj in client.list_objects(prefix, recursive=True):
        client.remove_object(prefix, obj.object_name)
    client.remove_bucket(prefix)


def _complete(c: httpx.Client, prompt, key: str, **extra) -> httpx.Response:
    r = c.post(
        "/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra},
    )
    assert r.status_code == 200, r.text
    return r


def test_opt_out_end_to_end(tokenizer, collecting_worker, redis_server, s3_server):
    import redis

    worker, prefix, spool = collecting_worker
    with (
        serve_gateway(
            tokenizer,
            (worker.address,),
            api_keys=frozenset({KEY}),
            api_keys_no_train=frozenset({NO_TRAIN_KEY}),
            capture_exclude=frozenset({"logprobs"}),
        ) as url,
        httpx.Client(base_url=url, timeout=60) as c,
    ):
        r1 = _complete(c, SECRET, KEY, store=False)
        assert r1.headers[TRAINING_HEADER] == "excluded; reason=store_false"
        r2 = _complete(c, SECRET2, NO_TRAIN_KEY)
        assert r2.headers[TRAINING_HEADER] == "excluded; reason=api_key_policy"
        r3 = _complete(c, SECRET2, KEY, logprobs=1)
        assert r3.headers[TRAINING_HEADER] == "excluded; reason=logprobs"
        r4 = _complete(c, OPEN, KEY)
        assert r4.headers[TRAINING_HEADER] == "eligible"
        chat = c.post(
            "/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "store": False,
            },
        )
        assert chat.status_code == 200 and chat.headers[TRAINING_HEADER] == "excluded; reason=store_false"
        streamed = c.post(
            "/v1/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": MODEL_NAME, "prompt": OPEN, "max_tokens": 2, "stream": True, "store": False},
        )
        assert streamed.headers[TRAINING_HEADER] == "excluded; reason=store_false"
        opt_out = c.get("/v1/status").json()["opt_out"]  # what the status page shows of these decisions
        assert (opt_out["eligible"], opt_out["excluded"], opt_out["excluded_total"]) == (
            1, {"api_key_policy": 1, "logprobs": 1, "store_false": 3}, 5)
    rc = redis.Redis.from_url(redis_server.url)
    names = streams.StreamNames(prefix)
    want = len(OPEN) + 8 - 1  # the eligible request's rows (prompt + output - 1)
    refs = wait_for(
        lambda: (
            (rs := [streams.decode(f, streams.ChunkRef) for _, f in rc.xrange(names.chunks)])
            and sum(r.num_tokens for r in rs) >= want
            and rs
        ),
        20,
        "the eligible request's chunks",
    )
    assert sum(r.num_tokens for r in refs) == want
    rid = r4.json()["id"]
    assert {x for r in refs for x in r.request_ids} == {f"{rid}-0"}
    assert {x for r in refs for x in r.key_ids} == {key_id(KEY)} and KEY not in str(refs)
    objects = scan.s3_objects(s3_server.client(), prefix)
    entries = scan.stream_entries(rc, prefix)
    assert any(scan.holds(b, OPEN[:4]) for b in objects.values())  # positive control
    for ids in (SECRET, SECRET2):
        where = {**objects, **entries, **scan.files(spool)}
        assert not [k for k, b in where.items() if scan.holds(b, ids[:3])], "an opted-out prompt was stored"


def test_stack_switch_and_settings():
    s = GatewaySettings(train_on_traffic=False, api_keys_no_train=frozenset({"x"}))
    assert s.auth_enabled
    with pytest.raises(ValueError):
        GatewaySettings(capture_exclude=frozenset({"everything"}))
    assert key_id("secret") == key_id("secret") != key_id("other") and "secret" not in key_id("secret")

"""Worker failures, routing and cancellation, with real worker processes (killed with SIGKILL) and real gateways.

- a worker killed mid-generation: streams end with an error event and no [DONE] (the `openai`
  client raises), non-streaming requests get a 5xx OpenAI error;
- a worker that died since the last poll is skipped: the request is retried on another one;
- no healthy worker: 503 on /ready and on completions; a worker (re)appearing is picked up;
- a client that disconnects cancels its generation on the worker (streaming and not);
- least-loaded routing (WorkerPool.pick scoring).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from gateway.harness import MODEL_NAME, free_port, serve_gateway, worker_status
from services.gateway.worker_pool import WorkerPool
from tide.proto.tide.v1 import inference_pb2

CHAT = "/v1/chat/completions"
LONG = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Go on."}],
    "max_tokens": 3500,
    "ignore_eos": True,
    "speculative": False,
    "temperature": 0,
}


def running(address: str) -> int:
    """Requests the worker is generating or queueing right now, asked over gRPC directly."""
    status = worker_status(address)
    return status.running_requests + status.waiting_requests


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def first_content(lines) -> None:
    """Consume SSE lines up to the first chunk carrying generated text."""
    for line in lines:
        if line.startswith("data: {") and '"content":"' in line and '"role"' not in line:
            return
    raise AssertionError("stream ended before any content")


def test_worker_killed_mid_generation(spawn_worker, tokenizer):
    doomed = spawn_worker()
    with serve_gateway(tokenizer, (doomed.address,)) as url, httpx.Client(base_url=url, timeout=60) as client:
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        non_stream: dict = {}
        thread = threading.Thread(target=lambda: non_stream.update(r=client.post(CHAT, json=LONG)))
        thread.start()
        with client.stream("POST", CHAT, json={**LONG, "stream": True}) as response:
            lines = response.iter_lines()
            first_content(lines)
            official = oai.chat.completions.create(
                **{k: v for k, v in LONG.items() if k not in ("ignore_eos", "speculative")},
                stream=True,
                extra_body={"ignore_eos": True},
            )
            next(official)
            wait_for(lambda: running(doomed.address) == 3, what="3 running requests")
            doomed.kill()
            rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert "[DONE]" not in rest
        error = json.loads(rest[-1])["error"]
        assert error["type"] == "server_error" and error["code"] == "worker_failed"
        assert all("error" not in json.loads(x) for x in rest[:-1])
        with pytest.raises(openai.APIError):
            for _ in official:
                pass
        thread.join(timeout=30)
        assert non_stream["r"].status_code == 502
        assert non_stream["r"].json()["error"]["code"] == "worker_failed"
        wait_for(lambda: client.get("/ready").status_code == 503, what="/ready to report 503")


def test_dead_worker_is_skipped_before_the_first_token(spawn_worker, worker, tokenizer):
    doomed = spawn_worker()
    # Polls every 60 s: the gateway cannot learn of the death from a poll during the test.
    with serve_gateway(tokenizer, (doomed.address, worker.address), poll_interval_s=60) as url:
        ready = httpx.get(f"{url}/ready").json()
        assert [w["healthy"] for w in ready["workers"]] == [True, True]
        doomed.kill()
        for _ in range(4):  # round-robin between equally loaded workers: the dead one is tried
            response = httpx.post(f"{url}{CHAT}", json={**LONG, "max_tokens": 3}, timeout=60)
            assert response.status_code == 200, response.text
        states = {w["address"]: w for w in httpx.get(f"{url}/ready").json()["workers"]}
        assert not states[doomed.address]["healthy"] and states[doomed.address]["last_error"]
        assert states[worker.address]["healthy"]


def test_no_healthy_worker_then_a_worker_appears(spawn_worker, tokenizer):
    port = free_port()
    gateway = serve_gateway(tokenizer, (f"127.0.0.1:{port}",), wait_ready=False)
    with gateway as url, httpx.Client(base_url=url, timeout=30) as client:
        for response in (
            client.get("/ready"),
            client.post(CHAT, json={**LONG, "max_tokens": 2}),
            client.post(CHAT, json={**LONG, "max_tokens": 2, "stream": True}),
            client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x"}),
        ):
            assert response.status_code == 503, response.text
            assert response.json()["error"]["type"] == "server_error"
        assert client.get("/health").status_code == 200
        spawn_worker(port=port)
        wait_for(lambda: client.get("/ready").status_code == 200, timeout_s=20, what="the new worker")
        assert client.post(CHAT, json={**LONG, "max_tokens": 2}).status_code == 200


def test_stream_disconnect_cancels_upstream(gateway, worker):
    wait_for(lambda: running(worker.address) == 0, timeout_s=15, what="an idle worker")
    with (
        httpx.Client(base_url=gateway, timeout=60) as client,
        client.stream("POST", CHAT, json={**LONG, "stream": True}) as response,
    ):
        lines = response.iter_lines()  # one iterator: dropping an httpx line iterator closes the stream
        first_content(lines)
        now = running(worker.address)
        assert now == 1, f"{now} requests on the worker"
        # 3500 tokens take the worker ~10 s; a cancelled request leaves at once.
    wait_for(lambda: running(worker.address) == 0, timeout_s=3, what="the worker to drop the request")


def test_non_streaming_disconnect_cancels_upstream(gateway, worker):
    wait_for(lambda: running(worker.address) == 0, timeout_s=15, what="an idle worker")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway}{CHAT}", json={**LONG, "n": 2}, timeout=1.0)
    wait_for(lambda: running(worker.address) == 0, timeout_s=3, what="the worker to drop both choices")


def test_least_loaded_routing():
    pool = WorkerPool(("a:1", "b:2", "c:3"))
    a, b, c = pool.workers
    for w, queued, cap in ((a, 6, 8), (b, 1, 8), (c, 0, 2)):
        w.healthy = True
        w.status = inference_pb2.WorkerStatus(running_requests=queued, max_batch_size=cap)
    # scores: a 6/8, b 1/8, c 0/2 -> c, then b (c is at 1/2 after one assignment), b, c ...
    picks = [pool.pick().address for _ in range(4)]
    assert picks[0] == "c:3" and picks[1] == "b:2"
    assert picks.count("a:1") == 0
    assert pool.pick(exclude={"b:2", "c:3"}).address == "a:1"
    c.healthy = False
    assert {pool.pick().address for _ in range(3)} <= {"a:1", "b:2"}
    a.healthy = b.healthy = False
    assert pool.pick() is None and not pool.ready()


def test_worker_window_smaller_than_the_gateways(tokenizer, worker):
    """A gateway configured with a larger context than its worker: requests without max_tokens still
    work (the worker fills its own window) and the worker's refusals keep their meaning (400
    context_length_exceeded, read from its `tide-error-code` trailer)."""
    words = 4060
    while len(tokenizer.encode_chat([{"role": "user", "content": "hello " * words}])) < 4090:
        words += 1
    messages = [{"role": "user", "content": "hello " * words}]
    prompt_len = len(tokenizer.encode_chat(messages))
    body = {"model": MODEL_NAME, "messages": messages, "ignore_eos": True, "temperature": 0}
    with serve_gateway(tokenizer, (worker.address,), max_model_len=8192) as url:
        ok = httpx.post(f"{url}{CHAT}", json=body, timeout=60)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 4096 - prompt_len
        assert ok.json()["choices"][0]["finish_reason"] == "length"
        refused = httpx.post(f"{url}{CHAT}", json={**body, "max_tokens": 50}, timeout=60)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "context_length_exceeded"


def test_a_request_waits_for_a_restarting_worker_instead_of_failing(spawn_worker, tokenizer):
    """TIDE_GATEWAY_WORKER_WAIT_S: with no healthy worker (the only one is being restarted), a new
    request waits for one and succeeds; only when the wait runs out is it a 503."""
    import threading
    import time

    port = free_port()
    with serve_gateway(tokenizer, (f"127.0.0.1:{port}",), wait_ready=False, worker_wait_s=60.0) as url:
        answers: list[httpx.Response] = []
        sent = time.monotonic()
        waiting = threading.Thread(target=lambda: answers.append(
            httpx.post(f"{url}{CHAT}", json={**LONG, "max_tokens": 2}, timeout=90)))
        waiting.start()
        time.sleep(1.0)  # the request is waiting: no worker listens yet
        assert not answers
        spawn_worker(port=port)  # "restarted" on its address
        waiting.join(90)
        assert answers and answers[0].status_code == 200, answers and answers[0].text
        assert time.monotonic() - sent > 1.0
    with serve_gateway(tokenizer, (f"127.0.0.1:{free_port()}",), wait_ready=False, worker_wait_s=1.0) as url:
        t0 = time.monotonic()
        r = httpx.post(f"{url}{CHAT}", json={**LONG, "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and 0.9 <= time.monotonic() - t0 < 10, r.text

"""Generate over real gRPC: streaming chunk...final with correct counts, lossless greedy output, validation."""

from __future__ import annotations

import time

import grpc
import pytest
from inference.service.svc import request, rpc_error, run_stream, stub

from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.sequence import SamplingParams
from tide.proto.tide.v1 import inference_pb2

PROMPTS = [[5, 9, 14, 5, 9, 14, 5, 9], [40, 41, 42, 43, 40, 41], [7, 3, 88, 21, 60, 7, 3], [11, 12, 13, 14, 15]]


def plain_decode(model, prompts, max_tokens) -> list[list[int]]:
    engine = LLMEngine(model, EngineConfig(max_batch=4, max_seq_len=256, max_tokens_per_step=64))
    seqs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), speculative=False)
    return [s.output_ids for s in seqs]


def test_stream_counts_and_lossless_greedy(make_service, tiny_model):
    svc = make_service()
    client = stub(svc)
    expected = plain_decode(tiny_model, PROMPTS[:1], 30)[0]
    tokens, chunks, last = run_stream(client, request("r1", PROMPTS[0], max_tokens=30))
    assert last.HasField("final") and last.request_id == "r1"
    final = last.final
    assert tokens == expected
    assert len(chunks) >= 2 and all(c.token_ids for c in chunks)
    assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert (final.prompt_tokens, final.completion_tokens) == (len(PROMPTS[0]), 30)
    sp = final.speculation
    # one token from prefill, then every decode step emits its accepted drafts + 1
    assert 1 + sp.accepted_tokens + sp.verify_steps + sp.plain_steps == 30
    assert sp.drafter == "ngram" and sp.draft_tokens >= sp.accepted_tokens
    if sp.verify_steps:
        assert sp.accept_length == pytest.approx((sp.accepted_tokens + sp.verify_steps) / sp.verify_steps)
    assert 0 < final.time_to_first_token_ms <= final.total_ms


def test_stream_interval_sends_the_tokens_of_a_window_in_one_message_and_never_holds_back_the_end(
        make_service, tiny_model):
    """TIDE_STREAM_INTERVAL_MS: after its first chunk a stream waits up to the interval for more tokens,
    and the request's end cuts the wait short. A 5-s window is far longer than the whole request here,
    so its tokens come in at most two messages (the first token, then the rest with the end), still
    the plain decode's tokens, and the stream ends long before the window would have."""
    svc = make_service(stream_interval_ms=5000)
    expected = plain_decode(tiny_model, PROMPTS[:1], 40)[0]
    t0 = time.monotonic()
    tokens, chunks, last = run_stream(stub(svc), request("i1", PROMPTS[0], max_tokens=40, speculative=False))
    wall_s = time.monotonic() - t0
    assert tokens == expected and last.HasField("final") and last.final.completion_tokens == 40
    assert 1 <= len(chunks) <= 2
    assert wall_s < 2.5, f"the end waited for the stream interval ({wall_s:.2f} s)"


def test_concurrent_requests_equal_plain_decode(make_service, tiny_model):
    from concurrent.futures import ThreadPoolExecutor

    svc = make_service()
    client = stub(svc)
    expected = plain_decode(tiny_model, PROMPTS, 40)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda i: run_stream(client, request(f"c{i}", PROMPTS[i], 40)), range(len(PROMPTS))))
    for (tokens, _, last), exp in zip(results, expected, strict=True):
        assert last.HasField("final")
        assert tokens == exp


def test_stop_token_is_reported(make_service, tiny_model):
    svc = make_service()
    plain = plain_decode(tiny_model, PROMPTS[:1], 20)[0]
    stop_tok = plain[5]
    tokens, _, last = run_stream(stub(svc), request("s1", PROMPTS[0], 20, stop_token_ids=[stop_tok]))
    cut = plain.index(stop_tok) + 1
    assert tokens == plain[:cut]
    assert last.final.finish_reason == inference_pb2.FINISH_REASON_STOP
    assert last.final.WhichOneof("matched_stop") == "stop_token_id" and last.final.stop_token_id == stop_tok


def test_max_tokens_zero_means_context_window(make_service):
    svc = make_service(max_seq_len=40)
    tokens, _, last = run_stream(stub(svc), request("w1", PROMPTS[1], max_tokens=0))
    assert len(tokens) == 40 - len(PROMPTS[1]) == last.final.completion_tokens


@pytest.mark.parametrize(("req", "code", "needle"), [
    (request("", [1, 2]), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    (request("x", []), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (inference_pb2.GenerateRequest(request_id="x"), grpc.StatusCode.INVALID_ARGUMENT, "exactly one"),
    (request("x", [1, 500]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    (inference_pb2.GenerateRequest(request_id="x", prompt_text="hello"), grpc.StatusCode.INVALID_ARGUMENT,
     "tokenizer"),
    (request("x", [1, 2], temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (request("x", [1, 2], max_tokens=1000), grpc.StatusCode.INVALID_ARGUMENT, "context"),
])
def test_invalid_requests(make_service, req, code, needle):
    svc = make_service()
    err = rpc_error(lambda: run_stream(stub(svc), req))
    assert err.code() == code
    assert needle in err.details()


def test_context_length_error_code_in_trailers(make_service):
    svc = make_service()
    err = rpc_error(lambda: run_stream(stub(svc), request("x", [1, 2], max_tokens=1000)))
    assert ("tide-error-code", "ERROR_CODE_CONTEXT_LENGTH_EXCEEDED") in tuple(err.trailing_metadata())


def test_duplicate_id_and_overload(make_service):
    svc = make_service(max_batch=1, max_queue=1)
    client = stub(svc)
    first = client.Generate(request("dup", PROMPTS[0], max_tokens=200), timeout=60)
    assert next(first).HasField("chunk")  # running
    err = rpc_error(lambda: run_stream(client, request("dup", PROMPTS[1])))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    queued = client.Generate(request("q", PROMPTS[1], max_tokens=5), timeout=60)  # waits for the slot
    from inference.service.svc import wait_for
    wait_for(lambda: svc.worker.status().waiting_requests == 1, what="queued request")
    err = rpc_error(lambda: run_stream(client, request("over", PROMPTS[2])))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    client.Cancel(inference_pb2.CancelRequest(request_id="dup"))
    assert list(first)[-1].final.finish_reason == inference_pb2.FINISH_REASON_CANCELLED
    assert list(queued)[-1].final.completion_tokens == 5


def test_seeded_sampling_is_reproducible(make_service):
    svc = make_service()
    client = stub(svc)

    def sample(rid: str, seed: int) -> list[int]:
        req = request(rid, PROMPTS[2], 30, temperature=1.0)
        req.sampling.seed = seed
        req.sampling.top_p = 0.9
        tokens, _, last = run_stream(client, req)
        assert last.final.completion_tokens == 30
        return tokens

    a, b, c = sample("s-a", 7), sample("s-b", 7), sample("s-c", 8)
    assert a == b and a != c

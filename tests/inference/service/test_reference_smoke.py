"""Smoke test on the reference model (bf16): text prompt through gRPC, lossless greedy, stop strings."""

from __future__ import annotations

import pytest
from inference.service.svc import request, run_stream, stub

from services.inference.app import build
from services.inference.settings import InferenceSettings
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.sequence import SamplingParams
from tide.proto.tide.v1 import inference_pb2

PROMPT = "Question: what are the three primary colors? Answer:"


@pytest.fixture(scope="module")
def ref_tokenizer(ref_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ref_target.path)


@pytest.mark.slow
def test_reference_model_generate(ref_model_bf16, ref_tokenizer, real_storage):
    prompt_ids = ref_tokenizer(PROMPT)["input_ids"]
    plain = LLMEngine(ref_model_bf16, EngineConfig(max_batch=2, max_seq_len=512), tokenizer=ref_tokenizer).generate(
        [prompt_ids], SamplingParams(max_tokens=32, ignore_eos=True), speculative=False)[0].output_ids
    settings = InferenceSettings(target="ref", max_batch=2, max_seq_len=512, listen="127.0.0.1:0", metrics_port=0,
                                 worker_id="ref-smoke", storage=real_storage, collection=True)
    svc = build(settings, model=ref_model_bf16, tokenizer=ref_tokenizer, model_id="SmolLM2-135M-Instruct")
    try:
        client = stub(svc)
        sampling = inference_pb2.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        req = inference_pb2.GenerateRequest(request_id="ref-1", prompt_text=PROMPT, sampling=sampling)
        tokens, chunks, last = run_stream(client, req)
        assert tokens == plain  # n-gram speculation on, output identical to plain decode
        text = "".join(c.text for c in chunks)
        assert text == ref_tokenizer.decode(plain, skip_special_tokens=True)
        assert last.final.prompt_tokens == len(prompt_ids) and last.final.completion_tokens == 32
        # a stop string taken from the middle of the greedy text
        words = text.split()
        stop = words[len(words) // 2]
        req = request("ref-2", prompt_ids, 32, ignore_eos=True)
        req.sampling.stop.append(stop)
        _, chunks, last = run_stream(client, req)
        assert last.final.finish_reason == inference_pb2.FINISH_REASON_STOP
        assert last.final.stop_string == stop
        assert "".join(c.text for c in chunks) == text[:text.index(stop)]
    finally:
        svc.stop(grace_s=1)

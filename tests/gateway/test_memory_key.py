"""What the gateway tells workers of a request for their speculation memory: a hash of its API key
(never the key) and whether the client asked not to be kept (`store: false`, a no-train key)."""

from __future__ import annotations

from services.gateway.engine_client import GenerationRequest, SamplingOptions, to_proto
from services.gateway.governance import Eligibility, key_id


def test_the_key_id_is_a_stable_hash_that_does_not_contain_the_key():
    assert key_id("sk-secret-one") == key_id("sk-secret-one") != key_id("sk-secret-two")
    assert len(key_id("sk-secret-one")) == 16 and "secret" not in key_id("sk-secret-one")


def test_key_id_and_no_memory_reach_the_proto():
    req = GenerationRequest("r-0", [1, 2, 3], SamplingOptions(max_tokens=4), key_id=key_id("k"), no_memory=True)
    msg = to_proto(req)
    assert msg.key_id == key_id("k") and msg.no_memory
    plain = to_proto(GenerationRequest("r-1", [1], SamplingOptions(max_tokens=4)))
    assert plain.key_id == "" and not plain.no_memory


def test_only_privacy_opt_outs_keep_a_request_out_of_the_memory():
    assert not Eligibility(False, "store_false").may_remember
    assert not Eligibility(False, "api_key_policy").may_remember
    assert Eligibility(True).may_remember and Eligibility(False, "logprobs").may_remember
    assert Eligibility(False, "stack_off").may_remember

"""The prefix cache: a prompt that starts like an earlier request's reuses that request's KV entries,
and its output is bit for bit what a fresh engine gives (tokens and logprobs), plain or speculative.

The bookkeeping (which slot, how many tokens) is tested without a model; exactness on the reference
model in bf16 (prompts split-invariant on the kernels: reuse at any token, generated tokens
included), int8 (prompt tokens only where prompts take bf16 copies of the projections, every token where they
share the int8 ones) and on a float32 target
(reuse in whole prefill chunks).
"""

from __future__ import annotations

import pytest
import torch
from support.engine import tiny_eagle3_drafter

from tide.engine.drafters import NgramDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.llama import LlamaModel
from tide.engine.prefix_cache import Admission, PrefixCache, common_prefix
from tide.engine.scheduler import Scheduler
from tide.engine.sequence import FinishReason, SamplingParams, Sequence
from tide.policies import FixedGamma


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix([5], [1]) == 0
    a = list(range(1000))
    for k in (0, 1, 499, 998, 999):
        b = a[:k] + [-1] + a[k + 1:]
        assert common_prefix(a, b) == k


def test_a_prompt_takes_the_slot_holding_its_longest_prefix():
    p = PrefixCache()
    p.release(0, [1, 2, 3, 4])
    p.release(1, [1, 2, 3, 4, 5, 6, 7])
    p.release(2, [9, 9, 9])
    assert p.admit([0, 1, 2, 3], [1, 2, 3, 4, 5, 6, 8, 8], max_reuse=7) == Admission(1, 6)
    # The chosen slot's contents are gone (the new sequence overwrites them).
    assert p.held(1) == 0
    # Reuse stops at max_reuse (the last prompt token is always prefilled).
    assert p.admit([0, 2, 3], [1, 2, 3, 4], max_reuse=3) == Admission(0, 3)


def test_without_a_hit_an_empty_slot_then_the_least_recently_freed_one():
    p = PrefixCache()
    p.release(2, [1, 2])
    p.release(0, [3, 4])
    assert p.admit([0, 1, 2], [7, 7], max_reuse=1).slot == 1  # empty first
    p.release(1, [5, 6])
    assert p.admit([0, 1, 2], [7, 7], max_reuse=1).slot == 2  # then the oldest release
    assert p.admit([0, 1], [3, 4, 5], max_reuse=0) == Admission(0, 0)  # no reuse allowed: no hit


def test_aligned_reuse_is_whole_chunks():
    p = PrefixCache(align=4)
    p.release(0, list(range(10)))  # keeps 8
    assert p.held(0) == 8
    assert p.admit([0], list(range(7)) + [99], max_reuse=7) == Admission(0, 4)


def test_the_host_tier_saves_what_a_slot_loses_and_restores_it():
    p = PrefixCache(host_tokens=10)
    p.release(0, [1, 2, 3, 4, 5, 6])
    # A miss takes the slot: its six entries go to host entry 0 first.
    assert p.admit([0], [8, 8, 8], max_reuse=2) == Admission(0, 0, save_id=0, save_tokens=6)
    p.release(0, [8, 8, 8])
    # The first prompt again: restored from host into the slot, after saving the slot's three.
    assert p.admit([0], [1, 2, 3, 4, 5, 6, 7], max_reuse=6) == Admission(0, 6, restore_id=0, save_id=1,
                                                                      save_tokens=3)
    assert p.host_held == 9
    p.release(0, [1, 2, 3, 4, 5, 6, 7])
    # Saving 7 tokens: entry 0 (a prefix of them) is superseded; entry 1 (3 tokens) still fits.
    assert p.admit([0], [9, 9], max_reuse=1) == Admission(0, 0, save_id=2, save_tokens=7, evicted=(0,))
    assert p.host_held == 10
    p.release(0, [4, 4])
    # Two more: the least recently used entry (1) goes.
    assert p.admit([0], [9, 9], max_reuse=1) == Admission(0, 0, save_id=3, save_tokens=2, evicted=(1,))
    p.release(0, [9, 9])
    # A slot hit that keeps all the slot holds saves nothing; a prefix already in host is not saved twice.
    assert p.admit([0], [9, 9, 1], max_reuse=2) == Admission(0, 2)
    p.release(0, [1, 2, 3])
    assert p.admit([0], [5, 5], max_reuse=1) == Admission(0, 0)
    assert p.host_held == 9


def test_the_host_tier_never_evicts_the_entry_being_restored():
    p = PrefixCache(host_tokens=6)
    p.release(0, [1, 2, 3, 4])
    assert p.admit([0], [5], max_reuse=0).save_id == 0
    p.release(0, [7, 7, 7, 7])
    # Restoring entry 0 while the slot's four tokens need room: entry 0 stays, the save is skipped.
    assert p.admit([0], [1, 2, 3, 4, 9], max_reuse=4) == Admission(0, 4, restore_id=0)


def _seq(rid: str, tokens: list[int], **params) -> Sequence:
    return Sequence(rid, list(tokens), len(tokens), SamplingParams(**params))


def test_the_scheduler_admits_with_the_reused_prefix_cached():
    s = Scheduler(max_batch=2, max_tokens_per_step=1000, max_seq_len=1000, prefill_chunk=8, prefixes=PrefixCache())
    first = _seq("a", range(20))
    s.add(first)
    (seq, n), = s.schedule().prefill
    assert (seq.slot, n) == (0, 8)
    first.num_cached = 20
    s.finish(first, FinishReason.STOP, keep=20)
    second = _seq("b", [*range(13), 50, 51])
    logprobs = _seq("c", range(20), prompt_logprobs=1)
    s.add(second)
    s.add(logprobs)
    plan = s.schedule()
    # The hit prefills only its last 2 tokens; prompt logprobs never reuse.
    assert [(q.request_id, q.slot, q.num_reused, n) for q, n in plan.prefill] == [("b", 0, 13, 2), ("c", 1, 0, 8)]


# ---- exactness on real models ------------------------------------------------------------------

SYSTEM = [1, 9690, 198, 2683, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 4093, 198] * 12  # 180 tokens


def _ask(tail: list[int]) -> list[int]:
    return SYSTEM + tail + [2, 198, 1, 520, 9531, 198]


def _run(engine: LLMEngine, prompt: list[int], **params) -> Sequence:
    sp = SamplingParams(max_tokens=params.pop("max_tokens", 24), ignore_eos=True, logprobs=2, **params)
    return engine.generate([prompt], sp)[0]


def _same(a: Sequence, b: Sequence) -> bool:
    return a.output_ids == b.output_ids and [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]


CONFIG = EngineConfig(max_batch=4, max_seq_len=512)
NO_CACHE = EngineConfig(max_batch=4, max_seq_len=512, prefix_cache=False)


@pytest.mark.slow
def test_bf16_hits_give_a_fresh_engines_bits_turn_after_turn(ref_model_bf16):
    """A shared system prompt, then a second turn that resends the first turn and its answer: each
    reuses every cached token it shares, and tokens and logprobs equal a fresh engine's."""
    assert ref_model_bf16.split_invariant_prefill and ref_model_bf16.decode_matches_prefill
    engine = LLMEngine(ref_model_bf16, CONFIG)
    first = _run(engine, _ask([504, 3821, 2464]))
    assert first.num_reused == 0
    turn2 = first.token_ids + [2, 198, 1, 4093, 1466, 28]
    again = _run(engine, turn2)
    assert again.num_reused == len(first.token_ids) - 1  # every fed token: prompt and answer
    other = _run(engine, _ask([1789, 2306, 338, 16296]))
    assert other.num_reused == len(SYSTEM)
    for seq, prompt in ((again, turn2), (other, _ask([1789, 2306, 338, 16296]))):
        assert _same(seq, _run(LLMEngine(ref_model_bf16, NO_CACHE), prompt))


@pytest.mark.slow
def test_speculative_hits_equal_plain_decoding(ref_model_bf16):
    """Greedy speculation (n-gram and EAGLE-3 drafts, the latter catching up from the feature store
    rows the earlier request left) on a hit emits exactly what plain decoding emits without one."""
    prompt = _ask([253, 1466, 28, 253, 1466, 28])
    plain = _run(LLMEngine(ref_model_bf16, NO_CACHE), prompt, max_tokens=32)
    for drafter in (NgramDrafter(), tiny_eagle3_drafter(ref_model_bf16, max_batch=4, max_len=576)):
        engine = LLMEngine(ref_model_bf16, CONFIG, drafter=drafter, policy=FixedGamma(3))
        _run(engine, _ask([504, 3821]))
        spec = _run(engine, prompt, max_tokens=32)
        assert spec.num_reused == len(SYSTEM) and spec.verify_steps > 0
        assert _same(spec, plain)


@pytest.mark.slow
@pytest.mark.parametrize("prefill", ["float", "shared"])
def test_int8_reuses_what_its_prompt_projections_allow(ref_target, prefill):
    """Prompts on bf16 copies of the int8 projections: only prompt tokens are reusable (decoding
    wrote the answer's entries through other projections); prompts on the int8 ones themselves
    (TIDE_PREFILL_WEIGHTS=shared, auto's choice where the int8 kernel widens prompts): every fed token."""
    model = LlamaModel.load(ref_target, dtype=torch.bfloat16, weight_format="int8", prefill_weights=prefill)
    if not model.split_invariant_prefill:
        pytest.skip("int8 prompts are not split-invariant without the kernels' GEMM")
    assert model.decode_matches_prefill == (prefill == "shared")
    engine = LLMEngine(model, CONFIG)
    first = _run(engine, _ask([504, 3821, 2464]))
    turn2 = first.token_ids + [2, 198, 1, 4093, 1466, 28]
    again = _run(engine, turn2)
    assert again.num_reused == (first.num_prompt if prefill == "float" else len(first.token_ids) - 1)
    assert _same(again, _run(LLMEngine(model, NO_CACHE), turn2))


def test_float32_reuses_whole_prefill_chunks(tiny_model):
    """Where prompt chunks' entries depend on the chunk's shape (torch's GEMMs and SDPA), only whole
    chunks a fresh prefill would cut the same way are reused."""
    assert not tiny_model.split_invariant_prefill
    config = EngineConfig(max_batch=2, max_seq_len=256, prefill_chunk=8)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 96, (21,), generator=g).tolist()
    a, b = shared + [5, 6, 7], shared + [9, 9]
    engine = LLMEngine(tiny_model, config)
    _run(engine, a)
    hit = _run(engine, b)
    assert hit.num_reused == 16
    assert _same(hit, _run(LLMEngine(tiny_model, EngineConfig(max_batch=2, max_seq_len=256, prefill_chunk=8,
                                                              prefix_cache=False)), b))


def test_cancelled_and_failed_requests(tiny_model):
    """A request cancelled mid-prompt leaves what it prefilled; one that failed leaves nothing."""
    config = EngineConfig(max_batch=1, max_seq_len=256, prefill_chunk=8, max_tokens_per_step=8)
    engine = LLMEngine(tiny_model, config)
    prompt = list(range(3, 40))
    engine.add_request("cut", prompt, SamplingParams(max_tokens=4))
    engine.step()
    engine.step()  # two chunks of 8 in the cache
    assert engine.cancel("cut")
    hit = engine.add_request("next", prompt, SamplingParams(max_tokens=4))
    engine.step()
    assert hit.num_reused == 16
    engine._finish(hit, FinishReason.ERROR)
    again = engine.add_request("again", prompt, SamplingParams(max_tokens=4))
    engine.step()
    assert again.num_reused == 0


@pytest.mark.slow
def test_bf16_prefixes_evicted_to_host_memory_come_back_exact(ref_model_bf16):
    """One slot: each request evicts the last one's entries to host memory; a prompt that starts
    like an evicted one gets them copied back (with the EAGLE-3 drafter's feature rows) and decodes
    the bits a fresh engine decodes, speculating or not."""
    config = EngineConfig(max_batch=1, max_seq_len=512, prefix_cache_host_mb=64)
    drafter = tiny_eagle3_drafter(ref_model_bf16, max_batch=1, max_len=576)
    engine = LLMEngine(ref_model_bf16, config, drafter=drafter, policy=FixedGamma(2))
    first = _run(engine, _ask([504, 3821, 2464]))
    _run(engine, [1, 4093, 198] * 20)
    turn2 = first.token_ids + [2, 198, 1, 4093, 1466, 28]
    again = _run(engine, turn2)
    assert again.num_reused == len(first.token_ids) - 1 and again.verify_steps > 0
    assert engine.scheduler.prefixes.host_held > 0
    assert _same(again, _run(LLMEngine(ref_model_bf16, NO_CACHE), turn2))

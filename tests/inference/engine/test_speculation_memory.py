"""Speculation memory: the suffix index finds what a scan of the documents finds, stays within its
byte budget, costs a bounded amount of work per query, keeps scopes apart, and the hybrid drafter
proposing from it stays lossless (greedy chains and trees; sampling is in test_lossless_sampling.py
and test_coupled_sampling.py)."""

from __future__ import annotations

import random
import tracemalloc
from collections import Counter

import pytest
from support.engine import tiny_eagle3_drafter

from tide.engine.drafters.hybrid import HybridDrafter
from tide.engine.drafters.memory import SpeculationMemory, SuffixIndex, bucket
from tide.engine.engine import REMEMBER_QUEUE, EngineConfig, LLMEngine
from tide.engine.sequence import SamplingParams
from tide.policies import FixedGamma, FixedTree


def _scan(docs: list[list[int]], context: list[int], anchor: int, max_match: int):
    """The definition: the longest suffix of `context` (anchor..max_match tokens) that occurs in a
    document with a token after it, and the counts of the tokens that follow its occurrences."""
    for n in range(min(max_match, len(context)), anchor - 1, -1):
        tail = context[-n:]
        nxt = Counter(d[e] for d in docs for e in range(n, len(d)) if d[e - n : e] == tail)
        if nxt:
            return n, nxt
    return 0, Counter()


@pytest.mark.parametrize("vocab", [3, 8, 50])
def test_query_finds_the_longest_match_and_its_continuation_counts(vocab):
    rng = random.Random(vocab)
    index = SuffixIndex(anchors=(2, 5))
    docs: list[list[int]] = []
    found = 0
    for _ in range(30):
        doc = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        docs.append(doc)
        index.add(doc)
        for _ in range(5):
            context = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
            if docs and rng.random() < 0.5:  # a context ending inside a document: a long match
                d = rng.choice(docs)
                context += d[: rng.randint(0, len(d))]
            n, nxt = _scan(docs, context, 2, 12)
            got = index.query(context, depth=3, max_match=12, max_candidates=10_000)
            assert got.match == n
            if n:
                found += 1
                first = {got.tokens[i]: got.counts[i] for i in range(1, len(got.tokens)) if got.parents[i] == 0}
                assert first == dict(nxt)
                assert got.support == sum(nxt.values())
                assert got.chain(1) == [max(nxt, key=lambda t: nxt[t])] or nxt[got.chain(1)[0]] == max(nxt.values())
    assert found > 20


def test_chain_and_tree_follow_the_most_frequent_continuations():
    index = SuffixIndex(anchors=(2,))
    for doc in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7, 8], [9, 2, 3, 4, 5]):
        index.add(doc)
    got = index.query([0, 1, 2, 3], depth=3)
    assert (got.match, got.support) == (3, 3)  # [1, 2, 3] thrice; [9, 2, 3] matches 2 only
    assert got.chain(3) == [4, 5] or got.chain(3) == [4, 6]
    assert got.chain(3, min_share=0.5) == [4]  # 5 and 6 each followed one of three
    tokens, parents = got.tree(depth=2, max_nodes=3)
    assert tokens[0] == 3 and parents[0] == -1
    assert sorted(tokens[1:]) == [4, 5, 7] or sorted(tokens[1:]) == [4, 6, 7]
    assert all(0 <= p < i for i, p in enumerate(parents) if i)


def test_no_match_or_continuation_crosses_a_document_boundary():
    index = SuffixIndex(anchors=(2,))
    index.add([1, 2])
    index.add([3, 4, 5])
    assert index.query([1, 2], depth=3).match == 0  # [1, 2] ends its document: nothing follows
    assert index.query([2, 3, 4], depth=3).match == 2  # [3, 4] only, not [2, 3, 4] across the boundary


def test_the_budget_holds_and_the_oldest_documents_go_first():
    rng = random.Random(0)
    memory = SpeculationMemory(budget_bytes=200_000, prompt_tokens=8)
    first = [rng.randrange(1000) for _ in range(50)]
    memory.add("", [], first)
    for _ in range(300):
        memory.add("", [rng.randrange(1000) for _ in range(20)], [rng.randrange(1000) for _ in range(60)])
        assert memory.nbytes <= memory.budget_bytes
    assert memory.evicted > 0 and memory.query("", first[:10], 3).match == 0  # the first is gone
    assert memory.nbytes == sum(ix.nbytes for ix in memory._scopes.values())


def test_forget_drops_a_requests_and_a_keys_documents_and_refuses_them_later():
    rng = random.Random(3)
    doc = lambda: [rng.randrange(1000) for _ in range(40)]  # noqa: E731
    x, y, z = doc(), doc(), doc()
    memory = SpeculationMemory(budget_bytes=1 << 20, prompt_tokens=0)
    assert memory.add("", [], x, key_id="alice", request_id="chatcmpl-x-0")
    assert memory.add("", [], y, key_id="alice", request_id="chatcmpl-y-0")
    assert memory.add("bob", [], z, key_id="bob", request_id="chatcmpl-z-0")
    assert memory.query("", x[:20], 8).match == 20
    with pytest.raises(ValueError):
        memory.forget()
    assert memory.forget(request_id="chatcmpl-x") == 1  # the response id names each of its choices
    assert memory.query("", x[:20], 8).match == 0 and memory.query("", y[:20], 8).match == 20
    fresh = SpeculationMemory(budget_bytes=1 << 20, prompt_tokens=0)
    fresh.add("", [], y)
    fresh.add("bob", [], z)
    assert memory.nbytes == fresh.nbytes and memory.tokens == fresh.tokens  # nothing of x is left
    assert not memory.add("", [], x, key_id="alice", request_id="chatcmpl-x-1")  # a choice that ends later
    assert memory.forget(key_id="bob") == 1 and memory.scopes() == [""]
    assert not memory.add("bob", [], z, key_id="bob")
    assert memory.forget(key_id="nobody") == 0 and memory.forgotten == 2
    for _ in range(400):  # the budget and the eviction order hold after a rebuild
        memory.add("", [], doc(), key_id="carol", request_id=f"r{rng.random()}")
        assert memory.nbytes <= memory.budget_bytes
    assert memory.evicted > 0 and memory.query("", y[:20], 8).match == 0  # y was the oldest
    assert len(memory._order) == sum(len(ix) for ix in memory._scopes.values()) == len(memory._owners)


def test_the_byte_estimate_bounds_what_python_allocates():
    rng = random.Random(1)
    docs = [[rng.randrange(30_000) for _ in range(200)] for _ in range(100)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = SuffixIndex()
    for d in docs:
        index.add(d)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert used <= index.nbytes <= 2 * used


def test_a_query_examines_at_most_max_candidates_whatever_the_memory_holds():
    """The cost bound: slice compares per query grow with the candidates kept, not the tokens stored."""
    calls = []
    for docs in (10, 400):
        index = SuffixIndex(anchors=(4,))
        for _ in range(docs):
            index.add([1, 2, 3, 4, 5, 6, 7, 8])  # every document repeats the anchor
        n = 0
        orig = index._match_len

        def counting(*a, orig=orig):
            nonlocal n
            n += 1
            return orig(*a)

        index._match_len = counting
        got = index.query([0, 1, 2, 3, 4], depth=4, max_candidates=16, max_nodes=8)
        calls.append(n)
        assert got.match == 4 and got.support == min(docs, 16) and len(got.tokens) <= 8 * 4 + 1
    assert calls == [10, 16]


def test_bucket():
    assert [bucket(n) for n in (0, 4, 7, 8, 15, 16, 31, 32)] == [0, 4, 4, 8, 8, 16, 16, 32]


# ---- in the engine -----------------------------------------------------------------------------


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 96) for _ in range(12 + i)] for i in range(n)]


PARAMS = SamplingParams(max_tokens=32, ignore_eos=True)


def _hybrid(model, seed: int) -> HybridDrafter:
    return HybridDrafter(tiny_eagle3_drafter(model, seed=seed), min_match=2)


@pytest.mark.parametrize("policy", ["chain", "tree"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_equals_plain_when_the_memory_proposes(tiny_model, batch, policy):
    prompts = _prompts(batch, batch)
    config = EngineConfig(max_batch=8, max_seq_len=256)
    plain = [s.output_ids for s in LLMEngine(tiny_model, config).generate(prompts, PARAMS)]
    drafter = _hybrid(tiny_model, batch)
    spec = LLMEngine(
        tiny_model,
        EngineConfig(max_batch=8, max_seq_len=256, speculation_memory_mb=1),
        drafter=drafter,
        policy=FixedGamma(4) if policy == "chain" else FixedTree(4, 2, 6),
    )
    assert [s.output_ids for s in spec.generate(prompts, PARAMS)] == plain
    assert drafter.recalled == 0  # nothing remembered yet
    again = spec.generate(prompts, PARAMS)  # the same prompts again: recalled from the memory
    assert [s.output_ids for s in again] == plain
    assert drafter.recalled > 0
    assert sum(s.accepted_tokens for s in again) > sum(s.verify_steps for s in again)  # > 1 accepted a step


def test_memory_off_is_todays_hybrid(tiny_model):
    drafter = _hybrid(tiny_model, 0)
    engine = LLMEngine(tiny_model, EngineConfig(max_batch=8, max_seq_len=256), drafter=drafter, policy=FixedGamma(3))
    assert engine.memory is None
    engine.generate(_prompts(0, 2), PARAMS)
    engine.generate(_prompts(0, 2), PARAMS)
    assert drafter.recalled == 0


def _memory_engine(model, seed: int) -> LLMEngine:
    """An engine with a 1 MiB memory and the hybrid drafter at γ = 3."""
    return LLMEngine(model, EngineConfig(max_batch=8, max_seq_len=256, speculation_memory_mb=1),
                     drafter=_hybrid(model, seed), policy=FixedGamma(3))


def _run(engine: LLMEngine, prompt: list[int], scope: str, remember: bool = True) -> list[str]:
    """One request in `scope`; the sources it drafted from, step by step."""
    sources: list[str] = []
    engine.step_listeners.append(lambda r: sources.extend(r.sources))
    seq = engine.add_request(f"r{engine._step}-{scope}", prompt, PARAMS, memory_scope=scope, remember=remember)
    while not seq.status.is_finished():
        engine.step()
    engine.step_listeners.clear()
    return sources


def test_one_scopes_outputs_never_feed_another_scopes_proposals(tiny_model):
    engine = _memory_engine(tiny_model, 1)
    prompt = _prompts(5, 1)[0]
    assert "memory" not in _run(engine, prompt, "key-a")
    assert "memory" not in _run(engine, prompt, "key-b")  # key-a's output is not key-b's to recall
    assert "memory" in _run(engine, prompt, "key-a")  # but key-a's own is
    assert engine.memory.scopes() == ["key-a", "key-b"]


def test_a_forgotten_key_is_never_recalled_again(tiny_model):
    engine = _memory_engine(tiny_model, 1)
    prompt = _prompts(8, 1)[0]
    plain = LLMEngine(tiny_model, EngineConfig(max_batch=8, max_seq_len=256)).generate([prompt], PARAMS)[0].output_ids
    seq = engine.add_request("chatcmpl-a-0", prompt, PARAMS, key_id="alice")
    while not seq.status.is_finished():
        engine.step()
    assert engine.forget(key_id="alice") == 1 and engine.memory.tokens == 0
    assert "memory" not in _run(engine, prompt, "")  # what alice's request said is gone
    seq = engine.add_request("chatcmpl-b-0", prompt, PARAMS, key_id="alice")  # and refused from now on
    while not seq.status.is_finished():
        engine.step()
    assert seq.output_ids == plain and engine.memory.added == 2  # the anonymous run's document only


def test_a_request_that_opts_out_is_not_remembered(tiny_model):
    engine = _memory_engine(tiny_model, 2)
    prompt = _prompts(6, 1)[0]
    _run(engine, prompt, "", remember=False)
    assert engine.memory.added == 0
    assert "memory" not in _run(engine, prompt, "")


def test_the_memory_survives_a_drafter_swap(tiny_model):
    engine = _memory_engine(tiny_model, 3)
    prompt = _prompts(7, 1)[0]
    _run(engine, prompt, "")
    engine.swap_drafter(_hybrid(tiny_model, 4))  # a new draft version: the memory stays the engine's
    assert "memory" in _run(engine, prompt, "")


class _Deep:
    """A policy that asks every request for 32 drafts, whatever the engine's caps say."""

    name = "deep"

    def decide(self, ctx):
        return [32] * len(ctx.requests)

    def observe(self, feedback):
        return None


def test_a_recall_drafts_past_max_gamma_and_stays_lossless(tiny_model):
    prompts = _prompts(7, 2)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = [s.output_ids for s in LLMEngine(tiny_model, EngineConfig(max_batch=8, max_seq_len=256))
             .generate(prompts, params)]
    engine = LLMEngine(tiny_model, EngineConfig(max_batch=8, max_seq_len=256, max_gamma=4, speculation_memory_mb=1,
                                                max_recall_gamma=24),
                       drafter=_hybrid(tiny_model, 7), policy=_Deep())
    steps: list[tuple[int, str]] = []
    engine.step_listeners.append(lambda r: steps.extend(zip(r.gammas, r.sources, strict=False)))
    assert [s.output_ids for s in engine.generate(prompts, params)] == plain
    assert [s.output_ids for s in engine.generate(prompts, params)] == plain  # recalled the second time
    assert max(g for g, s in steps if s == "memory") > 4  # deeper than the draft's cap
    assert max(g for g, s in steps if s == "memory") <= 24
    assert max(g for g, s in steps if s != "memory") <= 4  # copies and the draft keep max_gamma


def test_what_another_engine_served_is_recalled_here_losslessly(tiny_model):
    """The fleet's path (services/inference/fleet_memory.py): engine A's memory listener hands what it
    added to engine B's `remember`; B recalls it in its next request, within the scope, and its
    greedy output stays the target's own."""
    def spec(seed: int) -> LLMEngine:
        return LLMEngine(tiny_model, EngineConfig(max_batch=8, max_seq_len=256, speculation_memory_mb=1),
                         drafter=_hybrid(tiny_model, seed), policy=FixedGamma(4))

    a, b = spec(3), spec(4)
    published: list[tuple[str, list[int], list[int]]] = []
    a.memory_listeners.append(lambda *entry: published.append(entry))
    prompt = _prompts(7, 1)[0]
    plain = LLMEngine(tiny_model, EngineConfig(max_batch=8, max_seq_len=256)).generate([prompt], PARAMS)[0].output_ids
    _run(a, prompt, "key-a")
    _run(a, prompt, "key-b", remember=False)  # opted out: never reaches a listener
    assert [(s, len(p), o, k) for s, p, o, k, _ in published] == [("key-a", len(prompt), plain, "")]
    for entry in published:
        assert b.remember(*entry)
    assert b.memory.added == 0  # queued: the memory changes between steps only
    assert "memory" not in _run(b, prompt, "key-b")  # another scope's
    assert b.memory.added == 2 and b.memory.scopes() == ["key-a", "key-b"]  # A's, then B's own
    seq = b.add_request("again", prompt, PARAMS, memory_scope="key-a")
    sources = []
    b.step_listeners.append(lambda r: sources.extend(r.sources))
    while not seq.status.is_finished():
        b.step()
    assert "memory" in sources and seq.output_ids == plain
    off = LLMEngine(tiny_model, EngineConfig(max_batch=8, max_seq_len=256))
    assert not off.remember("key-a", prompt, plain)  # no memory: nothing queued
    for _ in range(REMEMBER_QUEUE + 10):  # an idle engine never steps: its queue keeps the newest only
        b.remember("key-c", prompt, plain)
    assert len(b._remembered) == REMEMBER_QUEUE

"""Greedy decoding with draft trees emits exactly the tokens plain decoding emits.

Covered: several tree shapes at batch 1 and 8, fp32 and bf16; a scripted tree drafter whose
accepted paths run through any child (first, middle, last) and that is sometimes wrong, and the
tiny (random) EAGLE-3 draft growing real EAGLE-2 trees; trees, chains and plain steps mixed
request by request; the draft's own cache after tree steps; hot swaps between tree and chain
drafters; captured hidden states of exactly the accepted tokens.
"""

from __future__ import annotations

import pytest
import torch
from support.engine import ScriptedTreeDrafter, repetitive_prompts, tiny_eagle3_drafter

from tide.engine.drafters import NgramDrafter
from tide.engine.engine import EngineConfig, LLMEngine
from tide.engine.features import FeatureStore
from tide.engine.llama import LlamaModel
from tide.engine.sequence import SamplingParams
from tide.engine.tree import DraftTree
from tide.policies import FixedTree, TreeShape

VOCAB = 96
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
SHAPES = [(1, 2, 2), (3, 2, 4), (4, 3, 8), (5, 4, 16)]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    return repetitive_prompts(n, VOCAB, seed)  # the n-gram drafter finds copies in them


def _engine(model, drafter=None, policy=None, max_batch=8) -> LLMEngine:
    return LLMEngine(model, EngineConfig(max_batch=max_batch, max_seq_len=256, max_tokens_per_step=64),
                     drafter=drafter, policy=policy)


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def model(request, tiny_model, tiny_target):
    return tiny_model if request.param == "fp32" else LlamaModel.load(tiny_target, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def prompts():
    return _prompts(8)


@pytest.fixture(scope="module")
def plain(model, prompts):
    return [s.output_ids for s in _engine(model).generate(prompts, GREEDY)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "d{}k{}n{}".format(*s))
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("drafter_kind", ["scripted", "eagle3"])
def test_tree_decoding_equals_plain(model, prompts, plain, shape, batch, drafter_kind):
    prompts, expected = prompts[:batch], plain[:batch]
    if drafter_kind == "scripted":
        drafter = ScriptedTreeDrafter({f"gen-0-{i}": o for i, o in enumerate(expected)}, VOCAB, corrupt_every=3)
    else:
        drafter = tiny_eagle3_drafter(model, seed=shape[0])
    seqs = _engine(model, drafter, FixedTree(*shape)).generate(prompts, GREEDY)
    assert [s.output_ids for s in seqs] == expected
    drafted = sum(s.draft_tokens for s in seqs)
    accepted = sum(s.accepted_tokens for s in seqs)
    assert drafted > 0, "no tree was verified: the test would prove nothing"
    if drafter_kind == "scripted":
        assert 0 < accepted < drafted
        assert sum(s.verify_steps for s in seqs) < sum(len(o) for o in expected)


class _Mixed:
    """A tree for some requests, a chain or nothing for others, changing step by step."""

    name = "mixed"

    def __init__(self) -> None:
        self.i = 0
        self.menu = [TreeShape(3, 2, 5), 2, 0, TreeShape(4, 3, 9), 1, TreeShape(2, 4, 6)]

    def decide(self, ctx):
        self.i += 1
        return [self.menu[(self.i + j) % len(self.menu)] for j in range(len(ctx.requests))]

    def observe(self, feedback) -> None: ...


@pytest.mark.parametrize("drafter_kind", ["scripted", "eagle3"])
def test_trees_chains_and_plain_rows_in_one_batch(model, prompts, plain, drafter_kind):
    if drafter_kind == "scripted":
        drafter = ScriptedTreeDrafter({f"gen-0-{i}": o for i, o in enumerate(plain)}, VOCAB, corrupt_every=4)
    else:
        drafter = tiny_eagle3_drafter(model, seed=11)
    seqs = _engine(model, drafter, _Mixed()).generate(prompts, GREEDY)
    assert [s.output_ids for s in seqs] == plain
    gammas = {g for s in seqs for g, _ in s.recent}
    assert 0 in gammas and len(gammas) > 2


def test_a_chain_drafter_gets_chains_of_the_tree_depth(model, prompts, plain):
    """The n-gram drafter grows no trees: a tree action drafts a chain of the tree's depth."""
    seqs = _engine(model, NgramDrafter(), FixedTree(3, 4, 10)).generate(prompts, GREEDY)
    assert [s.output_ids for s in seqs] == plain
    assert max(g for s in seqs for g, _ in s.recent) == 3
    assert 0 < sum(s.draft_tokens for s in seqs) <= 3 * sum(s.verify_steps for s in seqs)  # chains, not 10 nodes


def test_hot_swap_between_tree_and_chain_drafters(model, prompts, plain):
    engine = _engine(model, tiny_eagle3_drafter(model, seed=1), FixedTree(4, 3, 8))
    seqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    for _ in range(5):
        engine.step()
    assert any(s.num_output > 0 for s in seqs) and not all(s.status.is_finished() for s in seqs)
    engine.swap_drafter(NgramDrafter())  # tree actions become chains
    for _ in range(3):
        engine.step()
    engine.swap_drafter(tiny_eagle3_drafter(model, seed=2))  # rebuilds its cache from the feature store
    for _ in range(3):
        engine.step()
    engine.swap_drafter(ScriptedTreeDrafter({f"r{i}": o for i, o in enumerate(plain)}, VOCAB, corrupt_every=3))
    engine.set_policy(FixedTree(5, 2, 7))
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in seqs] == plain


def _captured(engine: LLMEngine) -> dict[str, list]:
    rows: dict[str, list] = {}
    engine.capture_listeners.append(lambda batch: [rows.setdefault(r.request_id, []).append(r) for r in batch])
    return rows


def test_captured_states_are_exactly_the_accepted_tokens(model, prompts):
    """Hidden-state capture after tree steps hands out the accepted tokens' rows only, in the chunk
    format of chains, and bitwise the rows plain decoding captures for the same tokens."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    tree_engine = _engine(model, tiny_eagle3_drafter(model, seed=3), FixedTree(4, 3, 10), max_batch=2)
    plain_engine = _engine(model, None, None, max_batch=2)
    tree_rows, plain_rows = _captured(tree_engine), _captured(plain_engine)
    seqs = tree_engine.generate(prompts[:2], params)
    plain_engine.generate(prompts[:2], params)
    assert sum(s.draft_tokens for s in seqs) > 0
    for s in seqs:
        rows, ref = tree_rows[s.request_id], plain_rows[s.request_id]
        assert [r.start for r in rows] == [sum(len(x.token_ids) for x in rows[:j]) for j in range(len(rows))]
        tokens = [t for r in rows for t in r.token_ids]
        assert tokens == s.token_ids[:-1] == [t for r in ref for t in r.token_ids]
        assert torch.equal(torch.cat([r.aux for r in rows]), torch.cat([r.aux for r in ref]))
        assert torch.equal(torch.cat([r.final for r in rows]), torch.cat([r.final for r in ref]))


def test_tree_draft_cache_matches_a_chain_drafters_cache(model):
    """The EAGLE-3 drafter's cache after proposing a tree and then extending the accepted path is
    bitwise the cache of a drafter that proposed a chain over the same tokens."""
    from tide.engine.sequence import Sequence

    tree_d, chain_d = tiny_eagle3_drafter(model, seed=5), tiny_eagle3_drafter(model, seed=5)
    H3 = 3 * model.cfg.hidden_size
    store = FeatureStore(8, 320, H3, model.dtype, model.device)
    g = torch.Generator().manual_seed(0)
    store.rows[0, :40] = torch.randn((40, H3), generator=g).to(model.dtype)
    tokens = torch.randint(3, VOCAB, (41,), generator=g).tolist()

    def seq_at(n: int) -> Sequence:
        s = Sequence("r", tokens[:n + 1], 5, SamplingParams())
        s.slot, s.num_cached = 0, n
        return s

    for d in (tree_d, chain_d):
        d.add_sequence(seq_at(10))
    trees = tree_d.propose_tree([seq_at(10)], [TreeShape(4, 3, 12)], store, [None])
    assert isinstance(trees[0], DraftTree) and trees[0].size == 12 and trees[0].depth <= 4
    chain_d.propose([seq_at(10)], [3], store, [None])
    for n in (13, 17):  # accepted paths of 3 and 4 tokens
        tree_d.propose_tree([seq_at(n)], [TreeShape(3, 2, 5)], store, [None])
        chain_d.propose([seq_at(n)], [1], store, [None])
    # rows [0, 17) are committed in both
    assert torch.equal(tree_d.k[0, :, :17], chain_d.k[0, :, :17])
    assert torch.equal(tree_d.v[0, :, :17], chain_d.v[0, :, :17])


def test_eagle3_trees_are_the_best_nodes_and_ancestor_closed(model):
    """propose_tree keeps the N best nodes by cumulative draft log-probability, parents first."""
    from tide.engine.sequence import Sequence

    drafter = tiny_eagle3_drafter(model, seed=4)
    H3 = 3 * model.cfg.hidden_size
    store = FeatureStore(8, 320, H3, model.dtype, model.device)
    store.rows[:, :20] = torch.randn((8, 20, H3), generator=torch.Generator().manual_seed(1)).to(model.dtype)
    seqs = []
    for i in range(3):
        s = Sequence(f"r{i}", list(range(3 + i, 24 + i)), 5, SamplingParams())
        s.slot, s.num_cached = i, 20
        drafter.add_sequence(s)
        seqs.append(s)
    shapes = [TreeShape(3, 2, 5), TreeShape(3, 2, 6), TreeShape(4, 3, 12)]
    trees = drafter.propose_tree(seqs, shapes, store, [None] * 3)
    for s, shape, tree in zip(seqs, shapes, trees, strict=True):
        assert tree.tokens[0] == s.token_ids[-1]
        assert tree.size == shape.tokens and tree.depth <= shape.depth
        assert len(tree.children[0]) <= shape.topk and all(len(c) <= shape.topk for c in tree.children)


def test_logprobs_on_the_tree_path_are_plain_decodings(model, prompts, plain):
    """Logprobs are supported on trees: the target's raw distribution at each emitted token's row,
    bitwise what plain decoding reports."""
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=3)
    ref = _engine(model).generate(prompts[:3], params)
    drafter = ScriptedTreeDrafter({f"gen-0-{i}": o for i, o in enumerate(plain)}, VOCAB, corrupt_every=3)
    seqs = _engine(model, drafter, FixedTree(4, 3, 9)).generate(prompts[:3], params)
    assert sum(s.accepted_tokens for s in seqs) > 0
    assert [s.output_ids for s in seqs] == [s.output_ids for s in ref]
    assert [s.logprobs for s in seqs] == [s.logprobs for s in ref]


def test_requests_with_penalties_draft_chains_under_a_tree_policy(model, prompts):
    """Penalties and logit bias depend on the drafts before a row: such requests get chains of the
    tree's depth, their neighbours trees, and every output stays plain decoding's."""
    params = [SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=1.0),
              SamplingParams(max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=24, ignore_eos=True, logit_bias=((7, 2.0),))]
    ref = _engine(model).generate(prompts[:3], params)
    seqs = _engine(model, tiny_eagle3_drafter(model, seed=9), FixedTree(3, 3, 7)).generate(prompts[:3], params)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in ref]
    penalized, free, biased = seqs
    for s in (penalized, biased):
        assert 0 < s.draft_tokens <= 3 * s.verify_steps  # chains of at most 3
    assert free.draft_tokens > 3 * free.verify_steps  # trees of 7 nodes

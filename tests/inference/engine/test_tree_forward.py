"""Tree verification forwards (ModelRunner.run_tree / keep_paths): every node's row is bitwise the
row plain decoding computes after that node's path, and the kept path's cache rows are bitwise the
ones plain decoding writes."""

from __future__ import annotations

import pytest
import torch

from tide.engine.llama import LlamaModel
from tide.engine.model_runner import ModelRunner
from tide.engine.sequence import SamplingParams, Sequence
from tide.engine.tree import DraftTree

# root 50; depth 1: 11, 12, 13; depth 2: under 11: 21, 22; under 13: 23; depth 3: under 22: 31;
# depth 4: under 31: 41
TREE = DraftTree(tokens=(50, 11, 12, 13, 21, 22, 23, 31, 41), parents=(-1, 0, 0, 0, 1, 1, 3, 5, 7))


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def model(request, tiny_model, tiny_target):
    return tiny_model if request.param == "fp32" else LlamaModel.load(tiny_target, dtype=torch.bfloat16)


def _seq(prompt: list[int], slot: int) -> Sequence:
    s = Sequence(f"s{slot}", list(prompt), len(prompt), SamplingParams())
    s.slot = slot
    return s


def _prefill(runner: ModelRunner, seq: Sequence) -> None:
    """Cache all prompt tokens but the last (the pending one), as the engine leaves a sequence."""
    runner.run([seq], [seq.token_ids[:-1]], [0], [len(seq.token_ids) - 2], False)
    seq.num_cached = len(seq.token_ids) - 1


def _plain_rows(model, prompt: list[int], tokens: list[int]):
    """(logits, aux) plain decoding computes feeding `tokens` one at a time after `prompt`."""
    runner = ModelRunner(model, 1, 128, 16)
    seq = _seq(prompt + tokens[:1], 0)
    _prefill(runner, seq)
    logits, aux = [], []
    for j, tok in enumerate(tokens):
        out = runner.run([seq], [[tok]], [seq.num_cached], [0], True)
        logits.append(out.logits[0])
        aux.append(out.aux[0, 0])
        seq.num_cached += 1
        seq.token_ids.append(tokens[j + 1] if j + 1 < len(tokens) else 0)
    return torch.stack(logits), torch.stack(aux), runner


@pytest.mark.parametrize("batch", [1, 3])
def test_every_tree_row_equals_plain_decoding_of_its_path(model, batch):
    prompts = [[5, 6, 7, 8, 9, 10, 50], [3, 4, 50], list(range(3, 60)) + [50]][:batch]
    trees = [TREE, DraftTree.chain(50, [11, 21]), DraftTree((50, 12, 13), (-1, 0, 0))][:batch]
    runner = ModelRunner(model, 4, 128, 32)
    seqs = [_seq(p, i) for i, p in enumerate(prompts)]
    for s in seqs:
        _prefill(runner, s)
    out = runner.run_tree(seqs, trees, capture=True)
    for i, (prompt, tree) in enumerate(zip(prompts, trees, strict=True)):
        rows = out.logits[out.row_offsets[i]:out.row_offsets[i + 1]]
        assert rows.shape[0] == len(tree.tokens)
        for node in range(len(tree.tokens)):
            path_tokens = [tree.tokens[n] for n in tree.path(node)]
            plain_logits, plain_aux, _ = _plain_rows(model, prompt[:-1], path_tokens)
            assert torch.equal(rows[node], plain_logits[-1]), f"sequence {i} node {node}"
            assert torch.equal(out.aux[i, node], plain_aux[-1])


def test_kept_path_is_the_cache_plain_decoding_writes(model):
    prompt = [5, 6, 7, 8, 9, 10, 50]
    runner = ModelRunner(model, 2, 128, 32)
    seq = _seq(prompt, 1)
    _prefill(runner, seq)
    runner.run_tree([seq], [TREE], capture=False)
    path = TREE.path(8)  # the deepest: 50, 11, 22, 31, 41
    runner.keep_paths([path])
    tokens = [TREE.tokens[n] for n in path]
    _, _, plain = _plain_rows(model, prompt[:-1], tokens)
    n = seq.num_cached + len(path)
    for layer in range(model.cfg.num_layers):
        assert torch.equal(runner.cache.k[layer][1, :, :n], plain.cache.k[layer][0, :, :n])
        assert torch.equal(runner.cache.v[layer][1, :, :n], plain.cache.v[layer][0, :, :n])


def test_draft_tree_structure():
    assert TREE.depths == (0, 1, 1, 1, 2, 2, 2, 3, 4)
    assert TREE.children[0] == (1, 2, 3) and TREE.children[1] == (4, 5)
    assert TREE.path(8) == [0, 1, 5, 7, 8]
    assert TREE.child_with(1, 22) == 5 and TREE.child_with(1, 23) is None
    assert DraftTree.chain(9, [1, 2]).parents == (-1, 0, 1)
    with pytest.raises(ValueError):
        DraftTree((1, 2, 2), (-1, 0, 0))  # siblings with one token
    with pytest.raises(ValueError):
        DraftTree((1, 2, 3), (-1, 2, 0))  # a parent after its child

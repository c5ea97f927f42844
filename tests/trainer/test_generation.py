"""Generation helpers of bootstrap and draft eval: prompt grouping by length, the deadline cut."""

from __future__ import annotations

import itertools
import random

import torch

from tools.draft.generation import length_sorted_groups


def test_groups_hold_every_prompt_once_sorted_by_length_within_windows():
    rng = random.Random(0)
    items = [(f"p{i}", [0] * rng.randint(1, 500)) for i in range(103)]
    groups = list(length_sorted_groups(items, group=4, window=5))
    flat = [key for g in groups for key, _ in g]
    assert sorted(flat) == sorted(key for key, _ in items) and len(flat) == len(items)
    assert all(len(g) == 4 for g in groups[:-1])
    for w in range(0, len(items), 20):  # a window's prompts come before the next window's (shuffled order kept)
        window = {key for key, _ in items[w:w + 20]}
        assert set(flat[w:w + 20]) == window
        lengths = [len(ids) for g in groups[w // 4:(w + 20) // 4] for _, ids in g]
        assert lengths == sorted(lengths)
    assert list(length_sorted_groups(items, 4, 5)) == groups  # deterministic: a resumed run regroups alike



def test_a_cut_ends_every_running_sequence_with_its_greedy_prefix_captured(tmp_path):
    """The bootstrap's generation deadline: a cut cancels the running sequences, frees their slots
    and still yields their groups; each cut sequence's rows are a prefix of what an uncut run
    generates for the same prompt, and the groups not yet joined never start."""
    from tests.support.bootstrap import save_tiny_chat_target
    from tide.chunks import decode_chunk
    from tide.engine.llama import LlamaModel
    from tools.draft.generation import capturing_engine, generate_groups

    target = save_tiny_chat_target(tmp_path / "t", layers=4, init_std=0.05)
    model = LlamaModel.load(target, dtype=torch.float32)
    rng = random.Random(1)
    groups = [[(f"g{g}p{i}", [rng.randrange(3, 100) for _ in range(rng.randint(3, 9))]) for i in range(3)]
              for g in range(4)]

    prompts = {key: ids for g in groups for key, ids in g}

    def run(cut_at_step: int | None) -> tuple[list[str], dict[str, list[int]]]:
        """(keys of the groups yielded, {prompt key: token ids of its rows (prompt + generated)})"""
        engine, sink = capturing_engine(model, target.model_id, batch=4, max_prompt_tokens=16, max_tokens=24,
                                        chunk_tokens=4096)
        asked = itertools.count()
        cut = (lambda: next(asked) >= cut_at_step) if cut_at_step is not None else (lambda: False)
        keys, rows = [], {}
        for res in generate_groups(engine, sink, iter(groups), 24, cut=cut):
            keys += res.keys
            for _, blob in res.chunks:
                chunk = decode_chunk(blob)
                for a, b in chunk.segments():  # a sequence cut before its prefill has no rows
                    ids = chunk.input_ids[a:b].tolist()
                    key, = (k for k, p in prompts.items() if ids[:len(p)] == p)
                    rows[key] = ids
        assert not engine.has_work()  # every slot given back
        return keys, rows

    (all_keys, whole), (cut_keys, cut) = run(None), run(5)
    assert all_keys == list(prompts) and set(whole) == set(prompts)
    assert 0 < len(cut_keys) < len(prompts) and len(cut_keys) % 3 == 0  # whole groups, those joined before the cut
    assert set(cut) <= set(cut_keys) and cut
    assert sum(map(len, cut.values())) < sum(len(whole[k]) for k in cut)
    for key, ids in cut.items():
        assert ids == whole[key][:len(ids)]

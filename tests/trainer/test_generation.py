"""Generation helpers of bootstrap and draft eval: prompt grouping by length."""

from __future__ import annotations

import random

from services.trainer.generation import length_sorted_groups


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

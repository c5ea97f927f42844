"""Tree actions: TreeShape, FixedTree, and the latency profile's tree costs (torch-free policies)."""

from __future__ import annotations

import pytest

from tide.policies import FixedTree, GammaPolicy, RequestView, StepContext, TreeShape, action_depth
from tide.policies.profile import LatencyProfile


def _ctx(b: int, max_gamma: int = 8) -> StepContext:
    return StepContext(batch_size=b, requests=tuple(RequestView(f"r{i}") for i in range(b)), max_gamma=max_gamma)


def test_tree_shape_validates_and_names_itself():
    shape = TreeShape(5, 4, 16)
    assert shape.key() == "d5k4n16" and shape.drafted == 4 + 4 * 16
    assert TreeShape(3, 1, 3).drafted == 3  # a chain
    for bad in ((0, 2, 2), (2, 0, 2), (2, 2, 0)):
        with pytest.raises(ValueError):
            TreeShape(*bad)


def test_fixed_tree_is_a_policy_and_respects_the_depth_cap():
    policy = FixedTree(6, 4, 16)
    assert isinstance(policy, GammaPolicy)
    assert policy.decide(_ctx(3)) == [TreeShape(6, 4, 16)] * 3
    assert policy.decide(_ctx(2, max_gamma=4)) == [TreeShape(4, 4, 16)] * 2
    assert policy.decide(_ctx(1, max_gamma=0)) == [0]
    assert [action_depth(a) for a in (0, 3, TreeShape(5, 2, 7))] == [0, 3, 5]


def test_profile_prices_trees_from_its_tree_table_or_from_t():
    t = {1: {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0, 16: 14.0}, 4: {1: 20.0, 2: 22.0, 4: 26.0, 8: 34.0, 16: 50.0}}
    d = {1: 1.0, 4: 1.5, 16: 3.0}
    prof = LatencyProfile(T_ms=t, D0_ms=1.0, D_ms=d)
    assert prof.tree_target_ms(1, 7) == pytest.approx(prof.target_ms(1, 8))
    # depth 4, top-k 4 at batch 1: the extend (level 1, D(1)), then 3 draft levels of 4 rows each
    assert prof.tree_step_ms(1, 4, 4, 7) == pytest.approx(12.0 + 1.0 + 3 * 1.5)
    # a chain is the tree of top-k 1: the same price as step_ms
    assert prof.tree_step_ms(1, 3, 1, 3) == pytest.approx(prof.step_ms(1, 3))
    with_trees = LatencyProfile(T_ms=t, D0_ms=1.0, D_ms=d, tree_ms={1: {4: 11.5, 16: 15.0}, 4: {4: 27.0, 16: 52.0}})
    assert with_trees.tree_target_ms(1, 16) == pytest.approx(15.0)
    back = LatencyProfile.from_json(with_trees.to_json())
    assert back.tree_ms == with_trees.tree_ms and back.tree_target_ms(4, 4) == pytest.approx(27.0)

"""vLLM's static num_speculative_tokens_per_batch_size table."""

import pytest

from tide.policies.base import RequestView, StepContext
from tide.policies.profile import synthetic_profile
from tide.policies.tide_model import practical_speedup
from tide.policies.vllm_table import VllmBatchTablePolicy, table_from_profile

DOC_TABLE = [[1, 64, 3], [65, 128, 1], [129, 512, 0]]  # the vLLM docs' example


@pytest.mark.parametrize(("b", "k"), [(1, 3), (64, 3), (65, 1), (128, 1), (129, 0), (512, 0), (600, 0)])
def test_lookup_follows_the_ranges(b, k):
    pol = VllmBatchTablePolicy(DOC_TABLE, num_speculative_tokens=3)
    assert pol.k_for(b) == k


def test_decide_is_uniform_and_capped():
    pol = VllmBatchTablePolicy(DOC_TABLE, num_speculative_tokens=3)
    reqs = tuple(RequestView(f"r{i}") for i in range(4))
    assert pol.decide(StepContext(4, reqs, max_gamma=2)) == [2, 2, 2, 2]


def test_bad_tables_are_refused():
    with pytest.raises(ValueError):
        VllmBatchTablePolicy([[1, 8, 9]], num_speculative_tokens=8)
    with pytest.raises(ValueError):
        VllmBatchTablePolicy([[8, 1, 2]])
    with pytest.raises(ValueError):
        VllmBatchTablePolicy(None, profile=None)


def test_table_from_profile_is_the_eq5_argmax_and_shrinks_with_batch():
    prof = synthetic_profile()
    table = table_from_profile(prof, tuned_alpha=0.6, max_gamma=8, max_batch=64)
    assert table[0][0] == 1 and table[-1][1] == 64
    ks = [k for _, _, k in table]
    assert ks == sorted(ks, reverse=True) and ks[0] >= 3 and ks[-1] <= 1
    pol = VllmBatchTablePolicy(profile=prof, max_batch=64)
    for b in (1, 16, 48):
        best = max(range(9), key=lambda g: practical_speedup(prof, 0.6, g, b))
        assert pol.k_for(b) == best

"""benchmarks/speculation_memory.py --timed: the three modes decode the same greedy tokens, and the
ratios are taken against the default."""

from benchmarks.speculation_memory import timed
from tide.policies.profile import LatencyProfile


def test_timed_rows_decode_the_same_tokens_and_rank_against_the_default(ref_model_bf16):
    # A flat profile (a verified row nearly free, a draft step cheap): the policy speculates.
    profile = LatencyProfile(T_ms={1: {1: 10.0, 9: 11.0}, 2: {1: 10.0, 9: 12.0}}, D0_ms=1.0)
    # The same request twice: the second is recalled from the memory of the first.
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3629, 2, 198, 1, 4093, 198]
    for batch in (1, 2):
        row = timed(ref_model_bf16, [prompt, prompt], batch, 12, 4, 1, profile)
        assert set(row) == {"plain", "default", "default+memory"}
        assert row["default"]["x_default"] == 1.0
        assert all(r["tok_s"] > 0 and len(r["runs"]) == 1 for r in row.values())
        assert len({r["output_tokens"] for r in row.values()}) == 1, row

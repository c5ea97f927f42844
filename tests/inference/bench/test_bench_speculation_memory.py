"""benchmarks/speculation_memory.py --timed: the three modes decode the same greedy tokens, only the
memory's run recalls, and the ratios are taken against the default; a fleet sharing its memory (the
counts of --fleet) recalls across its workers."""

from benchmarks.speculation_memory import STARTER, decode, timed
from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.drafters.hybrid import HybridDrafter
from tide.policies import FixedGamma


def test_timed_rows_decode_the_same_tokens_and_rank_against_the_default(ref_model_bf16):
    # A fixed γ: the adaptive policy's choices follow the measured step times, so whether it drafts
    # in a 12-token request is timing (the benchmark's own runs use it).
    # The same request three times: at 2 streams the third starts after the first two finished, and
    # is recalled from the memory of them (at 1 stream the second already is).
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3629, 2, 198, 1, 4093, 198]
    for batch in (1, 2):
        row = timed(ref_model_bf16, [prompt] * 3, batch, 12, 4, 1, None, policy=lambda: FixedGamma(3))
        assert set(row) == {"plain", "default", "default+memory"}
        assert row["default"]["x_default"] == 1.0
        assert all(r["tok_s"] > 0 and len(r["runs"]) == 1 for r in row.values())
        assert len({r["output_tokens"] for r in row.values()}) == 1, row
        assert row["default+memory"]["recalled_steps"] > 0 and row["default"]["recalled_steps"] == 0, row


def test_a_fleet_that_shares_its_memory_recalls_what_private_memories_cannot(ref_model_bf16):
    # Two workers taking requests in turn: the same request four times reaches each worker twice, so
    # with private memories each recalls from its own first copy only; shared, the second request
    # already recalls the first (served by the other worker).
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3629, 2, 198, 1, 4093, 198]
    starter = lambda: HybridDrafter(Eagle3Drafter.from_checkpoint(STARTER, ref_model_bf16, "s", 1, 2048 + 16))  # noqa: E731
    own = decode(ref_model_bf16, starter(), [prompt] * 4, 3, 16, 4, (starter(),), share=False)
    shared = decode(ref_model_bf16, starter(), [prompt] * 4, 3, 16, 4, (starter(),), share=True)
    one = decode(ref_model_bf16, starter(), [prompt] * 4, 3, 16, 4)
    assert own["output_tokens"] == shared["output_tokens"] == one["output_tokens"]
    memory = lambda r: r["by_source"].get("memory", {}).get("steps", 0)  # noqa: E731
    assert 0 < memory(own) < memory(shared) == memory(one)

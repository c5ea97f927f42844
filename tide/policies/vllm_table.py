"""vLLM's static per-batch-size γ table (vLLM "Dynamic Speculative Decoding" config).

vLLM's speculative config takes ``num_speculative_tokens_per_batch_size``: a list of
``[start_bs, end_bs, K]`` entries, "when the concurrency is within [start_bs, end_bs], K draft
tokens are used" (K = 0 disables drafting), each K ≤ ``num_speculative_tokens``. The table is
static: chosen offline by the operator, never updated from acceptance. We accept that exact
shape. Batch sizes outside every range use the nearest range (vLLM leaves this to the config).

When no table is given, `table_from_profile` builds the one an operator would tune offline:
per batch size, the K maximising seed 000 Eq. 5 at an assumed acceptance `tuned_alpha`
(0.6 by default: the mid-range of BRIEF §5's per-domain numbers, α ≈ 0.45 chat … 0.75 code),
with adjacent equal K merged into ranges.
"""

from __future__ import annotations

import bisect

from tide.policies.base import StepContext, StepFeedback
from tide.policies.profile import LatencyProfile
from tide.policies.tide_model import practical_speedup


def table_from_profile(
    profile: LatencyProfile, tuned_alpha: float = 0.6, max_gamma: int = 8, max_batch: int = 256
) -> list[list[int]]:
    """Offline-tuned [[start_bs, end_bs, K], ...] from the profile's Eq. 5 speedups at one α."""
    table: list[list[int]] = []
    for b in range(1, max_batch + 1):
        k = max(range(max_gamma + 1), key=lambda g: practical_speedup(profile, tuned_alpha, g, b))
        if table and table[-1][2] == k:
            table[-1][1] = b
        else:
            table.append([b, b, k])
    return table


class VllmBatchTablePolicy:
    """Static K per batch-size range; ignores acceptance entirely."""

    def __init__(
        self,
        num_speculative_tokens_per_batch_size: list[list[int]] | None = None,
        profile: LatencyProfile | None = None,
        num_speculative_tokens: int = 8,
        tuned_alpha: float = 0.6,
        max_batch: int = 256,
    ) -> None:
        table = num_speculative_tokens_per_batch_size
        if table is None:
            if profile is None:
                raise ValueError("vllm policy needs num_speculative_tokens_per_batch_size or a profile")
            table = table_from_profile(profile, tuned_alpha, num_speculative_tokens, max_batch)
        rows = sorted((int(s), int(e), int(k)) for s, e, k in table)
        for s, e, k in rows:
            if s > e or k < 0 or k > num_speculative_tokens:
                raise ValueError(f"bad table row {[s, e, k]} (K must be in [0, {num_speculative_tokens}])")
        self.name = "vllm"
        self.table = [list(r) for r in rows]
        self._starts = [r[0] for r in rows]

    def k_for(self, b: int) -> int:
        i = max(bisect.bisect_right(self._starts, b) - 1, 0)
        s, e, k = self.table[i]
        if b > e and i + 1 < len(self.table) and self.table[i + 1][0] - b < b - e:
            k = self.table[i + 1][2]
        return k

    def decide(self, ctx: StepContext) -> list[int]:
        return [min(self.k_for(ctx.batch_size), ctx.max_gamma)] * len(ctx.requests)

    def observe(self, feedback: StepFeedback) -> None:
        return None

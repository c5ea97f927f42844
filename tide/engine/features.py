"""Per-slot store of the target's EAGLE-3 auxiliary states for every cached token.

Kept only while a feature-consuming drafter (EAGLE-3) serves. A drafter reads the rows it has not
consumed yet — one per step normally, many after speculation was off for a while (catch-up) or
after a hot-swap (a new draft rebuilds its cache from the whole context).
Size: slots x max_len x 3H elements (16 x 2048 x 1728 bf16 = 113 MB for the reference model).
"""

from __future__ import annotations

import torch

from tide.allocator import zeros_on_demand


class FeatureStore:
    def __init__(self, num_slots: int, max_len: int, width: int, dtype: torch.dtype, device) -> None:
        self.rows = zeros_on_demand((num_slots, max_len, width), dtype, device)  # held as written

    def write(self, slot: int, start: int, aux: torch.Tensor) -> None:
        self.rows[slot, start:start + aux.shape[0]] = aux

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        return self.rows[slot, start:end]

"""The KV cache sized from a memory budget: how many slots, how long a context.

The engine's per-slot memory is contiguous and allocated at start (tide.engine.llama.KVCache, one
slot per decoding sequence), so slots × context decide it. On CPU the process holds its pages only
as they are written (tide.allocator.zeros_on_demand): the budget bounds what every slot full takes.
`plan` picks them so that everything allocated per slot and token row fits a byte budget:

- the target's K and V: layers × kv heads × head dim × 2 (K and V) × the cache's element bytes
  (tide.engine.llama.kv_cache_dtype: bf16 for a bf16 model on the CPU kernels, else float32 on
  CPU; the model dtype elsewhere);
- the EAGLE-3 draft's one-layer K and V (the same heads and head dim as the target's: a draft is
  shaped like one target layer, tide.eagle3.config.Eagle3Config.for_target; float32 where its step
  runs on tide.kernels, counted as float32 everywhere on CPU) and the target features it reads,
  3 × hidden × model dtype bytes (tide.engine.features.FeatureStore). Both are counted whichever
  drafter the worker starts with: a decision can switch it to EAGLE-3 at any time, and its caches
  are then allocated for every slot.

Every slot has rows past its context (prefill / verify slack, rounded up to the decode attention's
key block; the draft's tree scratch): `SlotCost.slot_bytes` counts those too, so the budget is what
the tensors take, not an estimate.

Slots and context (`plan`): each is the operator's value when given, else derived —
- the context: min(DEFAULT_CONTEXT, the model's), reduced (in CONTEXT_STEP multiples) only when one
  slot of it does not fit the budget (with explicit slots: when those slots of it do not fit);
- the slots: DEFAULT_SLOTS, fewer when that many do not fit (the context is kept: a request needs
  its context, concurrency can wait in the queue).
The budget is a ceiling: unset values never grow past the defaults, so a large budget (the default
one is a share of free memory) does not take memory the rest of the stack could use. When both are
given and do not fit, or what is left is less than a slot of MIN_CONTEXT tokens, `plan` raises
KVBudgetError naming the numbers (the worker refuses to start): an operator who set them wants
those, not silently fewer, and never more memory than the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from tide.engine.llama import kv_cache_dtype
from tide.layers import pad_keys

DEFAULT_SLOTS = 16  # the engine's default max_batch
DEFAULT_CONTEXT = 2048  # the engine's default max_seq_len
# Derived contexts are multiples of the decode attention's key block (tide.layers.GROUPED_KEY_BLOCK):
# the cache's rows are padded to it anyway.
CONTEXT_STEP = 64
# Below this a derived context is refused: a chat prompt with its template hardly fits.
MIN_CONTEXT = 256
# The default budget: this share of the memory available when the worker starts, after the
# weights are loaded. Not more: on one machine `tide up` also runs the trainer (which loads the
# target and trains a draft), the gateway, Redis and MinIO, and the worker itself needs room beyond
# the cache (the prefix cache's host tier, TIDE_PREFIX_CACHE_HOST_MB = 512 MiB by default; activations;
# the chunk exporter's buffers; a draft being loaded beside the one in service). Half of what is free
# still holds the reference model's default 16 × 2048 cache (about 1.9 GiB) many times over.
BUDGET_FRACTION = 0.5
TREE_SCRATCH_ROWS = 128  # tide.engine.drafters.eagle3.TREE_SCRATCH (its draft cache's extra rows)


class KVBudgetError(ValueError):
    """The asked-for slots and context do not fit the KV-cache budget."""


@dataclass(frozen=True)
class SlotCost:
    """Bytes a KV slot takes per token row, by part, and the rows it has beyond its context."""

    target: int  # the target's K and V
    features: int  # EAGLE-3 target features (0: not counted)
    draft: int  # the EAGLE-3 draft's K and V (0: not counted)
    extra_rows: int  # rows past the context: the most tokens one step feeds a sequence, + 1
    draft_extra_rows: int = TREE_SCRATCH_ROWS

    @property
    def per_token(self) -> int:
        return self.target + self.features + self.draft

    def slot_bytes(self, context: int) -> int:
        """What one slot of `context` tokens takes, as the caches are allocated (padding included)."""
        rows = pad_keys(context + self.extra_rows)  # ModelRunner's cache length
        return rows * (self.target + self.features) + (rows + self.draft_extra_rows if self.draft else 0) * self.draft


def slot_cost(num_layers: int, num_kv_heads: int, head_dim: int, hidden_size: int, *, model_dtype_bytes: int,
              cache_dtype_bytes: int, extra_rows: int, drafting: bool = True) -> SlotCost:
    """A slot's cost for a target of these dimensions. `drafting`: count the EAGLE-3 draft's cache
    and features (see the module docstring)."""
    kv = num_kv_heads * head_dim * 2 * cache_dtype_bytes  # one layer's K and V for one token
    return SlotCost(target=num_layers * kv, features=3 * hidden_size * model_dtype_bytes if drafting else 0,
                    draft=kv if drafting else 0, extra_rows=extra_rows)


def _mib(n: int | float) -> str:
    return f"{n / 2**20:.0f} MiB"


@dataclass(frozen=True)
class KVPlan:
    slots: int
    context: int  # tokens per slot: prompt + output (the engine's max_seq_len)
    bytes: int  # what the slots take: slots × SlotCost.slot_bytes(context)
    budget_bytes: int
    budget_source: str  # where the budget came from, for the start log

    def describe(self) -> str:
        return (f"KV cache: {_mib(self.bytes)}, {self.slots} slots × {self.context} tokens "
                f"(budget {_mib(self.budget_bytes)}: {self.budget_source})")


def _largest_context(cost: SlotCost, slots: int, budget: int, cap: int) -> int:
    """The longest context <= cap, `cap` or a CONTEXT_STEP multiple, of which `slots` slots fit; 0: none."""
    if slots * cost.slot_bytes(cap) <= budget:
        return cap
    lo, hi = 0, (cap - 1) // CONTEXT_STEP  # k * CONTEXT_STEP < cap; k = lo always fits (0 = nothing)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if slots * cost.slot_bytes(mid * CONTEXT_STEP) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * CONTEXT_STEP


def plan(cost: SlotCost, budget_bytes: int, model_context: int, *, slots: int | None = None,
         context: int | None = None, budget_source: str = "") -> KVPlan:
    """Slots and context for `budget_bytes` (see the module docstring); `slots` / `context`: the
    operator's values, None = derive. Raises KVBudgetError when they cannot fit."""
    if context is not None and context > model_context:
        raise KVBudgetError(f"TIDE_MAX_SEQ_LEN={context} exceeds the model's context {model_context}")
    where = f"the {_mib(budget_bytes)} KV-cache budget ({budget_source or 'TIDE_KV_CACHE_MB'})"
    per = f"{cost.per_token} bytes a token per slot"

    def result(s: int, c: int) -> KVPlan:
        return KVPlan(s, c, s * cost.slot_bytes(c), budget_bytes, budget_source)

    if slots is not None and context is not None:
        need = slots * cost.slot_bytes(context)
        if need > budget_bytes:
            raise KVBudgetError(
                f"TIDE_MAX_BATCH={slots} slots × TIDE_MAX_SEQ_LEN={context} tokens need {_mib(need)} of KV cache "
                f"({per}), more than {where}: raise TIDE_KV_CACHE_MB, or lower or unset one of them "
                f"(an unset one is derived to fit)")
        return result(slots, context)
    if slots is None and context is not None:
        fit = budget_bytes // cost.slot_bytes(context)
        if fit < 1:
            raise KVBudgetError(
                f"one slot of TIDE_MAX_SEQ_LEN={context} tokens needs {_mib(cost.slot_bytes(context))} of KV cache "
                f"({per}), more than {where}: raise TIDE_KV_CACHE_MB or lower TIDE_MAX_SEQ_LEN")
        return result(min(DEFAULT_SLOTS, fit), context)
    cap = min(DEFAULT_CONTEXT, model_context)
    if slots is None:  # neither given: keep the context, fewer slots; one slot with less context last
        fit = budget_bytes // cost.slot_bytes(cap)
        if fit >= 1:
            return result(min(DEFAULT_SLOTS, fit), cap)
        slots_used, named = 1, "one slot"
    else:
        slots_used, named = slots, f"TIDE_MAX_BATCH={slots} slots"
    c = _largest_context(cost, slots_used, budget_bytes, cap)
    if c < min(MIN_CONTEXT, cap):
        raise KVBudgetError(
            f"{named} of {min(MIN_CONTEXT, cap)} tokens need "
            f"{_mib(slots_used * cost.slot_bytes(min(MIN_CONTEXT, cap)))} of KV cache ({per}), more than {where}: "
            f"raise TIDE_KV_CACHE_MB" + (" or lower TIDE_MAX_BATCH" if slots is not None else ""))
    return result(slots_used, c)


def default_budget(available_bytes: int, fraction: float = BUDGET_FRACTION) -> int:
    """The budget when none is set: `fraction` of the memory available (bytes)."""
    return int(available_bytes * fraction)


def model_slot_cost(model, max_new_per_step: int, drafting: bool = True) -> SlotCost:
    """`slot_cost` of a loaded LlamaModel; `max_new_per_step`: EngineConfig.max_new_per_step."""
    cfg = model.cfg
    cache_bytes = kv_cache_dtype(model.dtype, model.device, cfg.head_dim).itemsize
    return slot_cost(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                     model_dtype_bytes=model.dtype.itemsize, cache_dtype_bytes=cache_bytes,
                     extra_rows=max_new_per_step + 1, drafting=drafting)

"""Continuous batching: which sequences prefill and which decode in the next step (torch-free).

Every step decodes (drafts + verifies) all RUNNING sequences, then spends what is left of the
per-step token budget on prefill chunks of sequences that hold a KV slot, admitting WAITING
sequences into free slots in arrival order. Requests join and leave between steps. With a prefix
cache (tide.engine.prefix_cache) a sequence is admitted to the free slot that still holds the
longest start of its prompt, and prefills only the rest.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field

from tide.engine.prefix_cache import Admission, PrefixCache
from tide.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    moves: list[Admission] = field(default_factory=list)  # prefix-cache copies to make first, in order

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, max_batch: int, max_tokens_per_step: int, max_seq_len: int, prefill_chunk: int = 256,
                 prefixes: PrefixCache | None = None) -> None:
        if max_batch < 1 or max_tokens_per_step < 1 or prefill_chunk < 1:
            raise ValueError("max_batch, max_tokens_per_step and prefill_chunk must be >= 1")
        self.max_batch = max_batch
        self.max_tokens_per_step = max_tokens_per_step
        # Prompts are cut at fixed multiples of prefill_chunk whatever the load, so a prompt's
        # KV cache (and so its output) never depends on which other requests shared the step.
        self.prefill_chunk = prefill_chunk
        self.max_seq_len = max_seq_len
        self.waiting: deque[Sequence] = deque()
        self.active: dict[str, Sequence] = {}  # holds a slot: PREFILLING or RUNNING
        self._free_slots = list(range(max_batch))
        self.prefixes = prefixes  # None: no reuse, a sequence takes the lowest free slot

    def __len__(self) -> int:
        return len(self.waiting) + len(self.active)

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.active or any(s.request_id == seq.request_id for s in self.waiting):
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        if seq.num_prompt >= self.max_seq_len:
            raise ValueError(f"prompt of {seq.num_prompt} tokens does not fit the context of {self.max_seq_len}")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def get(self, request_id: str) -> Sequence | None:
        seq = self.active.get(request_id)
        if seq is None:
            seq = next((s for s in self.waiting if s.request_id == request_id), None)
        return seq

    def finish(self, seq: Sequence, reason: FinishReason, keep: int = 0) -> None:
        """Mark finished and free the slot at once (also used for cancellation). With a prefix
        cache the slot keeps the entries of the sequence's first `keep` tokens for reuse."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if self.active.pop(seq.request_id, None) is not None:
            if self.prefixes is not None:
                self.prefixes.release(seq.slot, seq.token_ids[:min(keep, seq.num_cached)])
            self._free_slots.append(seq.slot)
            self._free_slots.sort()
        else:
            with contextlib.suppress(ValueError):  # already gone: finishing twice is a no-op
                self.waiting.remove(seq)
        seq.slot = -1

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        running = [s for s in self.active.values() if s.status is SequenceStatus.RUNNING]
        plan.decode = sorted(running, key=lambda s: s.slot)
        # Prefill always gets at least a quarter of the budget, so a full decode batch cannot
        # starve newly admitted requests.
        budget = max(self.max_tokens_per_step - len(plan.decode), self.max_tokens_per_step // 4)
        while self.waiting and self._free_slots:
            seq = self.waiting.popleft()
            if self.prefixes is None:
                seq.slot = self._free_slots.pop(0)
            else:
                # Keep the last prompt token to prefill (its logits give the first output token);
                # prompt logprobs need every prompt row's logits.
                max_reuse = 0 if seq.params.prompt_logprobs is not None else seq.num_prompt - 1
                admission = self.prefixes.admit(self._free_slots, seq.token_ids, max_reuse)
                seq.slot, seq.num_reused = admission.slot, admission.reuse
                seq.num_cached = seq.num_reused
                self._free_slots.remove(seq.slot)
                if admission.moves:
                    plan.moves.append(admission)
            seq.status = SequenceStatus.PREFILLING
            self.active[seq.request_id] = seq
        prefilling = sorted(
            (s for s in self.active.values() if s.status is SequenceStatus.PREFILLING), key=lambda s: s.arrival_s
        )
        for seq in prefilling:
            n = min(seq.remaining_prefill, self.prefill_chunk - seq.num_cached % self.prefill_chunk)
            if n > budget and (plan.prefill or plan.decode):
                break
            plan.prefill.append((seq, n))
            budget -= n
        return plan

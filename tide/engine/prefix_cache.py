"""Prefix reuse across requests: a prompt that starts like an earlier request's takes that request's
KV entries instead of prefilling them again (torch-free bookkeeping; the scheduler owns it, the
engine's model runner moves the tensors).

Chat clients resend the whole conversation every turn, and many requests share a system prompt:
without reuse each turn prefills the conversation again (on a 2-core CPU ~2-3 ms a token). Two
tiers, as in llama.cpp's server (slots, then `--cache-ram`):
- **slots**: a finished sequence's slot keeps its entries until another request needs the slot; a
  new prompt goes to the free slot sharing its longest prefix. Nothing is copied: the cache's mask
  already hides entries past a sequence's own length, and prefilling overwrites them.
- **host memory** (`host_tokens` > 0): before a slot's entries are overwritten they are copied to
  host memory, least recently used evicted beyond the budget; a prompt whose longest prefix is
  there gets it copied into its slot (~23 KB a token for the reference model in bf16: a copy of a
  1,000-token conversation takes milliseconds, its prefill seconds).

Reuse is exact, never approximate: the engine says how much of a freed slot holds the entries a
fresh prefill of those tokens would compute, bit for bit (`LlamaModel.split_invariant_prefill`,
`decode_matches_prefill`), and `align` > 1 keeps reuse to whole prefill chunks where a prompt's
entries depend on where its chunks were cut. So a request's output never depends on what ran
before it, and speculative decoding stays identical to plain decoding with or without a hit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (slice comparisons run in C: O(n log n) element
    compares without a Python loop per token)."""
    hi = min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class Admission:
    """Where a new sequence goes and what must move first (the engine does it before the slot's
    next forward): free the host entries `evicted`; copy the slot's first `save_tokens` entries to
    host entry `save_id` (-1: none); copy host entry `restore_id`'s first `reuse` entries into the
    slot (-1: the slot itself holds them)."""

    slot: int
    reuse: int  # prompt tokens whose entries the sequence starts with
    restore_id: int = -1
    save_id: int = -1
    save_tokens: int = 0
    evicted: tuple[int, ...] = ()

    @property
    def moves(self) -> bool:
        return self.restore_id >= 0 or self.save_id >= 0 or bool(self.evicted)


class PrefixCache:
    """The reusable contents of the free slots (slot -> the tokens whose entries at positions
    0..n-1 it still holds) and of host memory (entry id -> tokens), least recently used first."""

    def __init__(self, align: int = 1, host_tokens: int = 0) -> None:
        if align < 1 or host_tokens < 0:
            raise ValueError("align must be >= 1 and host_tokens >= 0")
        self.align = align
        self.host_tokens = host_tokens  # budget of the host tier in tokens (0: slots only)
        self._slots: dict[int, list[int]] = {}
        self._freed: dict[int, int] = {}  # slot -> tick of its release (least recent first to evict)
        self._host: dict[int, list[int]] = {}  # in use order: least recently used first
        self._host_held = 0
        self._ticks = itertools.count()
        self._ids = itertools.count()

    def release(self, slot: int, tokens: list[int]) -> None:
        """`slot` is free again holding the entries of `tokens` (possibly none)."""
        n = len(tokens) // self.align * self.align
        if n:
            self._slots[slot] = tokens[:n]
        else:
            self._slots.pop(slot, None)
        self._freed[slot] = next(self._ticks)

    def held(self, slot: int) -> int:
        return len(self._slots.get(slot, ()))

    @property
    def host_held(self) -> int:
        """Tokens held in host memory."""
        return self._host_held

    def _match(self, held: list[int] | None, prompt: list[int], max_reuse: int) -> int:
        if not held or held[0] != prompt[0]:
            return 0
        return min(common_prefix(held, prompt), max_reuse) // self.align * self.align

    def admit(self, free: list[int], prompt: list[int], max_reuse: int) -> Admission:
        """Pick a slot from `free` for `prompt` and the entries it starts with. At most `max_reuse`
        tokens are reused (the caller keeps at least the last prompt token to prefill: its logits
        give the first output token). The chosen slot's contents are forgotten (the new sequence
        overwrites them from the reused length on); with a host tier they are saved there first."""
        slot, reuse = -1, 0
        if max_reuse > 0:
            for s in free:
                n = self._match(self._slots.get(s), prompt, max_reuse)
                if n > reuse:
                    slot, reuse = s, n
        restore_id = -1
        if max_reuse > 0 and self._host:
            best_id, best = max(((i, self._match(t, prompt, max_reuse)) for i, t in self._host.items()),
                                key=lambda x: x[1])
            if best > reuse:
                restore_id, reuse, slot = best_id, best, -1
                self._host[best_id] = self._host.pop(best_id)  # most recently used now
        if slot < 0:
            # No slot hit: an empty slot (lowest first), else the one freed longest ago.
            empty = [s for s in free if s not in self._slots]
            slot = min(empty) if empty else min(free, key=lambda s: self._freed.get(s, -1))
        held = self._slots.pop(slot, [])
        self._freed.pop(slot, None)
        kept = reuse if restore_id < 0 else 0  # of the slot's own entries, those the sequence keeps
        save_id, evicted = -1, ()
        if self.host_tokens and len(held) > kept:
            save_id, evicted = self._save(held, protect=restore_id)
        return Admission(slot, reuse, restore_id, save_id, len(held) if save_id >= 0 else 0, evicted)

    def _save(self, tokens: list[int], protect: int) -> tuple[int, tuple[int, ...]]:
        """A host entry for `tokens` unless one already covers them; the entries it evicts."""
        if len(tokens) > self.host_tokens:
            return -1, ()
        evicted = []
        for i, held in list(self._host.items()):
            if len(held) >= len(tokens) and held[:len(tokens)] == tokens:
                self._host[i] = self._host.pop(i)  # already there: now most recently used
                return -1, ()
            if len(held) < len(tokens) and tokens[:len(held)] == held and i != protect:
                evicted.append(i)  # the new entry covers it
        for i in evicted:
            self._host_held -= len(self._host.pop(i))
        for i in list(self._host):
            if self._host_held + len(tokens) <= self.host_tokens:
                break
            if i != protect:
                self._host_held -= len(self._host.pop(i))
                evicted.append(i)
        if self._host_held + len(tokens) > self.host_tokens:
            return -1, tuple(evicted)
        new = next(self._ids)
        self._host[new] = list(tokens)
        self._host_held += len(tokens)
        return new, tuple(evicted)

"""Draft trees (EAGLE-2): the typed input of tree verification, torch-free.

A sequence's tree is rooted at its pending token (the last sampled token, not yet in the target's
cache); the other nodes are draft tokens. Nodes are numbered so that a parent comes before its
children (node 0 is the root), which is also their row order in the verification forward: row j
is the target's distribution of the token after node j's path. A chain of γ drafts is the tree
whose node j's parent is j - 1; plain decoding is the root alone.

`TreeShape` (tide.policies.base) says how a drafter grows a tree: `depth` levels, the `topk`
best children of each of the `topk` best frontier nodes per level, and the best `tokens` nodes
of all that were drafted, by cumulative draft log-probability (tide.engine.drafters.eagle3).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class DraftTree:
    """tokens[0] is the root (the pending token); tokens[i] for i >= 1 a draft token (target ids)
    whose parent is node parents[i] < i (parents[0] = -1). Siblings carry distinct tokens."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens or self.parents[0] != -1:
            raise ValueError("a draft tree needs a root (parent -1) and one parent per node")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i}: parent {p} must precede it")
        seen = set()
        for i in range(1, len(self.tokens)):
            key = (self.parents[i], self.tokens[i])
            if key in seen:
                raise ValueError(f"node {i}: a sibling already carries token {self.tokens[i]}")
            seen.add(key)

    @classmethod
    def chain(cls, root: int, drafts: list[int]) -> DraftTree:
        return cls((root, *drafts), tuple(range(-1, len(drafts))))

    @property
    def size(self) -> int:
        """Draft nodes (the root excluded): the tree's N."""
        return len(self.tokens) - 1

    @cached_property
    def depths(self) -> tuple[int, ...]:
        d = [0] * len(self.tokens)
        for i in range(1, len(self.tokens)):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    @property
    def depth(self) -> int:
        return max(self.depths)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Per node, its children in node order (the order tree sampling tries them in)."""
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            kids[self.parents[i]].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Per node, the nodes from the root to it, both included (parents precede children)."""
        out: list[tuple[int, ...]] = [(0,)]
        for i in range(1, len(self.tokens)):
            out.append((*out[self.parents[i]], i))
        return tuple(out)

    def path(self, node: int) -> list[int]:
        """Nodes from the root to `node`, both included."""
        return list(self.paths[node])

    def child_with(self, node: int, token: int) -> int | None:
        for c in self.children[node]:
            if self.tokens[c] == token:
                return c
        return None

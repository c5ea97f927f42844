"""Speculation memory: a suffix index over what a worker served, shared across its requests.

Prompt lookup (ngram.py) copies from the request's own context; real traffic also repeats across
requests (the same questions from many users, one JSON template over many records, agents
re-emitting files other agents wrote). SuffixDecoding (Snowflake; vLLM's `suffix` method) keeps a
suffix tree over earlier outputs and prompts, finds the longest suffix of the request's context in
it, and proposes the continuations that followed it, scored by how often each followed.

This module answers the same query with a structure that suits Python: the documents' token ids in
one flat `array('i')` (4 bytes a token, a separator between documents) and, for a few anchor lengths
k, an inverted index from the hash of every k-gram to the positions right after it. A query takes
the context's last k tokens for the longest anchor first, verifies each recent occurrence (slice
compares in C) and extends it backwards by binary search up to `max_match` tokens: the occurrences
with the longest match are exactly the leaves under the suffix tree's node for that suffix, and
the continuation trie built from them with counts is the subtree SuffixDecoding scores. A suffix
tree in Python objects would cost a node per (position, depth); this costs ~0.2 KB a token.

Cost: a query is O(anchors + C · log(max_match) + C · depth) slice operations, C ≤ `max_candidates`
(the most recent occurrences of the anchor), independent of how many tokens the memory holds;
inserting a document is O(len · anchors) dictionary operations.

Scopes: a memory keeps one index per scope (e.g. an API key's id), so a query reads only its own
scope's documents: another scope's text can never shape its proposals (nor their timing). One byte
budget covers all scopes; the oldest document, whatever its scope, is evicted first.

Owners: each document keeps the API key id and the request id it came from, so that a deletion
request (`tidectl data forget`) reaches the memory as it reaches the stored chunks: `forget` drops
the matching documents (rebuilding the indexes of the scopes that held them, O(their tokens)) and
refuses them from then on (a request still running when it was forgotten never joins).
"""

from __future__ import annotations

from array import array
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass

from tide.chunks import request_matches

SEP = -1  # between documents: never a token id, so no match or continuation crosses it
# Bytes a stored item costs CPython, measured with tracemalloc (tests/inference/engine/
# test_speculation_memory.py checks the estimate bounds the allocation): a token 4 (array('i')),
# an indexed position 36 (a list slot + an int object), a distinct k-gram 170 (its dict entry at
# the dict's load factor, an int key and a list object with over-allocation).
TOKEN_BYTES, POSITION_BYTES, KEY_BYTES = 4, 36, 170


@dataclass(frozen=True)
class Continuations:
    """What followed the longest matched suffix: `match` tokens matched (0: none), `support` the
    occurrences with that match, and the continuation trie as parallel tuples (node 0 is the root,
    the context's last token): tokens[i], parents[i] < i, counts[i] = occurrences through node i."""

    match: int
    support: int
    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()

    def chain(self, depth: int, min_share: float = 0.0) -> list[int]:
        """The most frequent path, at most `depth` tokens, stopping where its share of the
        occurrences falls below `min_share`."""
        out: list[int] = []
        node = 0
        kids = self._children()
        while len(out) < depth and kids.get(node):
            best = kids[node][0]  # most frequent child first (ties: the most recent occurrence's)
            if self.counts[best] < min_share * self.support:
                break
            out.append(self.tokens[best])
            node = best
        return out

    def tree(self, depth: int, max_nodes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(tokens, parents) of the `max_nodes` most frequent nodes no deeper than `depth`, root
        first, parents before children (a child's count never exceeds its parent's, so the best
        N of a breadth-first order, stable, are ancestor-closed)."""
        kids = self._children()
        order: list[tuple[int, int]] = []  # (node, its depth), breadth first
        frontier = [0]
        for d in range(1, depth + 1):
            nxt = [c for n in frontier for c in kids.get(n, ())]
            order += [(c, d) for c in nxt]
            frontier = nxt
        ranked = sorted(range(len(order)), key=lambda i: -self.counts[order[i][0]])[:max_nodes]
        keep = sorted(ranked)  # back to breadth-first order: parents first
        new_id = {0: 0}
        tokens, parents = [self.tokens[0]], [-1]
        for i in keep:
            node = order[i][0]
            new_id[node] = len(tokens)
            tokens.append(self.tokens[node])
            parents.append(new_id[self.parents[node]])
        return tuple(tokens), tuple(parents)

    def _children(self) -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {}
        for i in range(1, len(self.tokens)):
            kids.setdefault(self.parents[i], []).append(i)
        for lst in kids.values():
            lst.sort(key=lambda i: -self.counts[i])  # stable: insertion order breaks ties
        return kids


NONE = Continuations(0, 0)


class SuffixIndex:
    """The documents of one scope, oldest first, and their anchor indexes (see the module doc)."""

    holds_tensors = False  # tide.memory.tensor_bytes need not walk its millions of ints

    def __init__(self, anchors: tuple[int, ...] = (4, 16)) -> None:
        self.anchors = tuple(sorted(anchors, reverse=True))  # longest first
        self._tokens = array("i")
        self._base = 0  # global position of _tokens[0] (positions only grow; eviction raises it)
        self._ends: dict[int, dict[int, list[int]]] = {k: {} for k in self.anchors}
        # (start, end, serial): global positions, end exclusive, and the memory's id of the document
        self._docs: deque[tuple[int, int, int]] = deque()
        self.positions = 0  # indexed positions, all anchors
        self.keys = 0

    @property
    def tokens(self) -> int:
        return len(self._tokens)

    @property
    def nbytes(self) -> int:
        return TOKEN_BYTES * len(self._tokens) + POSITION_BYTES * self.positions + KEY_BYTES * self.keys

    def __len__(self) -> int:
        return len(self._docs)

    def add(self, tokens: list[int], serial: int = 0) -> None:
        start = self._base + len(self._tokens)
        self._tokens.extend(tokens)
        self._tokens.append(SEP)
        end = start + len(tokens)
        self._docs.append((start, end, serial))
        for k, ends in self._ends.items():
            for e in range(start + k, end):  # e: the position after the k-gram, a token follows
                key = self._key(e, k)
                got = ends.get(key)
                if got is None:
                    ends[key] = [e]
                    self.keys += 1
                else:
                    got.append(e)
                self.positions += 1

    def evict_oldest(self) -> int:
        """Drop the oldest document; returns the bytes freed."""
        before = self.nbytes
        start, end, _ = self._docs.popleft()
        for k, ends in self._ends.items():
            drop = Counter(self._key(e, k) for e in range(start + k, end))
            for key, n in drop.items():
                lst = ends[key]
                del lst[:n]  # the oldest positions are the first ones: this document's
                if not lst:
                    del ends[key]
                    self.keys -= 1
            self.positions -= sum(drop.values())
        cut = end + 1 - self._base  # the document and its separator
        del self._tokens[:cut]
        self._base += cut
        return before - self.nbytes

    def documents(self) -> Iterator[tuple[int, list[int]]]:
        """(serial, tokens) of every document, oldest first."""
        for start, end, serial in self._docs:
            yield serial, self._tokens[start - self._base:end - self._base].tolist()

    def _key(self, e: int, k: int) -> int:
        """The hash of the k-gram ending before global position e (collisions are verified away)."""
        i = e - self._base
        return hash(tuple(self._tokens[i - k : i]))

    def query(
        self, context: list[int], depth: int, max_match: int = 32, max_candidates: int = 64, max_nodes: int = 64,
        min_match: int = 0,
    ) -> Continuations:
        """Continuations of the longest suffix of `context` (≥ the shortest anchor, ≤ `max_match`
        tokens) among the most recent `max_candidates` occurrences of its anchor, `depth` deep. A
        match shorter than `min_match` comes back as its length and support alone: building its
        continuations is most of a query's cost, and a caller that will not recall from it (the
        hybrid drafter's miss path, every step of non-repetitive traffic) does not pay it."""
        for k in self.anchors:
            if len(context) < k:
                continue
            tail = array("i", context[-max_match:])
            key = hash(tuple(tail[-k:]))
            ends = self._ends[k].get(key)
            if not ends:
                continue
            best, hits = 0, []
            for e in reversed(ends[-max_candidates:]):  # newest first: ties keep recency order
                n = self._match_len(e, tail, k)
                if n > best:
                    best, hits = n, [e]
                elif n == best and n:
                    hits.append(e)
            if best and best < min_match:
                return Continuations(best, len(hits))
            if best:
                return self._continuations(best, hits, context[-1], depth, max_nodes)
        return NONE

    def _match_len(self, e: int, tail: array, k: int) -> int:
        """How many of `tail`'s last tokens end at global position e (0 where the k-gram's hash
        collided): the longest L in [k, len(tail)] with tokens[e-L:e] == tail[-L:], by bisection."""
        i = e - self._base
        toks = self._tokens
        if toks[i - k : i] != tail[-k:]:
            return 0
        hi = min(len(tail), i)
        lo = k  # matches; find the largest matching length in (lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if toks[i - mid : i] == tail[-mid:]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _continuations(self, match: int, hits: list[int], root: int, depth: int, max_nodes: int) -> Continuations:
        toks = self._tokens
        tokens, parents, counts = [root], [-1], [len(hits)]
        child: dict[tuple[int, int], int] = {}
        for e in hits:
            i = e - self._base
            node = 0
            for t in toks[i : i + depth]:
                if t == SEP:
                    break
                nxt = child.get((node, t))
                if nxt is None:
                    if len(tokens) > max_nodes * depth:  # a bound on the work; the best survive
                        break
                    nxt = child[(node, t)] = len(tokens)
                    tokens.append(t)
                    parents.append(node)
                    counts.append(0)
                counts[nxt] += 1
                node = nxt
        return Continuations(match, len(hits), tuple(tokens), tuple(parents), tuple(counts))


class SpeculationMemory:
    """Suffix indexes per scope under one byte budget (oldest document evicted first).

    `prompt_tokens`: how many of a prompt's last tokens a document keeps before its output: enough
    for the question and the chat template's turn header, so a later request whose context ends
    the same way matches into the answer; whole long prompts (shared system prompts, files) would
    fill the budget with text that prompt lookup already copies within the request."""

    holds_tensors = False  # see SuffixIndex
    FORGOTTEN_KEPT = 4096

    def __init__(
        self, budget_bytes: int, anchors: tuple[int, ...] = (4, 16), prompt_tokens: int = 256, max_match: int = 32
    ) -> None:
        self.budget_bytes = budget_bytes
        self.anchors = anchors
        self.prompt_tokens = prompt_tokens
        self.max_match = max_match
        self.generation = 0  # bumped at every change: memoised queries are valid for one generation
        self.added = 0
        self.evicted = 0
        self.forgotten = 0  # documents dropped by `forget`
        self._scopes: dict[str, SuffixIndex] = {}
        self._order: deque[tuple[str, int]] = deque()  # (scope, serial) of every stored document, oldest first
        self._owners: dict[int, tuple[str, str]] = {}  # serial -> (API key id, request id)
        self._serial = 0
        # What `forget` was asked, so that a request finishing later is refused too: (kind, value) in
        # the order asked, the newest FORGOTTEN_KEPT kept (a request runs minutes at most; keys are
        # few); a dict, so that the check every finished request pays is a lookup, not a scan.
        self._refused: dict[tuple[str, str], None] = {}
        self._nbytes = 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def tokens(self) -> int:
        # list(): a status thread reads this while the engine thread may add a scope
        return sum(ix.tokens for ix in list(self._scopes.values()))

    def scopes(self) -> list[str]:
        return sorted(self._scopes)

    def add(self, scope: str, prompt: list[int], output: list[int], key_id: str = "", request_id: str = "") -> bool:
        """Remember one finished request: the last `prompt_tokens` of its prompt, then its output.
        `key_id` / `request_id`: its owners, for `forget`. False: not added (no output, or forgotten)."""
        if not output or self._is_refused(key_id, request_id):
            return False
        doc = prompt[-self.prompt_tokens :] + output if self.prompt_tokens else list(output)
        index = self._scopes.get(scope)
        if index is None:
            index = self._scopes[scope] = SuffixIndex(self.anchors)
        self._serial += 1
        before = index.nbytes
        index.add(doc, self._serial)
        self._nbytes += index.nbytes - before
        self._order.append((scope, self._serial))
        if key_id or request_id:
            self._owners[self._serial] = (key_id, request_id)
        self.added += 1
        self.generation += 1
        while self._nbytes > self.budget_bytes and self._order:
            oldest, serial = self._order.popleft()
            ix = self._scopes[oldest]
            self._nbytes -= ix.evict_oldest()
            self._owners.pop(serial, None)
            self.evicted += 1
            if not len(ix):
                del self._scopes[oldest]
        return True

    def forget(self, key_id: str = "", request_id: str = "") -> int:
        """Drop every document of an API key id or of a request (the gateway's response id matches
        each of its choices, as tide.chunks.request_matches says) and refuse them from now on;
        returns how many documents went. Raises ValueError unless exactly one is given."""
        if bool(key_id) == bool(request_id):
            raise ValueError("give exactly one of a key id and a request id")
        self._refused["key" if key_id else "request", key_id or request_id] = None
        while len(self._refused) > self.FORGOTTEN_KEPT:
            del self._refused[next(iter(self._refused))]
        doomed = {serial for serial, (k, r) in self._owners.items()
                  if (key_id and k == key_id) or (request_id and request_matches(r, request_id))}
        if not doomed:
            return 0
        for scope in {scope for scope, serial in self._order if serial in doomed}:
            old = self._scopes.pop(scope)
            self._nbytes -= old.nbytes
            kept = SuffixIndex(self.anchors)
            for serial, tokens in old.documents():
                if serial not in doomed:
                    kept.add(tokens, serial)
            if len(kept):
                self._scopes[scope] = kept
                self._nbytes += kept.nbytes
        self._order = deque(item for item in self._order if item[1] not in doomed)
        for serial in doomed:
            del self._owners[serial]
        self.forgotten += len(doomed)
        self.generation += 1
        return len(doomed)

    def _is_refused(self, key_id: str, request_id: str) -> bool:
        if not self._refused:
            return False
        if key_id and ("key", key_id) in self._refused:
            return True
        # a worker's request id is the client's response id, or it with "-<choice>" (request_matches)
        base, _, choice = request_id.rpartition("-")
        return bool(request_id) and (("request", request_id) in self._refused
                                     or (choice.isdigit() and ("request", base) in self._refused))

    def query(self, scope: str, context: list[int], depth: int, max_nodes: int = 64,
              min_match: int = 0) -> Continuations:
        index = self._scopes.get(scope)
        if index is None:
            return NONE
        return index.query(context, depth, self.max_match, max_nodes=max_nodes, min_match=min_match)


def bucket(match: int) -> int:
    """A match length as the γ policy keys it: 0, or the largest power of two ≤ it (4, 8, 16, 32):
    acceptance grows with the match, and a key per length would spread what the policy learns thin."""
    return 0 if match <= 0 else 1 << (match.bit_length() - 1)


__all__ = ["NONE", "SEP", "Continuations", "SpeculationMemory", "SuffixIndex", "bucket"]

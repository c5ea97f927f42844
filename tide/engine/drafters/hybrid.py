"""EAGLE-3 with prompt lookup: per sequence and step, copy where the context repeats, else draft.

Code, summaries and retrieval answers repeat their context, and a small target repeats itself:
there an n-gram copy accepts more than a one-layer draft and costs no forward. Measured on the
first starter draft (trained on GSM8K and Alpaca prompts only) at γ = 3, 16 prompts each: HumanEval
accept length 2.32 copying against 1.23 drafting, Spec-Bench 1.48 against 1.22, GSM8K test 1.89
against 2.13 (docs/results/speculation).
So each step, for each sequence, the latest earlier occurrence of its last `min_match`..`max_n`
tokens is looked up (`NgramDrafter`); where there is one, what followed it is the proposal, else
the EAGLE-3 draft's.

Lossless as either drafter alone: which one proposes is a function of the committed tokens only,
and a copied proposal is deterministic (q one-hot, `probs` None), as the n-gram drafter's.
For a constrained request a copy is cut to what the grammar allows; where nothing is left the
EAGLE-3 draft, whose steps follow the grammar, proposes.
The EAGLE-3 draft catches up on the target features of the steps it skipped the next time it
drafts for that sequence (its `lag`), as after speculation was off. Asked for a draft tree
(`propose_tree`), a copy is a branchless tree and the draft grows the others.

With a speculation memory (`tide.engine.drafters.memory`, the engine's, shared by all requests of
the worker) there is a third source, "memory": what followed the longest suffix of the request's
context in earlier requests of its scope. Per sequence and step the source is: the memory where its
match is at least `min_memory_match` (8) tokens; else the copy; else the draft. A long
cross-request match predicts more than a 1-3 token copy (the copy's match is at most `max_n` = 3):
on the repetitive workloads of docs/results/speculation-memory recalls accepted 3.5-5.7 tokens a
step at γ = 5; shorter matches (4-7 tokens, common phrases) accepted 1.25 on the non-repetitive
control, less than the copy or the draft there. A memory proposal is deterministic too (the
most frequent continuation; as a tree, the most frequent continuations), and the memory changes
only between steps (the engine adds a request when it finishes), so lossless as a copy.
"""

from __future__ import annotations

from tide.engine.drafters.base import DraftAlgorithm, Proposal
from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.drafters.memory import NONE, Continuations, SpeculationMemory, bucket
from tide.engine.drafters.ngram import NgramDrafter
from tide.engine.features import FeatureStore
from tide.engine.sequence import Sequence
from tide.engine.tree import DraftTree
from tide.policies import TreeShape

_NO_RECALL: tuple[int, int, Continuations, list[int]] = (0, 0, NONE, [])


class HybridDrafter:
    # It serves the registry's EAGLE-3 draft and needs the target's features: the controller, the
    # trainer and telemetry treat it as that draft. `copied` / `drafted` count the proposals.
    algorithm = DraftAlgorithm.EAGLE3

    def __init__(self, eagle: Eagle3Drafter, min_match: int = 1, max_n: int = 3,
                 memory: SpeculationMemory | None = None, min_memory_match: int = 8) -> None:
        self.eagle = eagle
        self.lookup = NgramDrafter(max_n=max_n, min_n=min_match)
        self.memory = memory  # the engine's (attach_memory); None: copy or draft only
        self.min_memory_match = min_memory_match
        self.copied = 0
        self.drafted = 0
        self.recalled = 0  # proposals from the memory
        # request id -> (tokens, memory generation, source, match) at that length and generation
        self._match: dict[str, tuple[int, int, str, int]] = {}
        # request id -> (tokens, memory generation, memory query, its chain the grammar allows), memoised
        self._recall: dict[str, tuple[int, int, Continuations, list[int]]] = {}

    def attach_memory(self, memory: SpeculationMemory | None) -> None:
        """The engine hands its speculation memory to the drafter it serves with (it outlives drafters)."""
        self.memory = memory
        self._match.clear()
        self._recall.clear()

    @property
    def version(self) -> str:
        return self.eagle.version

    def add_sequence(self, seq: Sequence) -> None:
        self.eagle.add_sequence(seq)
        self.lookup.add_sequence(seq)
        self._match.pop(seq.request_id, None)
        self._recall.pop(seq.request_id, None)

    def remove_sequence(self, seq: Sequence) -> None:
        self.eagle.remove_sequence(seq)
        self.lookup.remove_sequence(seq)
        self._match.pop(seq.request_id, None)
        self._recall.pop(seq.request_id, None)

    def lag(self, seq: Sequence) -> int:
        return self.eagle.lag(seq)

    def _copy(self, seq: Sequence, gamma: int) -> list[int]:
        copy = self.lookup.lookup(seq, gamma)
        if copy and seq.matcher is not None:  # only what the grammar allows (JSON repeats its keys)
            copy = copy[:seq.matcher.validate(copy)]
        return copy

    # The depth a memory query looks ahead: the engine's default max_recall_gamma (deeper asks are cut).
    MEMORY_DEPTH = 32

    def _recall_entry(self, seq: Sequence) -> tuple[int, int, Continuations, list[int]]:
        """The memory's continuations of `seq`'s context and their most frequent path, cut where the
        grammar refuses (memoised per length and memory generation)."""
        if self.memory is None:  # the default (no memory): nothing to look up or memoise each step
            return _NO_RECALL
        key = (len(seq.token_ids), self.memory.generation)
        got = self._recall.get(seq.request_id)
        if got is None or got[:2] != key:
            found = self.memory.query(
                seq.memory_scope, seq.token_ids, self.MEMORY_DEPTH, min_match=self.min_memory_match)
            chain = found.chain(self.MEMORY_DEPTH)
            if chain and seq.matcher is not None:
                chain = chain[:seq.matcher.validate(chain)]
            got = self._recall[seq.request_id] = (*key, found, chain)
        return got

    def _recalled(self, seq: Sequence) -> Continuations:
        return self._recall_entry(seq)[2]

    def _recall_chain(self, seq: Sequence, gamma: int) -> list[int]:
        return self._recall_entry(seq)[3][:gamma]

    def _choose(self, seq: Sequence) -> tuple[str, int]:
        """(source, match) of this step's proposal for `seq`, a function of its committed tokens and
        the memory's contents (memoised per sequence, length and memory generation: the engine asks
        for source and match every step)."""
        key = (len(seq.token_ids), self.memory.generation if self.memory is not None else 0)
        got = self._match.get(seq.request_id)
        if got is None or got[:2] != key:
            n = self.lookup.copy_match(seq)
            if n and seq.matcher is not None and not self._copy(seq, 1):
                n = 0  # the grammar refuses the copy's first token
            recall = self._recalled(seq)
            m = recall.match if recall.match and self._recall_chain(seq, 1) else 0
            if m >= self.min_memory_match:
                choice = (DraftAlgorithm.MEMORY.value, bucket(m))
            elif n:
                choice = (DraftAlgorithm.NGRAM.value, n)
            else:
                choice = (DraftAlgorithm.EAGLE3.value, 0)
            got = self._match[seq.request_id] = (*key, *choice)
        return got[2], got[3]

    def source(self, seq: Sequence) -> str:
        """"memory" where this step's proposal for `seq` comes from the speculation memory, "ngram"
        where it is a copy of its context, else "eagle3": the γ policy prices and learns each source
        apart, a copy or a recall costing no draft forward."""
        return self._choose(seq)[0]

    def copy_match(self, seq: Sequence) -> int:
        """How strong this step's weightless proposal for `seq` is: a copy's matched suffix length
        (1-3), a recall's bucketed (memory.bucket: 8, 16, 32); 0 where the draft proposes."""
        return self._choose(seq)[1]

    def proposal_limit(self, seq: Sequence) -> int:
        """How many tokens this step's recall for `seq` has (the continuation the memory holds, up to
        MEMORY_DEPTH): the engine lets a recall draft past max_gamma, up to this; 0 for a copy or
        the draft, whose lengths are not known before drafting."""
        if self.source(seq) != DraftAlgorithm.MEMORY.value:
            return 0
        return len(self._recall_entry(seq)[3])

    def propose(self, seqs: list[Sequence], gammas: list[int], features: FeatureStore | None,
                generators: list) -> Proposal:
        copies, drafted = self._copies(seqs, gammas)
        tokens: list[list[int]] = [c or [] for c in copies]
        probs: list = [None] * len(seqs)
        if drafted:
            sub = self.eagle.propose([seqs[i] for i in drafted], [gammas[i] for i in drafted], features,
                                     [generators[i] for i in drafted])
            for j, i in enumerate(drafted):
                tokens[i], probs[i] = sub.tokens[j], sub.probs[j]
        return Proposal(tokens=tokens, probs=probs)

    def propose_tree(self, seqs: list[Sequence], shapes: list[TreeShape], features: FeatureStore | None,
                     generators: list) -> list[DraftTree]:
        """A copy where `source` says so, as a branchless tree of the shape's depth (one path is all a
        copy proposes); a recall as the tree of its most frequent continuations; else the EAGLE-3
        draft's tree (Eagle3Drafter.propose_tree)."""
        copies, drafted = self._copies(seqs, [shape.depth for shape in shapes])
        trees: list[DraftTree | None] = []
        for seq, c, shape in zip(seqs, copies, shapes, strict=True):
            if c and self.source(seq) == DraftAlgorithm.MEMORY.value:
                # The most frequent continuations, as many nodes as the shape allows (constrained
                # requests never get trees: the engine drafts chains for them).
                tokens, parents = self._recalled(seq).tree(shape.depth, shape.tokens)
                trees.append(DraftTree(tokens, parents))
            else:
                trees.append(DraftTree.chain(seq.token_ids[-1], c) if c else None)
        if drafted:
            grown = self.eagle.propose_tree([seqs[i] for i in drafted], [shapes[i] for i in drafted], features,
                                            [generators[i] for i in drafted])
            for j, i in enumerate(drafted):
                trees[i] = grown[j]
        return trees

    def _copies(self, seqs: list[Sequence], depths: list[int]) -> tuple[list[list[int] | None], list[int]]:
        """This step's weightless proposal per sequence, a copy or a recall (None where the draft
        proposes), and the draft's sequences."""
        copies: list[list[int] | None] = []
        for seq, depth in zip(seqs, depths, strict=True):
            source = self.source(seq)
            if source == DraftAlgorithm.MEMORY.value:
                copies.append(self._recall_chain(seq, depth) or None)
                self.recalled += 1
            elif source == DraftAlgorithm.NGRAM.value:
                copies.append(self._copy(seq, depth) or None)
                self.copied += 1
            else:
                copies.append(None)
        drafted = [i for i, copy in enumerate(copies) if copy is None]
        self.drafted += len(drafted)
        return copies, drafted

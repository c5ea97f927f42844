"""The engine loop: schedule -> prefill -> draft -> verify -> commit, one step at a time.

Single-threaded by design: the inference service drives `step()` from one thread and talks to the
engine only between steps (add, cancel, swap the drafter, change the policy).
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tide.engine.constraints import CompiledGrammar, GrammarCompiler
from tide.engine.detokenizer import IncrementalText
from tide.engine.drafters.base import (
    DraftAlgorithm,
    Drafter,
    TreeDrafter,
    copy_match,
    draft_source,
    proposal_limit,
)
from tide.engine.drafters.memory import SpeculationMemory
from tide.engine.features import FeatureStore
from tide.engine.llama import LlamaModel
from tide.engine.logits import has_penalties, needs_processing, process
from tide.engine.model_runner import ModelRunner
from tide.engine.prefix_cache import Admission, PrefixCache
from tide.engine.sampling import (
    SamplingScheme,
    coupled_draws,
    greedy_tokens,
    position_uniform,
    sample,
    target_probs,
    token_logprobs,
    verify_coupled,
    verify_greedy,
    verify_sampling,
    verify_tree_coupled,
    verify_tree_greedy,
    verify_tree_sampling,
)
from tide.engine.scheduler import Scheduler
from tide.engine.sequence import (
    FinishReason,
    GrammarSpec,
    SamplingParams,
    Sequence,
    SequenceStatus,
    TokenLogprob,
)
from tide.engine.tree import DraftTree
from tide.policies import (
    Action,
    DraftAware,
    FixedGamma,
    GammaPolicy,
    RequestView,
    StepContext,
    StepFeedback,
    TreeShape,
    action_depth,
)
from tide.telemetry import StepRecord

log = logging.getLogger(__name__)


# Other workers' requests waiting for this engine's next step (LLMEngine.remember): ~6 MB at most.
REMEMBER_QUEUE = 4096
# At most this many of them join the memory per step (indexing a 384-token request took 1-2 ms on a
# 2-vCPU Zen 4 guest, next to a ~30 ms step): a worker warming from the fleet's stream spreads that
# over its first steps instead of stalling one; steady traffic adds far fewer than this a step.
REMEMBER_PER_STEP = 8


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 16  # KV-cache slots = most sequences decoding at once
    max_seq_len: int = 2048  # prompt + output tokens per sequence
    max_tokens_per_step: int = 512  # prefill budget per step (decode rows count against it)
    max_gamma: int = 8  # hard cap on draft tokens per request per step (a chain's length, a tree's depth)
    max_tree_tokens: int = 64  # most draft nodes of one request's tree (its verify forward has one row more)
    max_tree_topk: int = 8  # most children per tree node
    forced_gamma: int = 3  # γ of a speculative=True request in a step its policy gives it 0
    prefill_chunk: int = 256  # prompts are prefilled in chunks cut at multiples of this
    prefix_cache: bool = True  # a prompt reuses the cache entries a finished request left (tide.engine.prefix_cache)
    prefix_cache_host_mb: int = 0  # host memory for entries evicted from free slots (0: slots only)
    seed: int = 0  # RNG for sampled requests without their own seed
    # How sampled requests without a seed draw (seeded ones always couple: their seed is the key).
    # Rejection sampling accepts more EAGLE-3 drafts: 1.50 against 1.30 tokens a step at
    # temperature 1 (docs/results/sampling).
    unseeded_sampling: SamplingScheme = SamplingScheme.REJECTION
    worker_id: str = "local"
    target_model: str = ""
    # Speculation memory across requests (tide.engine.drafters.memory): its byte budget in MiB, 0 =
    # none. Drafters with an `attach_memory` (the hybrid) propose from it.
    speculation_memory_mb: float = 0
    # Hard cap on a recall's chain from that memory (its drafts cost no forward, and its length is
    # known before the policy decides): long remembered continuations verify in one step.
    max_recall_gamma: int = 32

    @property
    def max_new_per_step(self) -> int:
        """The most tokens one step feeds a sequence: a prompt chunk, a chain's γ + 1 rows, or a
        tree's nodes and its root (ModelRunner.run_tree). Its KV slot has this many rows (+ 1) past
        max_seq_len, for the padded rows of a step near the end (tide.engine.kv_budget counts them)."""
        recall = self.max_recall_gamma + 1 if self.speculation_memory_mb > 0 else 0
        return max(self.prefill_chunk, self.max_gamma + 1, recall, self.max_tree_tokens + 1)


@dataclass
class RequestOutput:
    """What one step produced for one request.

    `logprobs` (requests with params.logprobs): entries of the tokens whose text is out, in order.
    With a tokenizer an entry is released once text of its token has been emitted (so a token held
    back as a possible stop string keeps its entry back too), and at the end the tokens whose text
    is not returned (EOS, the part of a matched stop string) have none;
    without one, every new token's entry. `prompt_logprobs`: once, with the first token."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    sequence: Sequence
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class CapturedRows:
    """Target states of tokens a request just committed (prompt chunks and accepted tokens).

    Row j belongs to token `token_ids[j]` at position `start + j`: aux [n, 3H] are the outputs of
    the EAGLE-3 layers after processing that token, final [n, H] the post-norm last state.
    """

    request_id: str
    workload: str
    num_prompt: int  # rows at positions < num_prompt are prompt tokens, the rest generated
    start: int
    token_ids: list[int]
    aux: torch.Tensor
    final: torch.Tensor


@dataclass
class _Decoded:
    seq: Sequence
    gamma: int  # the most drafts the step could accept: a chain's length, a tree's depth
    accepted: int
    emitted: list[int] = field(default_factory=list)
    source: str = ""  # where its drafts came from (draft_source), as the policy was told
    path: list[int] = field(default_factory=list)  # verify rows kept: the root and the accepted drafts
    drafted: int = 0  # draft tokens verified (a tree's node count)
    shape: TreeShape | None = None  # the tree it drafted, None for a chain


class LLMEngine:
    def __init__(
        self,
        model: LlamaModel,
        config: EngineConfig,
        tokenizer=None,
        drafter: Drafter | None = None,
        policy: GammaPolicy | None = None,
    ) -> None:
        if config.max_seq_len > model.cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len {config.max_seq_len} exceeds the model's context "
                             f"{model.cfg.max_position_embeddings}")
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, config.max_batch, config.max_seq_len, config.max_new_per_step)
        # How much of a finished sequence's cache a later prompt may reuse, exactly: every fed token
        # where decoding leaves the entries a prompt chunk would; else its prompt, at any token where
        # prompts are split-invariant, or in whole chunks (tide.engine.prefix_cache).
        self._reuse_decoded = model.decode_matches_prefill
        split_invariant = model.split_invariant_prefill
        prefixes = None
        if config.prefix_cache:
            host_tokens = config.prefix_cache_host_mb * 2**20 // self.runner.prefix_bytes_per_token()
            prefixes = PrefixCache(1 if split_invariant else config.prefill_chunk, host_tokens)
        self._host_prefixes: dict[int, object] = {}  # PrefixCache host entry id -> the runner's copy
        self.scheduler = Scheduler(config.max_batch, config.max_tokens_per_step, config.max_seq_len,
                                   config.prefill_chunk, prefixes)
        self.drafter: Drafter | None = None
        self._drafter_trees = False  # whether the drafter grows trees (TreeDrafter): set with the drafter
        self.features: FeatureStore | None = None
        self.policy: GammaPolicy = policy or FixedGamma(0)
        self.eos_ids = set(model.cfg.eos_token_ids)
        self.capture_listeners: list[Callable[[list[CapturedRows]], None]] = []
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        # Called with (scope, prompt tail, output, key id, request id) after a finished request of this
        # engine joins the speculation memory (the worker publishes it: services/inference/fleet_memory.py).
        self.memory_listeners: list[Callable[[str, list[int], list[int], str, str], None]] = []
        # Other workers' finished requests (`remember`, any thread), added at the start of a step; an
        # idle engine steps never, so the queue keeps the newest REMEMBER_QUEUE (the oldest would be
        # the first evicted anyway), as int32 arrays (~1.5 KB a request, not ~15 KB of Python ints).
        self._remembered: deque[tuple[str, array, array, str, str]] = deque(maxlen=REMEMBER_QUEUE)
        self._generators: dict[str, torch.Generator] = {}
        self._texts: dict[str, IncrementalText] = {}
        # Requests with logprobs and a tokenizer: [chars of text emitted, entries not yet released as
        # (offset in the text where the token's text starts, entry)]; see RequestOutput.
        self._held: dict[str, tuple[list[int], list[tuple[int, TokenLogprob]]]] = {}
        # Output-token counts of requests with presence / frequency penalties (tide.engine.logits).
        self._counts: dict[str, Counter[int]] = {}
        # The distinct prompt and output tokens of requests with a repetition penalty.
        self._seen: dict[str, set[int]] = {}
        # Output constraints: compiled against the target's tokenizer (none without one).
        self.grammars = (GrammarCompiler(tokenizer, model.cfg.vocab_size, sorted(self.eos_ids))
                         if tokenizer is not None else None)
        self._step = 0
        self._default_rng = torch.Generator().manual_seed(config.seed)
        # Outlives drafters (hot swaps hand it to the new one); requests are added as they finish.
        self.memory = (SpeculationMemory(int(config.speculation_memory_mb * 2**20))
                       if config.speculation_memory_mb > 0 else None)
        if drafter is not None:
            self.swap_drafter(drafter)

    # ---- control, between steps -------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        speculative: bool | None = None,
        workload: str = "",
        grammar: CompiledGrammar | None = None,
        memory_scope: str = "",
        remember: bool = True,
        key_id: str = "",
    ) -> Sequence:
        """Queue a request. `speculative`: None = the γ policy decides; True = it drafts every step
        (at least `config.forced_gamma` where the policy says 0); False = it never drafts.
        `grammar`: `params.grammar` already compiled (the worker compiles off the engine thread);
        compiled here (cached) when not given. `memory_scope`: the speculation memory it reads and
        (with `remember`, at its end) is added to, owned by `key_id` (the API key id, for `forget`).
        Raises ValueError for a bad prompt or constraint."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if max(prompt_ids) >= self.model.cfg.vocab_size or min(prompt_ids) < 0:
            raise ValueError("prompt has token ids outside the vocabulary")
        matcher = None
        if params.grammar is not None:
            if grammar is None or grammar.spec != params.grammar:
                grammar = self.compile_grammar(params.grammar)
            matcher = grammar.matcher()
        seq = Sequence(request_id=request_id, token_ids=list(prompt_ids), num_prompt=len(prompt_ids),
                       params=params, speculative=speculative, workload=workload, arrival_s=time.monotonic(),
                       matcher=matcher, memory_scope=memory_scope, remember=remember, key_id=key_id)
        self.scheduler.add(seq)
        if has_penalties(params):
            self._counts[request_id] = Counter()
        if params.repetition_penalty != 1.0:
            self._seen[request_id] = set(prompt_ids)
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(
                torch.randint(0, 2**62, (1,), generator=self._default_rng))
            if params.seed is not None or self.config.unseeded_sampling is SamplingScheme.COUPLED:
                seq.sample_seed = seed
            else:
                self._generators[request_id] = torch.Generator(device="cpu").manual_seed(seed)
        if self.tokenizer is not None:
            self._texts[request_id] = IncrementalText(self.tokenizer, params.stop, params.min_tokens)
            if params.logprobs is not None:
                self._held[request_id] = ([0], [])
        return seq

    def compile_grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile an output constraint for this engine's tokenizer (thread-safe, cached); raises
        ValueError for an invalid one or when the engine has no tokenizer."""
        if self.grammars is None:
            raise ValueError("output constraints need the target's tokenizer, and this engine has none")
        return self.grammars.compile(spec)

    def cancel(self, request_id: str) -> bool:
        seq = self.scheduler.get(request_id)
        if seq is None:
            return False
        self._finish(seq, FinishReason.CANCELLED)
        return True

    def set_policy(self, policy: GammaPolicy) -> None:
        self.policy = policy

    def swap_drafter(self, drafter: Drafter | None) -> None:
        """Replace the drafter between steps; in-flight requests continue with the new one.

        A feature-consuming drafter rebuilds its state for running sequences from the feature
        store on its first proposal (its lag is their whole context). Once allocated, the store
        keeps being filled even if a weightless drafter takes over, so a later EAGLE-3 swap finds
        every in-flight token's features. (Requests already in flight when the store is first
        created have zero rows for their past: their drafts are weaker, their output unchanged.)"""
        old = self.drafter
        needs = drafter is not None and drafter.algorithm.needs_target_features()
        if needs and self.features is None:
            width = 3 * self.model.cfg.hidden_size
            self.features = FeatureStore(self.config.max_batch, self.runner.cache.max_len, width,
                                         self.model.dtype, self.model.device)
        if old is not None:
            for seq in self.scheduler.active.values():
                old.remove_sequence(seq)
        self.drafter = drafter
        attach = getattr(drafter, "attach_memory", None)
        if attach is not None:
            attach(self.memory)
        self._drafter_trees = isinstance(drafter, TreeDrafter)  # a protocol check (~10 us): once, not per step
        if drafter is not None:
            for seq in self.scheduler.active.values():
                drafter.add_sequence(seq)
        if old is not drafter and isinstance(self.policy, DraftAware):
            self.policy.draft_changed()

    def has_work(self) -> bool:
        return len(self.scheduler) > 0

    # ---- the step ------------------------------------------------------------------------------

    def remember(self, scope: str, prompt: list[int], output: list[int], key_id: str = "",
                 request_id: str = "") -> bool:
        """Add another worker's finished request to the speculation memory (thread-safe: queued, and
        added at the start of the next step, so the memory stays fixed within a step). False: no memory."""
        if self.memory is None:
            return False
        self._remembered.append((scope, array("i", prompt), array("i", output), key_id, request_id))
        return True

    def forget(self, key_id: str = "", request_id: str = "") -> int:
        """Drop the speculation memory's documents of an API key id or a request, queued ones too, and
        refuse them from now on (SpeculationMemory.forget); how many stored ones went. Between steps
        only (the worker runs it on the engine thread). ValueError unless exactly one is given."""
        if self.memory is None:
            if bool(key_id) == bool(request_id):
                raise ValueError("give exactly one of a key id and a request id")
            return 0
        return self.memory.forget(key_id=key_id, request_id=request_id)

    def step(self) -> list[RequestOutput]:
        t_start = time.perf_counter()
        for _ in range(min(len(self._remembered), REMEMBER_PER_STEP)):  # popleft is atomic: `remember` may append
            scope, prompt, output, key_id, request_id = self._remembered.popleft()
            self.memory.add(scope, prompt.tolist(), output.tolist(), key_id, request_id)
        plan = self.scheduler.schedule()
        for admission in plan.moves:
            self._move_prefix(admission)
        outputs: dict[str, RequestOutput] = {}
        prefill_tokens = 0
        if plan.prefill:
            with self.runner.prefill_threads():
                prefill_tokens = self._prefill(plan.prefill, outputs)
        draft_ms = verify_ms = 0.0
        decoded: list[_Decoded] = []
        if plan.decode:
            with self.runner.decode_threads():
                decoded, draft_ms, verify_ms = self._decode(plan.decode, outputs)
        total_ms = (time.perf_counter() - t_start) * 1e3
        self._step += 1
        if decoded:
            self.policy.observe(StepFeedback(
                batch_size=len(decoded), gammas=tuple(d.gamma for d in decoded),
                accepted=tuple(d.accepted for d in decoded), step_ms=draft_ms + verify_ms,
                draft_ms=draft_ms, verify_ms=verify_ms,
                shapes=tuple(d.shape for d in decoded) if any(d.shape for d in decoded) else ()))
        if self.step_listeners and (decoded or prefill_tokens):
            record = StepRecord(
                worker_id=self.config.worker_id, step=self._step, time_unix_s=time.time(),
                batch_size=len(decoded), request_ids=[d.seq.request_id for d in decoded],
                gammas=[d.gamma for d in decoded], accepted=[d.accepted for d in decoded],
                draft_ms=draft_ms, verify_ms=verify_ms, other_ms=max(0.0, total_ms - draft_ms - verify_ms),
                prefill_tokens=prefill_tokens,
                drafter=self.drafter.algorithm.value if self.drafter else DraftAlgorithm.NONE.value,
                draft_version=self.drafter.version if self.drafter else "",
                target_model=self.config.target_model, workload=[d.seq.workload for d in decoded],
                sources=self._step_sources(decoded))
            for listener in self.step_listeners:
                listener(record)
        return list(outputs.values())

    def _step_sources(self, decoded: list[_Decoded]) -> list[str]:
        """StepRecord.sources: per request where its drafts came from where the drafter has several
        sources (a `source` method, see draft_source); [] where every draft is `drafter`'s."""
        return [d.source for d in decoded] if hasattr(self.drafter, "source") else []

    def _move_prefix(self, a: Admission) -> None:
        """Save a slot's entries to host memory before they are overwritten, or restore a prefix."""
        for entry in a.evicted:
            self._host_prefixes.pop(entry, None)
        if a.save_id >= 0:
            self._host_prefixes[a.save_id] = self.runner.save_prefix(a.slot, a.save_tokens, self.features)
        if a.restore_id >= 0:
            self.runner.restore_prefix(self._host_prefixes[a.restore_id], a.slot, a.reuse, self.features)

    def _capture(self) -> bool:
        return self.features is not None or bool(self.capture_listeners)

    def _prefill(self, items: list[tuple[Sequence, int]], outputs: dict[str, RequestOutput]) -> int:
        """One forward per prompt chunk: padding prompts of different lengths into one batch would
        make a prompt's states depend on its batch mates (SDPA's blocking follows the shape)."""
        capture = self._capture()
        for seq, n in items:
            if seq.num_cached == seq.num_reused and self.drafter is not None:  # its first chunk
                # A reused prefix's draft features are the earlier request's rows in the slot's
                # feature store (the same values; zeros if the store came later: weaker drafts only).
                self.drafter.add_sequence(seq)
            chunk = seq.token_ids[seq.num_cached:seq.num_cached + n]
            completes = seq.num_cached + n == seq.num_prompt
            prompt_top = seq.params.prompt_logprobs
            # Prompt logprobs need every row (row j: the distribution of the token after chunk[j]).
            first_row = 0 if prompt_top is not None else n - 1 if completes else n
            out = self.runner.run([seq], [chunk], [seq.num_cached], [first_row], capture, prefill=True)
            self._hand_off([seq], [seq.num_cached], [list(range(n))], [chunk], out)
            if prompt_top is not None:
                following = seq.token_ids[seq.num_cached + 1:min(seq.num_cached + n + 1, seq.num_prompt)]
                seq.prompt_logprobs.extend(token_logprobs(out.logits, following, prompt_top))
            seq.num_cached += n
            if not completes:
                continue
            last = out.logits[-1:]
            if needs_processing(seq.params):
                last = self._process(seq, last, [])
            if seq.params.greedy:
                token = int(greedy_tokens(last)[0])
            elif seq.sample_seed is not None:
                token = coupled_draws(target_probs(last.cpu(), seq.params), [position_uniform(seq.sample_seed, 0)])[0]
            else:
                token = sample(target_probs(last.cpu(), seq.params)[0], self._generators[seq.request_id])
            seq.status = SequenceStatus.RUNNING
            logprobs = None
            if seq.params.logprobs is not None:
                logprobs = token_logprobs(out.logits[-1:], [token], seq.params.logprobs)
            self._emit(seq, [token], outputs, logprobs)
            if prompt_top is not None:
                outputs[seq.request_id].prompt_logprobs = list(seq.prompt_logprobs)
        return sum(n for _, n in items)

    def _decode(self, seqs: list[Sequence], outputs: dict[str, RequestOutput]):
        """Draft (chains and trees), verify every sequence in one target forward, commit.

        A step with any tree verifies the whole batch as trees (ModelRunner.run_tree; a chain is a
        tree without branches, a plain row the root alone), else as padded chains (run)."""
        actions, sources = self._decide_actions(seqs)
        t0 = time.perf_counter()
        drafts, draft_probs, trees = self._propose(seqs, actions)
        t1 = time.perf_counter()
        starts = [seq.num_cached for seq in seqs]
        capture = self._capture()
        as_trees = any(t is not None and t.size > 0 for t in trees)
        if as_trees:
            verify = [t if t is not None else DraftTree.chain(s.token_ids[-1], d)
                      for s, d, t in zip(seqs, drafts, trees, strict=True)]
            out = self.runner.run_tree(seqs, verify, capture)
            fed = [list(t.tokens) for t in verify]
        else:
            fed = [[seq.token_ids[-1], *d] for seq, d in zip(seqs, drafts, strict=True)]
            out = self.runner.run(seqs, fed, starts, [0] * len(seqs), capture)
        greedy_rows = greedy_tokens(out.logits).tolist() if any(s.params.greedy for s in seqs) else None
        results: list[_Decoded] = []
        for i, seq in enumerate(seqs):
            lo, hi = out.row_offsets[i], out.row_offsets[i + 1]
            tree = trees[i]
            if tree is not None:
                # Tree requests have no logits processing (_decide_actions routes those to chains).
                if seq.params.greedy:
                    path, nxt = verify_tree_greedy(greedy_rows[lo:hi], tree)
                elif seq.sample_seed is not None:
                    probs = target_probs(out.logits[lo:hi].cpu(), seq.params)
                    path, nxt = verify_tree_coupled(probs, tree, self._uniforms(seq, tree.depth + 1))
                else:
                    probs = target_probs(out.logits[lo:hi].cpu(), seq.params)
                    path, nxt = verify_tree_sampling(probs, tree, self._generators[seq.request_id])
                emitted = [tree.tokens[n] for n in path[1:]] + [nxt]
                results.append(_Decoded(seq, tree.depth, len(path) - 1, emitted, sources[i], path, tree.size,
                                        actions[i]))
                continue
            logits = out.logits[lo:hi]
            processed = needs_processing(seq.params)
            if processed:  # the raw rows stay in `out` for logprobs
                logits = self._process(seq, logits, drafts[i])
            if seq.params.greedy:
                rows = greedy_tokens(logits).tolist() if processed else greedy_rows[lo:hi]
                k, nxt = verify_greedy(rows, drafts[i])
            elif seq.sample_seed is not None:
                probs = target_probs(logits.cpu(), seq.params)
                k, nxt = verify_coupled(probs, drafts[i], self._uniforms(seq, len(drafts[i]) + 1))
            else:
                # Sampling runs on the CPU, where the per-request generators live (small rows).
                probs = target_probs(logits.cpu(), seq.params)
                k, nxt = verify_sampling(probs, drafts[i], draft_probs[i], self._generators[seq.request_id])
            results.append(_Decoded(seq, len(drafts[i]), k, drafts[i][:k] + [nxt], sources[i], list(range(k + 1)),
                                    len(drafts[i])))
        if as_trees:
            self.runner.keep_paths([d.path for d in results])
        self._hand_off(seqs, starts, [d.path for d in results], fed, out)
        for i, d in enumerate(results):
            d.seq.num_cached += d.accepted + 1
            d.seq.record_step(d.gamma, d.accepted, d.drafted)
            logprobs = None
            if d.seq.params.logprobs is not None:
                # Verify row path[j] is the target's distribution of the token emitted j-th (accepted
                # drafts, then the correction / bonus token): never the draft's.
                rows = out.logits[[out.row_offsets[i] + n for n in d.path]]
                logprobs = token_logprobs(rows, d.emitted, d.seq.params.logprobs)
            self._emit(d.seq, d.emitted, outputs, logprobs)
        t2 = time.perf_counter()
        return results, (t1 - t0) * 1e3, (t2 - t1) * 1e3

    def _process(self, seq: Sequence, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """tide.engine.logits.process with the request's state: rows of the positions after the output so far."""
        stop_ids = frozenset(seq.params.stop_token_ids)
        if not seq.params.ignore_eos:
            stop_ids |= self.eos_ids
        return process(logits, seq.params, self._counts.get(seq.request_id), drafts, seq.matcher,
                       seen=self._seen.get(seq.request_id), num_output=seq.num_output, stop_ids=stop_ids)

    @staticmethod
    def _uniforms(seq: Sequence, rows: int) -> list[float]:
        """The coupled draws' uniforms of the next `rows` output positions of `seq`."""
        return [position_uniform(seq.sample_seed, seq.num_output + j) for j in range(rows)]

    def _propose(self, seqs: list[Sequence], actions: list[Action]):
        """Draft per the actions: (chain drafts per sequence, their q rows or None, trees or None).
        Chains and trees are drafted in one call each, over the sequences that asked for them."""
        drafts: list[list[int]] = [[] for _ in seqs]
        draft_probs: list[torch.Tensor | None] = [None] * len(seqs)
        trees: list[DraftTree | None] = [None] * len(seqs)
        gens = [self._generators.get(s.request_id) for s in seqs]
        chain_idx = [i for i, a in enumerate(actions) if not isinstance(a, TreeShape) and a > 0]
        tree_idx = [i for i, a in enumerate(actions) if isinstance(a, TreeShape)]
        if chain_idx:
            proposal = self.drafter.propose(
                [seqs[i] for i in chain_idx], [actions[i] for i in chain_idx], self.features,
                [gens[i] for i in chain_idx])
            for j, i in enumerate(chain_idx):
                drafts[i] = proposal.tokens[j][:actions[i]]
                probs = proposal.probs[j]
                if probs is None and seqs[i].matcher is not None:
                    # A one-hot draft the grammar refuses would be rejected anyway (its target
                    # probability is 0, the residual is p itself): verify only the allowed prefix.
                    # Not for a sampled q: there, cutting where the drawn token is refused would
                    # change which distribution the next token comes from.
                    drafts[i] = drafts[i][:seqs[i].matcher.validate(drafts[i])]
                draft_probs[i] = None if probs is None else probs[:len(drafts[i])]
        if tree_idx:
            grown = self.drafter.propose_tree([seqs[i] for i in tree_idx], [actions[i] for i in tree_idx],
                                              self.features, [gens[i] for i in tree_idx])
            for j, i in enumerate(tree_idx):
                trees[i] = grown[j]
        return drafts, draft_probs, trees

    def _decide_actions(self, seqs: list[Sequence]) -> tuple[list[Action], list[str]]:
        """The policy's action per request, made feasible (a chain's γ ≥ 0 or a TreeShape), and the
        source of draft tokens each would draft from (draft_source)."""
        cap = self.config.max_gamma
        if self.drafter is None:
            return [0] * len(seqs), [""] * len(seqs)
        views = tuple(RequestView(
            request_id=s.request_id, recent_gammas=tuple(g for g, _ in s.recent),
            recent_accepted=tuple(a for _, a in s.recent), last_gamma=s.last_gamma,
            lag=self.drafter.lag(s), context_len=len(s.token_ids), drafter=draft_source(self.drafter, s),
            match=copy_match(self.drafter, s), limit=proposal_limit(self.drafter, s),
        ) for s in seqs)
        trees_ok = self._drafter_trees
        recall_cap = max(cap, self.config.max_recall_gamma)
        decided = self.policy.decide(StepContext(batch_size=len(seqs), requests=views, step=self._step, max_gamma=cap,
                                                 max_recall_gamma=recall_cap, trees=trees_ok))
        actions: list[Action] = []
        for seq, view, a in zip(seqs, views, decided, strict=True):
            g = action_depth(a)
            # The request's own flag overrides the policy, both ways (the only place it is applied).
            if seq.speculative is False:
                g = 0
            elif seq.speculative and g <= 0:
                g = self.config.forced_gamma
            # Never draft past max_tokens or the context: at most remaining - 1 drafts + 1 bonus.
            remaining = min(seq.params.max_tokens - seq.num_output, self.config.max_seq_len - len(seq.token_ids))
            # A recall of known length may go deeper than max_gamma, never past what it holds.
            top = min(recall_cap, view.limit) if view.limit > 0 else cap
            g = max(0, min(int(g), top, remaining - 1))
            # Trees only where verification needs no per-path logits processing (penalties, bias and
            # grammar masks depend on the drafts before a row): those requests draft a chain of the
            # tree's depth instead, as do all requests of a drafter that cannot grow trees.
            if isinstance(a, TreeShape) and g > 0 and trees_ok and not needs_processing(seq.params):
                actions.append(TreeShape(g, min(a.topk, self.config.max_tree_topk),
                                         min(a.tokens, self.config.max_tree_tokens)))
            else:
                actions.append(g)
        return actions, [v.drafter for v in views]

    def _hand_off(self, seqs, starts, rows: list[list[int]], tokens: list[list[int]], out) -> None:
        """Store committed rows' features for the drafter and give them to capture listeners.
        rows[i]: the forward rows of sequence i that were committed, in order (they land at
        positions starts[i], starts[i] + 1, ...); tokens[i]: the tokens fed, one per forward row."""
        if out.aux is None:
            return
        aux, final, toks = [], [], []
        for i, r in enumerate(rows):
            if r == list(range(len(r))):  # a prefix: views, no copy
                aux.append(out.aux[i, :len(r)])
                final.append(out.final[i, :len(r)])
            else:
                at = torch.tensor(r, dtype=torch.long, device=out.aux.device)
                aux.append(out.aux[i].index_select(0, at))
                final.append(out.final[i].index_select(0, at))
            toks.append([tokens[i][j] for j in r])
        if self.features is not None:
            for i, seq in enumerate(seqs):
                self.features.write(seq.slot, starts[i], aux[i])
        if self.capture_listeners:
            captured = [CapturedRows(seq.request_id, seq.workload, seq.num_prompt, starts[i], toks[i], aux[i],
                                     final[i]) for i, seq in enumerate(seqs)]
            for listener in self.capture_listeners:
                listener(captured)

    # ---- outputs -------------------------------------------------------------------------------

    def _emit(self, seq: Sequence, tokens: list[int], outputs: dict[str, RequestOutput],
              logprobs: list[TokenLogprob] | None = None) -> None:
        """Append tokens one at a time, stopping at EOS / stop token / max_tokens / context / stop string.
        `logprobs[j]` (requests that asked) belongs to tokens[j]."""
        added: list[int] = []
        reason: FinishReason | None = None
        text = self._texts.get(seq.request_id)
        held = self._held.get(seq.request_id)
        delta = ""
        counts = self._counts.get(seq.request_id)
        seen = self._seen.get(seq.request_id)
        for j, tok in enumerate(tokens):
            seq.token_ids.append(tok)
            added.append(tok)
            if counts is not None:
                counts[tok] += 1
            if seen is not None:
                seen.add(tok)
            if seq.matcher is not None and not seq.matcher.accept(tok):  # only allowed tokens are emitted
                raise RuntimeError(f"request {seq.request_id}: the grammar refused emitted token {tok}: "
                                   f"{seq.matcher.error}")
            if logprobs is not None:
                seq.logprobs.append(logprobs[j])
                if held is not None:
                    held[1].append((len(text.text), logprobs[j]))
            if tok in seq.params.stop_token_ids:
                reason, seq.matched_stop = FinishReason.STOP, tok
            elif ((tok in self.eos_ids and not seq.params.ignore_eos)
                  or (seq.matcher is not None and seq.matcher.is_terminated)):  # EOS, or complete: only EOS may follow
                reason = FinishReason.STOP
            elif seq.num_output >= seq.params.max_tokens or len(seq.token_ids) >= self.config.max_seq_len:
                reason = FinishReason.LENGTH
            if text is not None and (text.stop or held is not None):  # per token: logprobs need offsets
                piece, hit = text.update(seq.output_ids)
                delta += piece
                if hit:
                    reason, seq.matched_stop = FinishReason.STOP, text.matched
            if reason is not None:
                break
        if text is not None and not text.stop and held is None:
            piece, _ = text.update(seq.output_ids)
            delta += piece
        if reason is not None and text is not None:
            delta += text.flush()
        released = None
        if logprobs is not None:
            released = logprobs[:len(added)] if held is None else self._release(held, len(delta))
        if reason is not None:
            self._finish(seq, reason)
        prev = outputs.get(seq.request_id)
        if prev is not None:
            added = prev.new_token_ids + added
            delta = prev.text_delta + delta
            if released is not None and prev.logprobs is not None:
                released = prev.logprobs + released
        outputs[seq.request_id] = RequestOutput(seq.request_id, added, delta, reason is not None, reason, seq,
                                                released, prev.prompt_logprobs if prev is not None else None)

    @staticmethod
    def _release(held: tuple[list[int], list[tuple[int, TokenLogprob]]], emitted: int) -> list[TokenLogprob]:
        """The held entries whose token's text starts before the end of the text emitted so far
        (`emitted` more characters just went out); at the end the rest are dropped by `_finish`."""
        done, pending = held
        done[0] += emitted
        k = 0
        while k < len(pending) and pending[k][0] < done[0]:
            k += 1
        out = [entry for _, entry in pending[:k]]
        del pending[:k]
        return out

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.slot >= 0 and self.drafter is not None:
            self.drafter.remove_sequence(seq)
        # Into the memory when it ends, not token by token: the request's own text is prompt
        # lookup's while it runs, a document is indexed once (its k-grams in one pass), and the
        # memory's contents stay fixed within a step. Cancelled and failed outputs are not kept.
        if (self.memory is not None and seq.remember and seq.num_output > 0
                and reason in (FinishReason.STOP, FinishReason.LENGTH)):
            tail = self.memory.prompt_tokens  # what the memory keeps of the prompt: its last tokens
            prompt = seq.token_ids[max(0, seq.num_prompt - tail):seq.num_prompt] if tail else []
            if self.memory.add(seq.memory_scope, prompt, seq.output_ids, seq.key_id, seq.request_id):
                for listener in self.memory_listeners:
                    listener(seq.memory_scope, prompt, list(seq.output_ids), seq.key_id, seq.request_id)
        keep = 0
        if reason is not FinishReason.ERROR:
            keep = seq.num_cached if self._reuse_decoded else min(seq.num_cached, seq.num_prompt)
        self.scheduler.finish(seq, reason, keep)
        self._generators.pop(seq.request_id, None)
        self._texts.pop(seq.request_id, None)
        self._held.pop(seq.request_id, None)
        self._counts.pop(seq.request_id, None)
        self._seen.pop(seq.request_id, None)
        seq.matcher = None

    # ---- convenience -------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 speculative: bool | None = None) -> list[Sequence]:
        """Run prompts to completion (offline use: tests, benchmarks, bootstrap)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        base = f"gen-{self._step}-"
        seqs = [self.add_request(f"{base}{i}", p, sp, speculative) for i, (p, sp) in enumerate(zip(prompts, plist,
                                                                                                  strict=True))]
        while any(not s.status.is_finished() for s in seqs):
            self.step()
        return seqs

"""EAGLE-3 drafter: owns the draft model and its one-layer KV cache.

Alignment (EAGLE): the draft row at position t consumes the target's aux states after token x_t
and the embedding of x_{t+1}, and predicts x_{t+2}. For a sequence whose target cache holds
positions [0, n) and whose last token x_n is pending, a proposal is:

1. extend: rows t in [consumed, n) — the target features the draft has not seen yet (one per
   verified token normally; many after speculation was off or after a hot-swap) — with input ids
   x_{t+1}; the last row predicts d1 = x_{n+1};
2. γ - 1 autoregressive steps at positions n, n+1, ...: hidden = the previous step's output (the
   draft's own stand-in for the target's features), input id = the previous draft token.
Only rows from target features are committed (`consumed` = n); the speculative rows at positions
>= n are overwritten by the next extend, so rejected drafts need no rollback. Each draft pass (an
extend, a chain step, a tree level) is one tide.kernels call (`draft_layer`, over a float32 cache)
where the kernels serve the draft's projections, else Eagle3Draft.step's torch ops.

Constrained requests (a grammar matcher on the sequence): each draft step's logits are masked to
the tokens the grammar allows after the drafts so far, so drafts follow the grammar; a sampled
request's q is that masked distribution, exactly what its draft was drawn from. A chain stops
where the grammar allows nothing in the draft vocabulary (decided before drawing, so lossless).
The matcher is rolled back to the committed output before returning.

Trees (EAGLE-2, `propose_tree`): after the same extend, the root's top-k children by draft
log-probability form level 1; each further level runs one draft step for the level's `topk` best
nodes by cumulative log-probability (the frontier, all sequences of the group at once) and scores
their top-k children; finally the best `tokens` nodes of all scored ones are kept. The trees are
deterministic functions of the draft's distributions (no sampling, also for sampled requests:
tide.engine.sampling.verify_tree_sampling says why that keeps sampling exact). A frontier node's
step writes a scratch row of the draft cache past the committed ones, seen only by its
descendants; like a chain's rows, the next extend overwrites them, so after a tree step the draft
cache holds exactly the committed (accepted) tokens. Constrained requests never get trees (the
engine drafts chains for them).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from tide.allocator import zeros_on_demand
from tide.eagle3 import Eagle3Draft, load_checkpoint
from tide.eagle3.model import fused_step_kernels
from tide.engine.drafters.base import DraftAlgorithm, Proposal
from tide.engine.features import FeatureStore
from tide.engine.llama import LlamaModel
from tide.engine.sampling import coupled_draws, position_uniform, target_probs
from tide.engine.sequence import Sequence
from tide.engine.tree import DraftTree
from tide.policies import TreeShape

# Draft-cache rows a tree may use beyond a sequence's committed ones: (depth - 1) · topk.
TREE_SCRATCH = 128


class Eagle3Drafter:
    algorithm = DraftAlgorithm.EAGLE3

    def __init__(self, draft: Eagle3Draft, version: str, max_batch: int, max_len: int, fused_step: bool = True,
                 weights: str = "auto") -> None:
        self.draft = draft.eval().freeze_for_serving(weights)  # its projections on tide.kernels' GEMM
        self.version = version
        cfg = draft.cfg
        p = draft.fc.weight
        # A draft step in one kernel call where tide.kernels serves every projection (the cache is
        # then float32, as the kernels' attention reads it); else the torch ops of Eagle3Draft.step
        # (`fused_step=False`: benchmarks time the two side by side).
        self._fused = fused_step_kernels(self.draft) if fused_step else None
        # Rows past max_len: scratch for tree steps of sequences near the end of the context.
        shape = (max_batch, cfg.num_key_value_heads, max_len + TREE_SCRATCH, cfg.head_dim)
        cache_dtype = torch.float32 if self._fused is not None else p.dtype
        self.k = zeros_on_demand(shape, cache_dtype, p.device)  # held as written (tide.allocator)
        self.v = zeros_on_demand(shape, cache_dtype, p.device)
        self.max_len = max_len
        self._consumed: dict[str, int] = {}
        # Draft id -> target id as a plain tensor; target ids for sampled q rows.
        self._d2t_ids = torch.arange(cfg.draft_vocab_size, device=p.device) + draft.d2t
        self._d2t_cpu = self._d2t_ids.cpu()  # indexes grammar masks (built on the CPU)
        self.mask_to_grammar = True  # False: unmasked drafts (benchmarks/features.py measures the gain)
        # Coupled requests draft q's argmax, accepted with probability p(argmax q); True: a draw
        # from q with the target's uniform, which accepted no more on the reference model (1.56
        # against 1.60 tokens a step at temperature 0.7, the same at 1.0: docs/results/sampling).
        self.coupled_drafts = False

    @classmethod
    def from_checkpoint(cls, path: str | Path, target: LlamaModel, version: str, max_batch: int,
                        max_len: int, fused_step: bool = True, weights: str = "auto") -> Eagle3Drafter:
        """Load and check a checkpoint against the serving target (raises DraftIncompatible)."""
        draft = load_checkpoint(path, target.embed, target.cfg, device=target.device, dtype=target.dtype)
        return cls(draft, version, max_batch, max_len, fused_step, weights)

    # ---- per-sequence lifecycle ----------------------------------------------------------------

    def add_sequence(self, seq: Sequence) -> None:
        self._consumed[seq.request_id] = 0

    def remove_sequence(self, seq: Sequence) -> None:
        self._consumed.pop(seq.request_id, None)

    def lag(self, seq: Sequence) -> int:
        return seq.num_cached - self._consumed.get(seq.request_id, 0)

    # ---- proposing -----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], gammas: list[int], features: FeatureStore | None,
                generators: list[torch.Generator | None]) -> Proposal:
        last, ends, slots = self._extend(seqs, features)
        device = self.k.device
        B = len(seqs)
        gmax = max(gammas)
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        hidden = last.unsqueeze(1)  # [B, 1, H]
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None] if self.mask_to_grammar else []
        masked = set(constrained)  # only these walk their matcher (and roll it back below)
        stopped = {i for i in constrained if gammas[i] <= 0}  # constrained chains that drafted their last
        try:
            for j in range(gmax):
                logits = self.draft.logits(hidden[:, 0]).float()  # [B, Vd]
                for i in constrained:
                    if i not in stopped and not self._mask_to_grammar(seqs[i], logits[i]):
                        stopped.add(i)
                chosen = self._choose(seqs, logits, generators, probs, stopped, j)
                for i in range(B):
                    if j < gammas[i] and i not in stopped:
                        tokens[i].append(int(chosen[i]))
                        if i in masked:
                            seqs[i].matcher.accept(int(chosen[i]))  # allowed: drawn from the masked row
                            if j + 1 >= gammas[i]:
                                stopped.add(i)
                if j == gmax - 1 or all(i in stopped or j + 1 >= gammas[i] for i in range(B)):
                    break  # no chain goes on: no more draft forwards
                step_pos = torch.tensor([[e + j] for e in ends], dtype=torch.long, device=device)
                hidden = self._step(chosen.view(B, 1), hidden, step_pos, slots)
        finally:
            for i in constrained:
                seqs[i].matcher.rollback(len(tokens[i]))
        q_rows = [None if seqs[i].params.greedy or not probs[i] else torch.stack(probs[i][:gammas[i]])
                  for i in range(B)]
        return Proposal(tokens=tokens, probs=q_rows)

    @torch.inference_mode()
    def propose_tree(self, seqs: list[Sequence], shapes: list[TreeShape], features: FeatureStore | None,
                     generators: list[torch.Generator | None]) -> list[DraftTree]:
        """One EAGLE-2 draft tree per sequence (see the module docstring's "Trees")."""
        last, ends, slots = self._extend(seqs, features)
        trees: list[DraftTree | None] = [None] * len(seqs)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, shape in enumerate(shapes):
            groups.setdefault((shape.depth, min(shape.topk, self.draft.cfg.draft_vocab_size)), []).append(i)
        for (depth, topk), idx in groups.items():
            if (depth - 1) * topk > TREE_SCRATCH:
                raise ValueError(f"a tree of depth {depth} and top-k {topk} needs more than the draft's "
                                 f"{TREE_SCRATCH} scratch rows")
            at = torch.tensor(idx, device=last.device)
            grown = self._grow(seqs, idx, last[at], [ends[i] for i in idx], slots[at], depth, topk,
                               [shapes[i].tokens for i in idx])
            for i, tree in zip(idx, grown, strict=True):
                trees[i] = tree
        return trees

    def _grow(self, seqs, idx: list[int], last: torch.Tensor, ends: list[int], slots: torch.Tensor, depth: int,
              topk: int, keep: list[int]) -> list[DraftTree]:
        """Expand `depth` levels from the roots (states `last` [B, H]) and keep the best nodes.

        The pool lists every scored node level by level: level 1 = the root's topk children, each
        later level the topk children of each of the previous level's topk best (its frontier),
        topk² per level. Scores are cumulative log-probabilities, clamped to their parent's so a
        child never outranks it even by rounding; a stable descending sort then ranks a parent
        before its children (ties go to the earlier pool entry), so the best N are ancestor-closed.
        Frontier node i of level s runs its draft step at position n + s - 1 (a chain's place for
        depth s) from cache row n + (s - 1)·topk + i, attending to the committed rows < n and the
        rows of its own ancestors only."""
        device = last.device
        B = len(idx)
        n = torch.tensor(ends, dtype=torch.long, device=device)
        logp = torch.log_softmax(self.draft.logits(last).float(), dim=-1)  # [B, Vd]
        score, tok = logp.topk(topk, dim=-1)  # [B, k]: level 1
        pool_score, pool_tok = [score], [tok]
        pool_parent = [torch.full((B, topk), -1, dtype=torch.long, device=device)]
        f_score, f_tok, f_pool = score, tok, torch.arange(topk, device=device).expand(B, topk)
        f_hidden = last[:, None].expand(B, topk, last.shape[-1])
        f_anc = torch.empty((B, topk, 0), dtype=torch.long, device=device)  # cache rows of the ancestors
        offset = topk
        for s in range(1, depth):
            rows = n[:, None] + (s - 1) * topk + torch.arange(topk, device=device)  # [B, k]
            anc = torch.cat([f_anc, rows[..., None]], dim=-1)  # [B, k, s]
            pos = (n + s - 1)[:, None].expand(B, topk)
            kv_len = int(rows.max()) + 1
            visible = torch.arange(kv_len, device=device)[None, None, :] < n[:, None, None]
            visible = visible.expand(B, topk, kv_len).clone().scatter_(-1, anc, True)
            out = self._step(self._d2t_ids[f_tok], f_hidden, pos, slots, rows, visible)
            logp = torch.log_softmax(self.draft.logits(out).float(), dim=-1)  # [B, k, Vd]
            c_logp, c_tok = logp.topk(topk, dim=-1)  # [B, k, k]
            c_score = torch.minimum(f_score[..., None] + c_logp, f_score[..., None]).reshape(B, topk * topk)
            c_tok = c_tok.reshape(B, topk * topk)
            pool_score.append(c_score)
            pool_tok.append(c_tok)
            pool_parent.append(f_pool[..., None].expand(B, topk, topk).reshape(B, topk * topk))
            best = torch.sort(c_score, dim=-1, descending=True, stable=True).indices[:, :topk]  # [B, k]
            from_frontier = best // topk
            f_score, f_tok, f_pool = c_score.gather(1, best), c_tok.gather(1, best), offset + best
            f_hidden = out.gather(1, from_frontier[..., None].expand(B, topk, out.shape[-1]))
            f_anc = anc.gather(1, from_frontier[..., None].expand(B, topk, s))
            offset += topk * topk
        scores = torch.cat(pool_score, dim=1)
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices.tolist()
        tokens = self._d2t_ids[torch.cat(pool_tok, dim=1)].tolist()
        parents = torch.cat(pool_parent, dim=1).tolist()
        trees = []
        for b, i in enumerate(idx):
            kept = sorted(order[b][:keep[b]])  # pool order: parents first
            node = {p: j + 1 for j, p in enumerate(kept)}  # pool index -> node id (root = 0)
            if any(parents[b][p] >= 0 and parents[b][p] not in node for p in kept):
                raise AssertionError("draft tree selection is not ancestor-closed")
            trees.append(DraftTree((seqs[i].token_ids[-1], *(tokens[b][p] for p in kept)),
                                   (-1, *(node.get(parents[b][p], 0) for p in kept))))
        return trees

    def _extend(self, seqs: list[Sequence], features: FeatureStore | None):
        """Feed the target features the draft has not consumed (step 1 of the module docstring).
        Returns (the last row's output [B, H], each sequence's n, the slots tensor)."""
        if features is None:
            raise RuntimeError("EAGLE-3 drafting needs the engine's feature store")
        device = self.k.device
        B = len(seqs)
        starts = [self._consumed[s.request_id] for s in seqs]
        ends = [s.num_cached for s in seqs]
        P = max(e - s for s, e in zip(starts, ends, strict=True))
        width = features.rows.shape[-1]
        aux = torch.zeros((B, P, width), dtype=features.rows.dtype, device=device)
        ids = torch.zeros((B, P), dtype=torch.long)
        pos = torch.empty((B, P), dtype=torch.long)
        for i, seq in enumerate(seqs):
            n = ends[i] - starts[i]
            aux[i, :n] = features.read(seq.slot, starts[i], ends[i])
            ids[i, :n] = torch.tensor(seq.token_ids[starts[i] + 1:ends[i] + 1])
            # Padding rows continue past `end` into the speculative area, which later steps rewrite
            # (clamped to the last cache row, which no committed position ever reaches).
            pos[i] = torch.clamp(torch.arange(starts[i], starts[i] + P), max=self.max_len - 1)
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=device)
        out = self._step(ids.to(device), self.draft.project(aux), pos.to(device), slots)
        last_rows = torch.tensor([e - s - 1 for s, e in zip(starts, ends, strict=True)], device=device)
        last = out[torch.arange(B, device=device), last_rows]
        for seq, end in zip(seqs, ends, strict=True):
            self._consumed[seq.request_id] = end
        return last, ends, slots

    def _mask_to_grammar(self, seq: Sequence, row: torch.Tensor) -> bool:
        """Mask one draft-logits row [Vd] to the tokens the grammar allows next; False (row left
        alone) when none of them is in the draft vocabulary: the chain stops there."""
        allowed = seq.matcher.allowed()[self._d2t_cpu]
        if not bool(allowed.any()):
            return False
        row.masked_fill_(~allowed.to(row.device), float("-inf"))
        return True

    def _choose(self, seqs, logits, generators, probs, skip: set[int], depth: int) -> torch.Tensor:
        """Next draft token per sequence (target ids), the `depth`-th of its chain (0 = the first):
        argmax for greedy requests, and for coupled ones (seq.sample_seed: deterministic, no q row)
        unless `coupled_drafts`, then the draw from q (the draft's distribution under the request's
        temperature, top-k and top-p) with the uniform the target draws this position with; for the
        others sampled from q = softmax(logits / T), whose q (over the target vocab) is recorded.
        Sequences in `skip` (constrained chains that stopped) draw nothing."""
        chosen = self._d2t_ids[logits.argmax(-1)]
        for i, seq in enumerate(seqs):
            if seq.params.greedy or i in skip:
                continue
            if seq.sample_seed is not None:
                if not self.coupled_drafts:
                    continue  # the argmax
                q = target_probs(logits[i:i + 1].cpu(), seq.params)[0]
                full = torch.zeros(self.draft.cfg.vocab_size, dtype=torch.float32).index_copy_(0, self._d2t_cpu, q)
                u = position_uniform(seq.sample_seed, seq.num_output + depth)
                chosen[i] = coupled_draws(full[None], [u])[0]
                continue
            # On the CPU, like the target's sampling: the request's generator lives there.
            q = torch.softmax(logits[i].cpu() / seq.params.temperature, dim=-1)
            d = int(torch.multinomial(q, 1, generator=generators[i]))
            chosen[i] = self._d2t_ids[d]
            full = torch.zeros(self.draft.cfg.vocab_size, dtype=torch.float32)
            probs[i].append(full.index_copy_(0, self._d2t_ids.cpu(), q))
        return chosen

    def _step(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              rows: torch.Tensor | None = None, visible: torch.Tensor | None = None) -> torch.Tensor:
        """One draft layer pass over this drafter's cache: ids [B, q] (target ids), hidden [B, q, H],
        positions [B, q]; the new keys and values go to cache rows `rows` (default: their
        positions); each query sees every cached key at a position <= its own, or the keys
        `visible` [B, q, kv_len] allows (tree steps; kv_len = max row + 1). Returns out [B, q, H]."""
        fused = self._fused
        if fused is None:
            mask = None if visible is None else visible[:, None]
            return self.draft.step(ids, hidden, positions, self._attend_fn(slots, positions, rows, mask))
        rows = positions if rows is None else rows
        kv_len = int(rows.max()) + 1
        if visible is None:
            visible = torch.arange(kv_len)[None, None, :] <= positions[:, :, None]
        bias = torch.zeros(visible.shape, dtype=torch.float32).masked_fill_(~visible, float("-inf"))
        cfg, layer, lin = self.draft.cfg, self.draft.midlayer, self.draft.serving
        cos, sin = self.draft.rope_rows(positions, hidden.dtype)
        return fused.draft_layer(
            ids, self.draft.embed, hidden, layer.input_layernorm.weight, layer.hidden_norm.weight,
            layer.post_attention_layernorm.weight, cfg.rms_norm_eps, lin.qkv.kernel_args, lin.o.kernel_args,
            lin.gate_up.kernel_args, lin.down.kernel_args, self.k, self.v, cos, sin, slots, rows, kv_len, bias,
            cfg.num_attention_heads, cfg.num_key_value_heads)

    def _attend_fn(self, slots: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None,
                   visible: torch.Tensor | None = None):
        """attend(q, k, v) over this drafter's cache: write the new k/v rows at cache rows `rows`
        (default: their positions), then attend to every cached key at a position <= the query's,
        or to the keys `visible` [B, 1, q, kv_len] allows (tree steps; kv_len = max row + 1)."""
        rows = positions if rows is None else rows
        kv_len = int(rows.max()) + 1

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.k[slots[:, None], :, rows] = k.transpose(1, 2)
            self.v[slots[:, None], :, rows] = v.transpose(1, 2)
            keys, values = self.k[slots, :, :kv_len], self.v[slots, :, :kv_len]
            mask = visible
            if mask is None:
                mask = torch.arange(kv_len, device=q.device)[None, None, None, :] <= positions[:, None, :, None]
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                  enable_gqa=keys.shape[1] != q.shape[1])
        return attend

"""The only engine module that touches the device for the target: batches -> forwards -> rows.

Turns lists of (sequence, new tokens) into one padded `ForwardBatch`, runs the target, and
returns per-sequence logits rows and, when asked, the captured states of every fed token.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from tide.engine.llama import ForwardBatch, LlamaModel, TreeRows
from tide.engine.sequence import Sequence
from tide.engine.tree import DraftTree


@dataclass
class SavedPrefix:
    """A prefix's cache entries copied out of a slot (tide.engine.prefix_cache's host tier): per
    layer [kv_heads, n, head_dim] in the model's dtype, and the drafter's feature rows if the
    engine had a feature store then."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    features: torch.Tensor | None


@dataclass
class RunOutput:
    logits: torch.Tensor  # [R, V] rows in request order (see `row_offsets`)
    row_offsets: list[int]  # sequence i owns logits rows row_offsets[i]:row_offsets[i+1]
    aux: torch.Tensor | None  # [B, q, 3H] captured auxiliary states (padded), or None
    final: torch.Tensor | None  # [B, q, H] post-norm final states (padded), or None


# Attention over a span of cache slots computes every slot in it, idle ones too; up to this many
# slots per sequence in the batch that is cheaper than gathering the batch's keys and values.
SPAN_MAX_SLOTS_PER_SEQUENCE = 2


class ModelRunner:
    def __init__(self, model: LlamaModel, max_batch: int, max_seq_len: int, max_new_per_step: int) -> None:
        self.model = model
        self.device = model.device
        self.max_seq_len = max_seq_len
        # Slack beyond max_seq_len: padded rows of a verify step may write past a sequence's end.
        self.cache = model.new_cache(max_batch, max_seq_len + max_new_per_step + 1)
        model.ensure_positions(self.cache.max_len)
        self._prefill_on_kernels = model.split_invariant_prefill
        self._tree_slots: list[tuple[int, int]] = []  # (slot, root's cache index) of the last run_tree

    def decode_threads(self):
        """The threads decoding (and verification) runs on: on CPU with the projections on the
        kernels, the kernels' own pool for them and this thread alone for torch's few small ops
        (tide.kernels.own_threads); elsewhere as they are (where torch's GEMMs serve, one thread
        for them made a Zen 3 guest's float32 step 1.4x slower)."""
        if self.device.type != "cpu" or not self.model.projections_on_kernels:
            return contextlib.nullcontext()
        from tide import kernels

        return kernels.own_threads()

    # ---- the prefix cache's host tier ----------------------------------------------------------
    # The cache holds values computed in the model's dtype (KVCache: bf16 on the CPU kernels for a
    # bf16 model, else float32), so a copy in that dtype is exact, and for a float32 cache of a
    # bf16 model half its bytes.

    def prefix_bytes_per_token(self) -> int:
        cfg = self.model.cfg
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.model.dtype.itemsize

    def save_prefix(self, slot: int, n: int, features) -> SavedPrefix:
        store = torch.device("cpu")
        k = [c[slot, :, :n].to(store, self.model.dtype, copy=True) for c in self.cache.k]
        v = [c[slot, :, :n].to(store, self.model.dtype, copy=True) for c in self.cache.v]
        rows = features.read(slot, 0, n).to(store, copy=True) if features is not None else None
        return SavedPrefix(k, v, rows)

    def restore_prefix(self, saved: SavedPrefix, slot: int, n: int, features) -> None:
        """Write the first n saved entries into `slot` (and the feature rows: the saved ones, or
        zeros when there were none, so a drafter never reads another prompt's rows as this one's)."""
        for dst, src in zip(self.cache.k + self.cache.v, saved.k + saved.v, strict=True):
            dst[slot, :, :n].copy_(src[:, :n])
        if features is not None:
            if saved.features is not None and saved.features.shape[0] >= n:
                features.write(slot, 0, saved.features[:n].to(features.rows.device))
            else:
                features.rows[slot, :n].zero_()

    def prefill_threads(self):
        """The threads prompts run on: the kernels' pool where a prompt runs on the kernels alone
        (LlamaModel.split_invariant_prefill), as decoding does; else torch's (SDPA's) threads."""
        if not self._prefill_on_kernels:
            return contextlib.nullcontext()
        return self.decode_threads()

    def run(
        self,
        seqs: list[Sequence],
        new_tokens: list[list[int]],
        starts: list[int],
        logits_from: list[int],
        capture: bool,
        prefill: bool = False,
    ) -> RunOutput:
        """Feed new_tokens[i] to sequence i at positions starts[i]...; return logits for rows
        logits_from[i]..len(new_tokens[i])-1 of each sequence (prefill: only the last row, or every
        row for a sequence that asked for prompt logprobs)."""
        B = len(seqs)
        q = max(len(t) for t in new_tokens)
        ids = torch.zeros((B, q), dtype=torch.long)
        pos = torch.empty((B, q), dtype=torch.long)
        rows: list[int] = []
        offsets = [0]
        for i, toks in enumerate(new_tokens):
            ids[i, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            pos[i] = torch.arange(starts[i], starts[i] + q)
            rows.extend(range(i * q + logits_from[i], i * q + len(toks)))
            offsets.append(len(rows))
        slots_list = [s.slot for s in seqs]
        kv_len = max(st + q for st in starts)
        contiguous = slots_list == list(range(slots_list[0], slots_list[0] + B))
        span = (min(slots_list), max(slots_list) + 1)
        mask = None
        if not (B == 1 and q == 1):
            # Key position k is visible to the query at position p iff k <= p: causal within the new
            # tokens, and it hides whatever stale entries lie beyond each sequence's own length.
            mask = torch.arange(kv_len)[None, None, None, :] <= pos[:, None, :, None]
            mask = mask.to(self.device)
        fb = ForwardBatch(
            input_ids=ids.to(self.device),
            positions=pos.to(self.device),
            slots=torch.tensor(slots_list, dtype=torch.long, device=self.device),
            kv_len=kv_len,
            mask=mask,
            slot_range=(slots_list[0], slots_list[0] + B) if contiguous else None,
            slot_span=span if not contiguous and span[1] - span[0] <= SPAN_MAX_SLOTS_PER_SEQUENCE * B else None,
            logits_rows=None if len(rows) == B * q else torch.tensor(rows, dtype=torch.long, device=self.device),
            capture=capture,
            prefill=prefill,
        )
        logits, final, aux = self.model.forward(fb, self.cache)
        return RunOutput(logits=logits, row_offsets=offsets, aux=aux, final=final)

    def run_tree(self, seqs: list[Sequence], trees: list[DraftTree], capture: bool) -> RunOutput:
        """Verify one draft tree per sequence (its root = the pending token) in one forward: row j
        of sequence i is node j at position num_cached + depth(j), attending to the cached tokens
        and its own path: bitwise the row plain decoding of that path computes (TreeRows). Every
        node's logits are returned, in node order. The nodes' keys and values land at num_cached +
        node: call `keep_paths` with the accepted paths before the next forward."""
        B = len(seqs)
        q = max(len(t.tokens) for t in trees)
        P = max(t.depth for t in trees) + 1
        starts = [s.num_cached for s in seqs]
        if max(starts) + q > self.cache.max_len:
            raise ValueError(f"a tree of {q} rows does not fit the cache ({self.cache.max_len} rows; "
                             "ModelRunner's max_new_per_step)")
        # Index lists built in Python and turned into tensors once (no per-node tensor ops). Padding
        # rows (trees smaller than the batch's largest) continue the root as a chain of themselves:
        # hidden from every real row, their logits never read.
        ids: list[int] = []
        pos: list[int] = []
        path_rows: list[list[int]] = []
        seen: list[list[bool]] = []  # [b * q + j][a]: node a is on node j's path
        rows: list[int] = []
        offsets = [0]
        for i, tree in enumerate(trees):
            n = len(tree.tokens)
            ids += [*tree.tokens, *[0] * (q - n)]
            pos += [starts[i] + d for d in tree.depths] + [starts[i] + j for j in range(n, q)]
            for j in range(q):
                path = tree.paths[j] if j < n else range(j + 1)
                on = [False] * q
                for a in path:
                    on[a] = True
                seen.append(on)
                # paths[i, j, a] for the torch attention (tide.layers.tree_attention): past node j's
                # depth any node will do (placed, but hidden from it): node j itself.
                path_rows.append([*path[:P], *[j] * (P - len(path))])
            rows.extend(range(i * q, i * q + n))
            offsets.append(len(rows))
        slots_list = [s.slot for s in seqs]
        start_t = torch.tensor(starts, dtype=torch.long)
        kv_len = max(st + q for st in starts)
        # Every row sees its sequence's cached tokens (keys < start) and, from start on, its own path.
        mask = (torch.arange(kv_len)[None, None, :] < start_t[:, None, None]).repeat(1, q, 1)
        on_path = torch.tensor(seen, dtype=torch.bool).view(B, q, q)
        for i, st in enumerate(starts):
            mask[i, :, st:st + q] = on_path[i]
        contiguous = slots_list == list(range(slots_list[0], slots_list[0] + B))
        dev = self.device
        fb = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long).view(B, q).to(dev),
            positions=torch.tensor(pos, dtype=torch.long).view(B, q).to(dev),
            slots=torch.tensor(slots_list, dtype=torch.long, device=dev),
            kv_len=kv_len,
            mask=mask[:, None].to(dev),
            slot_range=(slots_list[0], slots_list[0] + B) if contiguous else None,
            logits_rows=None if len(rows) == B * q else torch.tensor(rows, dtype=torch.long, device=dev),
            capture=capture,
            tree=TreeRows(cache_index=(start_t[:, None] + torch.arange(q)).to(dev),
                          paths=torch.tensor(path_rows, dtype=torch.long).view(B, q, P).to(dev),
                          starts=start_t.to(dev)),
        )
        logits, final, aux = self.model.forward(fb, self.cache)
        self._tree_slots = [(slot, st) for slot, st in zip(slots_list, starts, strict=True)]
        return RunOutput(logits=logits, row_offsets=offsets, aux=aux, final=final)

    def keep_paths(self, paths: list[list[int]]) -> None:
        """After `run_tree`: keep each sequence's accepted nodes (paths[i]: node ids from the root, in
        the order `run_tree` got the sequences) as its cache rows start, start + 1, ...: every layer's
        key and value of node `path[d]` moves from start + path[d] to start + d. A chain's path
        (node d at depth d) moves nothing; rows past the kept ones are scratch later forwards overwrite."""
        if len(paths) != len(self._tree_slots):
            raise ValueError("keep_paths needs one path per sequence of the last run_tree")
        slot, src, dst = [], [], []
        for (s, start), path in zip(self._tree_slots, paths, strict=True):
            for d, node in enumerate(path):
                if node != d:
                    slot.append(s)
                    src.append(start + node)
                    dst.append(start + d)
        self._tree_slots = []
        if not slot:
            return
        dev = self.device
        slot_t, src_t, dst_t = (torch.tensor(x, dtype=torch.long, device=dev) for x in (slot, src, dst))
        for kc, vc in zip(self.cache.k, self.cache.v, strict=True):
            kc[slot_t, :, dst_t] = kc[slot_t, :, src_t]  # the right side is gathered first: overlaps are safe
            vc[slot_t, :, dst_t] = vc[slot_t, :, src_t]

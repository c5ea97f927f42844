"""Training data from hidden-state chunks: sources, background prefetch, pieces and packed batches.

A *source* yields chunk blobs (bytes): a local directory of chunk files, `s3://bucket/prefix`
(through `tide.blobs`, checksum-verified), or any iterable of bytes (e.g. blobs the trainer
service fetched for stream entries). Chunks are decoded and validated (`tide.chunks`) and the
target's greedy next token of every row is computed once, in a background thread, while the next
blob downloads. Invalid chunks are reported and skipped, never trained on; duplicate chunk ids
are read once (at-least-once delivery upstream).

Each chunk segment becomes one or more *pieces* of at most `max_len` rows; batches pack pieces
into rows of `max_len` (first fit, in a seeded order per epoch), with a segment id per column so
attention and targets never cross pieces.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from services.trainer.training.head import TargetHead
from tide.chunks import ChunkInvalid, decode_chunk

log = logging.getLogger(__name__)


@dataclass
class Piece:
    """Consecutive rows of one sequence (see tide.chunks for what a row is)."""

    chunk_id: str
    input_ids: torch.Tensor  # [n] long
    positions: torch.Tensor  # [n] long
    loss_mask: torch.Tensor  # [n] bool: row's target distribution may be learned
    aux: torch.Tensor  # [n, 3T] bf16
    final: torch.Tensor  # [n, T] bf16
    # [n] long: argmax of the target's logits at the row (the next token it would pick); 0 where
    # loss_mask is 0 (never read there)
    greedy: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class Dataset:
    pieces: list[Piece]
    chunk_ids: list[str]  # in the order read
    rejected: list[tuple[str, str]]  # (chunk id or source name, problem)

    @property
    def num_tokens(self) -> int:
        return sum(len(p) for p in self.pieces)


def local_source(path) -> Iterator[bytes]:
    """Blobs of every file under `path` (sorted, recursive; hidden files skipped)."""
    for file in sorted(Path(path).rglob("*")):
        if file.is_file() and not file.name.startswith("."):
            yield file.read_bytes()


def s3_source(url: str, client=None) -> Iterator[bytes]:
    """Blobs under s3://bucket/prefix, each verified against its stored SHA-256."""
    from tide import blobs

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = client or blobs.storage_settings().s3_client()
    for key in blobs.list_keys(client, bucket, prefix):
        yield blobs.get_bytes(client, bucket, key)


def open_source(source) -> Iterable[bytes]:
    if isinstance(source, str | Path):
        return s3_source(str(source)) if str(source).startswith("s3://") else local_source(source)
    return source


def prefetch(items: Iterable, depth: int = 2, fn: Callable | None = None) -> Iterator:
    """Iterate `items` (mapped through `fn`) in a background thread, `depth` results ahead.

    Exceptions in the thread re-raise in the consumer; a consumer that stops early stops the thread.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(entry) -> bool:
        """Hand over `entry`, or give up once the consumer has stopped (never blocks for good)."""
        while not stop.is_set():
            try:
                q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def worker() -> None:
        try:
            for item in items:
                if not put((True, fn(item) if fn else item)):
                    return
            put((True, done))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put((False, e))

    thread = threading.Thread(target=worker, name="tide-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            ok, value = q.get()
            if not ok:
                raise value
            if value is done:
                return
            yield value
    finally:
        stop.set()
        thread.join(timeout=10)  # a worker left running into interpreter exit can abort it (SIGABRT)


def load_dataset(source, head: TargetHead, max_len: int, expected_target: str | None = None,
                 skip_ids: Iterable[str] = (), learn_prompt_rows: bool = False) -> Dataset:
    """Decode, validate and split every chunk of `source` into pieces (greedy tokens precomputed).

    `learn_prompt_rows`: make every row learnable, prompt rows included. The target's state at a
    prompt row still gives its own next-token distribution (what it would have generated there), so
    these rows are extra supervision at no generation cost (46 % more learnable rows on a bootstrap's
    GSM8K-heavy data, where 68.5 % were generated). Only for training sets; held-out data keeps the
    chunks' mask, which marks where serving drafts."""

    def decode(blob: bytes):
        try:
            chunk = decode_chunk(blob, expected_target=expected_target)
        except ChunkInvalid as e:
            return e
        if chunk.final.shape[1] != head.hidden_size:
            problem = f"hidden size {chunk.final.shape[1]} != target's {head.hidden_size}"
            return ChunkInvalid(chunk.meta.chunk_id, problem)
        if int(chunk.input_ids.max()) >= head.vocab_size:
            return ChunkInvalid(chunk.meta.chunk_id, "token id outside the target vocabulary")
        if learn_prompt_rows:
            chunk.loss_mask = torch.ones_like(chunk.loss_mask)
        # greedy tokens are read only on learnable rows (targets and the evaluator's checks start
        # at a row whose next token was generated, and generated rows run to a sequence's end)
        return chunk, head.greedy(chunk.final, rows=chunk.loss_mask.bool())

    data = Dataset([], [], [])
    seen = set(skip_ids)
    for item in prefetch(open_source(source), fn=decode):
        if isinstance(item, ChunkInvalid):
            log.warning("skipping invalid chunk: %s", item)
            data.rejected.append((item.chunk_id, item.problem))
            continue
        chunk, greedy = item
        if chunk.meta.chunk_id in seen:
            continue
        seen.add(chunk.meta.chunk_id)
        data.chunk_ids.append(chunk.meta.chunk_id)
        for start, end in chunk.segments():
            for a in range(start, end, max_len):
                b = min(a + max_len, end)
                if b - a >= 2:  # a row needs the next row's target distribution
                    data.pieces.append(Piece(
                        chunk.meta.chunk_id, chunk.input_ids[a:b].long(), chunk.positions[a:b].long(),
                        chunk.loss_mask[a:b].bool(), chunk.aux[a:b], chunk.final[a:b], greedy[a:b]))
    return data


def is_heldout(chunk_id: str, eval_fraction: float, seed: int = 0) -> bool:
    """Whether `split` holds this chunk out: a hash of (seed, chunk id), the same in every run."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{chunk_id}".encode()).digest()[:8], "little")
    return h / 2**64 < eval_fraction


def split(data: Dataset, eval_fraction: float, seed: int = 0) -> tuple[Dataset, Dataset]:
    """Split by chunk (never inside one), deterministically from a hash of (seed, chunk id)."""
    ids = data.chunk_ids
    held = {cid for cid in ids if is_heldout(cid, eval_fraction, seed)}
    if eval_fraction > 0 and not held and len(ids) > 1:
        held = {ids[-1]}
    if len(held) == len(ids) and len(ids) > 1:
        held.discard(ids[0])
    parts = []
    for keep in (lambda c: c not in held, lambda c: c in held):
        parts.append(Dataset([p for p in data.pieces if keep(p.chunk_id)], [c for c in ids if keep(c)], []))
    return parts[0], parts[1]


@dataclass
class Batch:
    """Packed rows [B, L]: `seg` is -1 on padding and otherwise a piece id unique within the batch."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    seg: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor
    greedy: torch.Tensor

    def to(self, device) -> Batch:
        return Batch(**{k: v.to(device, non_blocking=True) for k, v in self.__dict__.items()})

    @property
    def num_tokens(self) -> int:
        return int((self.seg >= 0).sum())


def plan_batches(lengths: list[int], batch_rows: int, max_len: int, seed: int, epoch: int) -> list[list[list[int]]]:
    """Batches -> rows -> piece indices: pieces in a seeded order per epoch, packed first-fit."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in order:
        recent = range(max(0, len(rows) - batch_rows), len(rows))  # rows of the batch being filled
        slot = next((r for r in recent if fill[r] + lengths[i] <= max_len), None)
        if slot is None:
            rows.append([])
            fill.append(0)
            slot = len(rows) - 1
        rows[slot].append(i)
        fill[slot] += lengths[i]
    return [rows[a:a + batch_rows] for a in range(0, len(rows), batch_rows)]


def collate(pieces: list[Piece], rows: list[list[int]]) -> Batch:
    width = max(sum(len(pieces[i]) for i in row) for row in rows)
    p0 = pieces[rows[0][0]]
    B = len(rows)
    out = Batch(
        input_ids=torch.zeros(B, width, dtype=torch.long), positions=torch.zeros(B, width, dtype=torch.long),
        seg=torch.full((B, width), -1, dtype=torch.long), loss_mask=torch.zeros(B, width, dtype=torch.bool),
        aux=torch.zeros(B, width, p0.aux.shape[1], dtype=p0.aux.dtype),
        final=torch.zeros(B, width, p0.final.shape[1], dtype=p0.final.dtype),
        greedy=torch.zeros(B, width, dtype=torch.long))
    sid = 0
    for b, row in enumerate(rows):
        c = 0
        for i in row:
            p, n = pieces[i], len(pieces[i])
            for name in ("input_ids", "positions", "loss_mask", "aux", "final", "greedy"):
                getattr(out, name)[b, c:c + n] = getattr(p, name)
            out.seg[b, c:c + n] = sid
            sid += 1
            c += n
    return out

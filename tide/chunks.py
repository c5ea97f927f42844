"""Hidden-state chunk: the training data an inference worker exports and the trainer consumes.

One chunk is one safetensors blob (never pickle) holding N token rows grouped in S segments:

    input_ids        int32|int64 [N]   token processed by the target at this row
    positions        int32|int64 [N]   its position in its sequence (consecutive inside a segment)
    segment_offsets  int64 [S+1]       segment s = rows offsets[s]:offsets[s+1]; 0 = offsets[0] < ... = N
    loss_mask        uint8 [N]         1 = the target's distribution at this row (over the next token)
                                       is a training target; 0 e.g. for rows the exporter distrusts
    aux              bf16 [N, 3T]      outputs of the target's aux layers (1, L//2-1, L-4), concatenated
    final            bf16 [N, T]       the target's final post-norm state

**Row i is the state of the target after processing token input_ids[i] at positions[i]**: aux[i]
and final[i] are what the target's forward computed for that token, so lm_head(final[i]) is the
target's distribution over the token at positions[i] + 1 (which, inside a segment, is
input_ids[i + 1]). A segment is one contiguous run of one sequence; it may start at a position > 0
(the rest of a sequence whose start went into an earlier chunk).

Metadata lives in the safetensors header (`__metadata__`, string -> string, keys `tide.*`): chunk
id, target model id, draft version that was serving, workload tag, worker id, created time (unix
seconds) and format version, and who the rows came from: `request_ids` (JSON list: the worker's
request ids, e.g. "chatcmpl-<uuid>-<choice>"), `key_ids` (JSON list beside it: the API key's id,
a hash, never the key; "" without auth) and `segment_requests` (JSON list: segment s holds rows of
request request_ids[segment_requests[s]]; a segment never mixes requests), so `without_requests`
can rewrite a chunk without one user's rows. Chunks written before these fields have them empty.
`decode_chunk` validates everything and raises `ChunkInvalid` naming the chunk and the problem; the
stream reference carries `sha256(blob)` of the stored bytes, which are sealed (AES-256-GCM,
tide/datakeys.py) when data keys are configured: a sealed blob that fails authentication raises
`ChunkUnauthentic`.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
import uuid
from dataclasses import dataclass, field

import torch
from safetensors.torch import load, save

from tide.datakeys import Keyring, Unauthentic, is_sealed

FORMAT_VERSION = 1
_META_PREFIX = "tide."
_MAX_HEADER = 1 << 20  # bytes; a chunk's header is ~1 KB, anything huge is corrupt or hostile
_TENSORS = ("input_ids", "positions", "segment_offsets", "loss_mask", "aux", "final")
_DTYPES = {
    "input_ids": (torch.int32, torch.int64),
    "positions": (torch.int32, torch.int64),
    "segment_offsets": (torch.int64,),
    "loss_mask": (torch.uint8,),
    "aux": (torch.bfloat16,),
    "final": (torch.bfloat16,),
}


class ChunkInvalid(ValueError):
    """A chunk failed validation; the message names the chunk and the problem."""

    def __init__(self, chunk_id: str, problem: str) -> None:
        super().__init__(f"chunk {chunk_id or '<unknown>'}: {problem}")
        self.chunk_id = chunk_id
        self.problem = problem


class ChunkUnauthentic(ChunkInvalid):
    """A sealed chunk blob failed authentication (tampered, truncated, or an unknown key)."""


_LISTS = ("request_ids", "key_ids", "segment_requests")


@dataclass(frozen=True)
class ChunkMeta:
    chunk_id: str
    target_model: str
    worker_id: str = ""
    draft_version: str = ""  # "" when no draft was serving
    workload: str = ""  # "" when unknown
    created_at: float = field(default_factory=time.time)  # unix seconds
    format_version: int = FORMAT_VERSION
    request_ids: tuple[str, ...] = ()  # the requests whose rows the chunk holds (see the module docstring)
    key_ids: tuple[str, ...] = ()  # beside request_ids: each one's API key id ("" = none)
    segment_requests: tuple[int, ...] = ()  # per segment: its index into request_ids

    def to_header(self) -> dict[str, str]:
        return {_META_PREFIX + k: json.dumps(list(v)) if k in _LISTS else
                str(v) if k != "created_at" else repr(float(v))
                for k, v in self.__dict__.items()}

    @classmethod
    def from_header(cls, header: dict[str, str]) -> ChunkMeta:
        d = {k[len(_META_PREFIX):]: v for k, v in header.items() if k.startswith(_META_PREFIX)}
        chunk_id = d.get("chunk_id", "")
        try:
            lists = {k: tuple(json.loads(d.get(k, "[]"))) for k in _LISTS}
            if not all(isinstance(x, str) for k in ("request_ids", "key_ids") for x in lists[k]) or not all(
                    isinstance(x, int) for x in lists["segment_requests"]):
                raise ValueError("request_ids / key_ids must be strings, segment_requests integers")
            return cls(chunk_id=chunk_id, target_model=d["target_model"], worker_id=d.get("worker_id", ""),
                       draft_version=d.get("draft_version", ""), workload=d.get("workload", ""),
                       created_at=float(d["created_at"]), format_version=int(d["format_version"]), **lists)
        except (KeyError, ValueError, TypeError) as e:
            raise ChunkInvalid(chunk_id, f"bad metadata ({type(e).__name__}: {e})") from None


@dataclass
class Chunk:
    """Decoded chunk (tensors on CPU); see the module docstring for the meaning of each row."""

    meta: ChunkMeta
    input_ids: torch.Tensor
    positions: torch.Tensor
    segment_offsets: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_segments(self) -> int:
        return int(self.segment_offsets.shape[0]) - 1

    def segments(self) -> list[tuple[int, int]]:
        """Row ranges [start, end) of the segments."""
        o = self.segment_offsets.tolist()
        return list(zip(o[:-1], o[1:], strict=True))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in _TENSORS}

    def validate(self, expected_target: str | None = None) -> None:
        _validate(self, expected_target)


def sha256(data: bytes) -> str:
    """Hex SHA-256 of a chunk blob (what the stream reference carries)."""
    return hashlib.sha256(data).hexdigest()


def encode_chunk(chunk: Chunk) -> bytes:
    """Validate and serialise (contiguous CPU tensors, metadata in the header)."""
    chunk.validate()
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in chunk.tensors().items()}
    return save(tensors, metadata={"format": "pt", **chunk.meta.to_header()})


def decode_chunk(data: bytes, expected_target: str | None = None, keyring: Keyring | None = None) -> Chunk:
    """Parse and validate a chunk blob (opening a sealed one with `keyring`, by default the
    process's data keys: tide.blobs.data_keyring); raise ChunkInvalid on any problem,
    ChunkUnauthentic when a sealed blob fails authentication."""
    if is_sealed(data):
        if keyring is None:
            from tide.blobs import data_keyring

            keyring = data_keyring()
        try:
            data = keyring.open(data)
        except Unauthentic as e:
            raise ChunkUnauthentic("", f"sealed blob {e}") from None
    meta = ChunkMeta.from_header(_read_header(data).get("__metadata__") or {})
    try:
        tensors = load(bytes(data))
    except Exception as e:
        raise ChunkInvalid(meta.chunk_id, f"unreadable tensors ({type(e).__name__}: {e})") from None
    names = set(tensors)
    if names != set(_TENSORS):
        raise ChunkInvalid(meta.chunk_id, f"tensors {sorted(names)}, expected {sorted(_TENSORS)}")
    chunk = Chunk(meta=meta, **tensors)
    chunk.validate(expected_target)
    return chunk


def _read_header(data: bytes) -> dict:
    """The safetensors JSON header (8-byte little-endian length, then JSON)."""
    if len(data) < 8:
        raise ChunkInvalid("", f"{len(data)} bytes is too short for a safetensors blob")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > min(_MAX_HEADER, len(data) - 8):
        raise ChunkInvalid("", f"header length {n} exceeds the blob or {_MAX_HEADER} bytes")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ChunkInvalid("", f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ChunkInvalid("", "header is not a JSON object")
    return header


def _validate(c: Chunk, expected_target: str | None) -> None:
    def bad(problem: str) -> ChunkInvalid:
        return ChunkInvalid(c.meta.chunk_id, problem)

    m = c.meta
    if not m.chunk_id:
        raise bad("empty chunk id")
    if m.format_version != FORMAT_VERSION:
        raise bad(f"format version {m.format_version}, this code reads {FORMAT_VERSION}")
    if expected_target is not None and m.target_model != expected_target:
        raise bad(f"target model {m.target_model!r}, expected {expected_target!r}")
    for name, allowed in _DTYPES.items():
        t = getattr(c, name)
        if t.dtype not in allowed:
            raise bad(f"{name} has dtype {t.dtype}, expected one of {[str(d) for d in allowed]}")
    n = c.num_tokens
    if n == 0:
        raise bad("no tokens")
    for name in ("input_ids", "positions", "loss_mask"):
        if getattr(c, name).shape != (n,):
            raise bad(f"{name} has shape {list(getattr(c, name).shape)}, expected [{n}]")
    if c.final.dim() != 2 or c.final.shape[0] != n:
        raise bad(f"final has shape {list(c.final.shape)}, expected [{n}, T]")
    width = c.final.shape[1]
    if c.aux.shape != (n, 3 * width):
        raise bad(f"aux has shape {list(c.aux.shape)}, expected [{n}, {3 * width}] (3 x final's width)")
    o = c.segment_offsets
    if o.dim() != 1 or o.shape[0] < 2 or int(o[0]) != 0 or int(o[-1]) != n or not bool((o[1:] > o[:-1]).all()):
        raise bad(f"segment_offsets must rise strictly from 0 to {n}, got {o.tolist()[:8]}...")
    if len(m.key_ids) not in (0, len(m.request_ids)):
        raise bad(f"{len(m.key_ids)} key ids for {len(m.request_ids)} request ids")
    if m.segment_requests and (len(m.segment_requests) != c.num_segments
                               or not all(0 <= i < len(m.request_ids) for i in m.segment_requests)):
        raise bad("segment_requests must name a request id for every segment")
    if int(c.input_ids.min()) < 0:
        raise bad("negative token id")
    if int(c.positions.min()) < 0:
        raise bad("negative position")
    step = c.positions[1:] - c.positions[:-1]
    inside = torch.ones(n - 1, dtype=torch.bool)
    inside[o[1:-1] - 1] = False  # pairs that straddle a segment boundary
    if not bool((step[inside] == 1).all()):
        raise bad("positions are not consecutive inside a segment")
    if int(c.loss_mask.max()) > 1:
        raise bad("loss_mask holds values other than 0 and 1")
    for name in ("aux", "final"):
        if not bool(torch.isfinite(getattr(c, name)).all()):
            raise bad(f"{name} has non-finite values")


class ChunkBuilder:
    """Accumulates per-sequence rows (token ids, positions, aux, final) into preallocated buffers.

    The exporter appends, after each verification, the rows of the tokens each sequence accepted:
    a few rows per sequence per step, interleaved across sequences. `flush` orders the rows by
    sequence (stable: arrival order within a sequence is kept), so each sequence's rows become one
    segment (split wherever positions are not consecutive), and returns a Chunk. aux/final buffers
    are bf16; with `pin_memory` copies from CUDA tensors are asynchronous and `flush` waits for them.
    """

    def __init__(self, capacity: int, hidden_size: int, target_model: str, worker_id: str = "",
                 pin_memory: bool = False) -> None:
        self.capacity = capacity
        self.target_model = target_model
        self.worker_id = worker_id
        self._ids = torch.empty(capacity, dtype=torch.int64)
        self._pos = torch.empty(capacity, dtype=torch.int64)
        self._seq = torch.empty(capacity, dtype=torch.int64)
        self._mask = torch.empty(capacity, dtype=torch.uint8)
        self._aux = torch.empty(capacity, 3 * hidden_size, dtype=torch.bfloat16, pin_memory=pin_memory)
        self._final = torch.empty(capacity, hidden_size, dtype=torch.bfloat16, pin_memory=pin_memory)
        self._async = pin_memory
        self._keys: dict = {}
        self._key_ids: dict = {}
        self.num_tokens = 0

    @property
    def free(self) -> int:
        return self.capacity - self.num_tokens

    def append(self, seq_key, input_ids, positions, aux: torch.Tensor, final: torch.Tensor,
               loss_mask=None, key_id: str = "") -> int:
        """Append the rows of one sequence (`seq_key`: its request id, recorded in the chunk's
        metadata with `key_id`, its API key's id). Takes as many rows as fit and returns how many
        it took; flush and append the rest when that is fewer."""
        k = min(len(input_ids), self.free)
        if k == 0:
            return 0
        a, b = self.num_tokens, self.num_tokens + k
        self._ids[a:b] = torch.as_tensor(input_ids[:k])
        self._pos[a:b] = torch.as_tensor(positions[:k])
        self._seq[a:b] = self._keys.setdefault(seq_key, len(self._keys))
        self._key_ids.setdefault(seq_key, key_id)
        self._mask[a:b] = 1 if loss_mask is None else torch.as_tensor(loss_mask[:k])
        self._aux[a:b].copy_(aux[:k], non_blocking=self._async)
        self._final[a:b].copy_(final[:k], non_blocking=self._async)
        self.num_tokens = b
        return k

    def flush(self, draft_version: str = "", workload: str = "", chunk_id: str | None = None) -> Chunk | None:
        """The accumulated rows as a Chunk (None when empty); the builder is empty afterwards."""
        n = self.num_tokens
        if n == 0:
            return None
        if self._async and torch.cuda.is_available():
            torch.cuda.synchronize()  # pending non_blocking device->host copies
        order = torch.sort(self._seq[:n], stable=True).indices
        seq, pos = self._seq[:n][order], self._pos[:n][order]
        starts = torch.ones(n, dtype=torch.bool)
        starts[1:] = (seq[1:] != seq[:-1]) | (pos[1:] != pos[:-1] + 1)
        offsets = torch.cat([starts.nonzero().flatten(), torch.tensor([n])]).to(torch.int64)
        requests = list(self._keys)  # index i = the sequence whose rows carry _seq == i
        meta = ChunkMeta(chunk_id=chunk_id or uuid.uuid4().hex, target_model=self.target_model,
                         worker_id=self.worker_id, draft_version=draft_version, workload=workload,
                         request_ids=tuple(str(k) for k in requests),
                         key_ids=tuple(str(self._key_ids.get(k, "")) for k in requests),
                         segment_requests=tuple(int(i) for i in seq[offsets[:-1]].tolist()))
        chunk = Chunk(meta=meta, input_ids=self._ids[:n][order], positions=pos, segment_offsets=offsets,
                      loss_mask=self._mask[:n][order], aux=self._aux[:n][order], final=self._final[:n][order])
        self.num_tokens = 0
        self._keys.clear()
        self._key_ids.clear()
        return chunk


def request_matches(request_id: str, wanted: str) -> bool:
    """Whether a worker's request id belongs to the request a client knows as `wanted`: the gateway
    names each choice "<response id>-<choice index>", so "chatcmpl-x" matches "chatcmpl-x-0"."""
    return request_id == wanted or (request_id.startswith(wanted + "-") and request_id[len(wanted) + 1:].isdigit())


def without_requests(chunk: Chunk, drop: set[int]) -> Chunk | None:
    """`chunk` without the segments of the requests at indices `drop` of its request_ids (same chunk
    id: a rewrite replaces it), or None when nothing is left. Needs segment_requests."""
    m = chunk.meta
    if not m.segment_requests:
        raise ChunkInvalid(m.chunk_id, "no segment_requests: cannot tell whose rows are whose")
    keep_reqs = [i for i in range(len(m.request_ids)) if i not in drop]
    if not keep_reqs:
        return None
    new_index = {old: new for new, old in enumerate(keep_reqs)}
    rows: list[torch.Tensor] = []
    seg_reqs: list[int] = []
    offsets = [0]
    for (a, b), r in zip(chunk.segments(), m.segment_requests, strict=True):
        if r in drop:
            continue
        rows.append(torch.arange(a, b))
        seg_reqs.append(new_index[r])
        offsets.append(offsets[-1] + b - a)
    if not rows:
        return None
    idx = torch.cat(rows)
    meta = ChunkMeta(**{**m.__dict__, "request_ids": tuple(m.request_ids[i] for i in keep_reqs),
                        "key_ids": tuple(m.key_ids[i] for i in keep_reqs) if m.key_ids else (),
                        "segment_requests": tuple(seg_reqs)})
    return Chunk(meta=meta, input_ids=chunk.input_ids[idx], positions=chunk.positions[idx],
                 segment_offsets=torch.tensor(offsets, dtype=torch.int64), loss_mask=chunk.loss_mask[idx],
                 aux=chunk.aux[idx], final=chunk.final[idx])


def learnable_rows(start: int, n: int, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, loss_mask uint8) of `n` captured rows starting at position `start`: a row is
    learnable when its next token is generated output (position >= prompt length - 1)."""
    pos = torch.arange(start, start + n)
    return pos, (pos >= prompt_len - 1).to(torch.uint8)

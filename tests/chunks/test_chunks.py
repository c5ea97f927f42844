"""Hidden-state chunk format: round trip, every validation failure, the builder, and no pickle."""

from __future__ import annotations

import hashlib
import io
import pickle
import struct

import pytest
import torch
from safetensors.torch import save

from tide.chunks import Chunk, ChunkBuilder, ChunkInvalid, ChunkMeta, decode_chunk, encode_chunk, sha256

T = 8  # target hidden size of the toy chunks


def make_chunk(segments=((0, 5), (17, 4)), chunk_id="c-1", seed=0) -> Chunk:
    """Segments given as (start position, length)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.arange(p, p + n) for p, n in segments])
    n = len(pos)
    offsets = torch.tensor([0] + [sum(s[1] for s in segments[:i + 1]) for i in range(len(segments))])
    return Chunk(
        meta=ChunkMeta(chunk_id=chunk_id, target_model="tiny", worker_id="w0", draft_version="v3",
                       workload="chat", created_at=1700000000.25),
        input_ids=torch.randint(0, 100, (n,), generator=g, dtype=torch.int64).to(torch.int32),
        positions=pos, segment_offsets=offsets, loss_mask=torch.ones(n, dtype=torch.uint8),
        aux=torch.randn(n, 3 * T, generator=g).bfloat16(), final=torch.randn(n, T, generator=g).bfloat16())


def raw_blob(chunk: Chunk, metadata=None, **tensor_changes) -> bytes:
    """Serialise without validation, to build invalid blobs."""
    tensors = {**chunk.tensors(), **tensor_changes}
    tensors = {k: v for k, v in tensors.items() if v is not None}
    return save(tensors, metadata=metadata if metadata is not None else chunk.meta.to_header())


def test_round_trip():
    chunk = make_chunk()
    blob = encode_chunk(chunk)
    back = decode_chunk(blob, expected_target="tiny")
    assert back.meta == chunk.meta
    for name, t in chunk.tensors().items():
        got = getattr(back, name)
        assert got.dtype == t.dtype and torch.equal(got, t), name
    assert back.segments() == [(0, 5), (5, 9)]
    assert back.num_tokens == 9 and back.num_segments == 2
    # The checksum is of the blob as uploaded (safetensors writes metadata keys in no fixed order,
    # so two encodings of one chunk may differ byte-wise).
    assert sha256(blob) == hashlib.sha256(blob).hexdigest()


def test_blob_is_safetensors_not_pickle(monkeypatch):
    blob = encode_chunk(make_chunk())
    (n,) = struct.unpack("<Q", blob[:8])
    assert blob[8:9] == b"{" and n < 4096  # a JSON header, then raw tensor bytes

    def no_pickle(*a, **k):
        raise AssertionError("pickle used")

    monkeypatch.setattr(pickle, "loads", no_pickle)
    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "Unpickler", no_pickle)
    decode_chunk(blob)
    monkeypatch.undo()
    buf = io.BytesIO()
    torch.save(make_chunk().tensors(), buf)  # a pickle-based blob is refused, not executed
    with pytest.raises(ChunkInvalid):
        decode_chunk(buf.getvalue())


BAD_TENSORS = [
    ({"aux": make_chunk().aux.float()}, "aux has dtype"),
    ({"final": make_chunk().final.half()}, "final has dtype"),
    ({"input_ids": make_chunk().input_ids.float()}, "input_ids has dtype"),
    ({"loss_mask": torch.ones(9, dtype=torch.int64)}, "loss_mask has dtype"),
    ({"positions": torch.arange(8)}, "positions has shape"),
    ({"aux": torch.zeros(9, 2 * T, dtype=torch.bfloat16)}, "aux has shape"),
    ({"final": torch.zeros(9, dtype=torch.bfloat16)}, "final has shape"),
    ({"segment_offsets": torch.tensor([1, 5, 9])}, "segment_offsets must rise"),
    ({"segment_offsets": torch.tensor([0, 5, 8])}, "segment_offsets must rise"),
    ({"segment_offsets": torch.tensor([0, 5, 5, 9])}, "segment_offsets must rise"),
    ({"positions": torch.tensor([0, 1, 2, 4, 5, 17, 18, 19, 20])}, "not consecutive inside a segment"),
    ({"positions": torch.tensor([-1, 0, 1, 2, 3, 17, 18, 19, 20])}, "negative position"),
    ({"input_ids": torch.full((9,), -3, dtype=torch.int32)}, "negative token id"),
    ({"loss_mask": torch.full((9,), 2, dtype=torch.uint8)}, "loss_mask holds values"),
    ({"aux": make_chunk().aux.index_fill(0, torch.tensor([3]), float("nan"))}, "aux has non-finite"),
    ({"final": make_chunk().final.index_fill(0, torch.tensor([8]), float("inf"))}, "final has non-finite"),
    ({"loss_mask": None}, "tensors"),
    ({"extra": torch.zeros(1)}, "tensors"),
]


@pytest.mark.parametrize("changes, problem", BAD_TENSORS)
def test_bad_tensors_are_refused_naming_the_chunk(changes, problem):
    blob = raw_blob(make_chunk(), **changes)
    with pytest.raises(ChunkInvalid, match=problem) as e:
        decode_chunk(blob)
    assert e.value.chunk_id == "c-1" and str(e.value).startswith("chunk c-1: ")


@pytest.mark.parametrize("meta_change, problem", [
    ({"tide.format_version": "2"}, "format version 2"),
    ({"tide.chunk_id": ""}, "empty chunk id"),
    ({"tide.created_at": "yesterday"}, "bad metadata"),
    ({"tide.target_model": None}, "bad metadata"),
])
def test_bad_metadata_is_refused(meta_change, problem):
    meta = {**make_chunk().meta.to_header(), **meta_change}
    with pytest.raises(ChunkInvalid, match=problem):
        decode_chunk(raw_blob(make_chunk(), metadata={k: v for k, v in meta.items() if v is not None}))


def test_wrong_target_model_is_refused():
    blob = encode_chunk(make_chunk())
    with pytest.raises(ChunkInvalid, match="target model 'tiny', expected 'other'"):
        decode_chunk(blob, expected_target="other")


@pytest.mark.parametrize("mangle, problem", [
    (lambda b: b[:5], "too short"),
    (lambda b: struct.pack("<Q", 1 << 40) + b[8:], "header length"),
    (lambda b: b[:8] + b"!" + b[9:], "not JSON"),
    (lambda b: b[:-10], "unreadable tensors"),
])
def test_corrupt_blobs_are_refused(mangle, problem):
    with pytest.raises(ChunkInvalid, match=problem):
        decode_chunk(mangle(encode_chunk(make_chunk())))


def test_encode_refuses_an_invalid_chunk():
    chunk = make_chunk()
    chunk.positions = chunk.positions.flip(0)
    with pytest.raises(ChunkInvalid, match="not consecutive"):
        encode_chunk(chunk)


def rows(seq_start: int, n: int, token_base: int):
    ids = torch.arange(token_base, token_base + n)
    pos = torch.arange(seq_start, seq_start + n)
    aux = (ids[:, None] * torch.ones(3 * T)).bfloat16()  # each row's aux names its token
    return ids, pos, aux, aux[:, :T].clone()


def test_builder_groups_interleaved_rows_into_segments():
    b = ChunkBuilder(capacity=32, hidden_size=T, target_model="tiny", worker_id="w1")
    cursor = {"a": 0, "b": 0, "c": 10}
    base = {"a": 100, "b": 150, "c": 200}  # < 256: exact in bf16
    for step_tokens in [(3, 1, 2), (1, 2, 1), (2, 2, 1)]:  # accepted tokens per sequence per step
        for key, n in zip("abc", step_tokens, strict=True):
            ids, pos, aux, final = rows(cursor[key], n, base[key] + cursor[key])
            assert b.append(key, ids, pos, aux, final, loss_mask=[0] * n if key == "c" else None) == n
            cursor[key] += n
    chunk = b.flush(draft_version="v1", workload="code")
    assert b.num_tokens == 0 and b.flush() is None
    assert chunk.segments() == [(0, 6), (6, 11), (11, 15)]
    assert chunk.positions.tolist() == [*range(6), *range(5), *range(10, 14)]
    assert chunk.input_ids.tolist() == [*range(100, 106), *range(150, 155), *range(210, 214)]
    assert torch.equal(chunk.aux[:, 0].long(), chunk.input_ids)  # rows moved with their tokens
    assert chunk.loss_mask.tolist() == [1] * 11 + [0] * 4
    assert (chunk.meta.target_model, chunk.meta.worker_id, chunk.meta.draft_version) == ("tiny", "w1", "v1")
    decode_chunk(encode_chunk(chunk), expected_target="tiny")


def test_builder_capacity_and_continuation_across_flushes():
    b = ChunkBuilder(capacity=5, hidden_size=T, target_model="tiny")
    ids, pos, aux, final = rows(0, 8, 0)
    took = b.append("a", ids, pos, aux, final)
    assert took == 5 and b.free == 0 and b.append("a", ids[5:], pos[5:], aux[5:], final[5:]) == 0
    first = b.flush()
    assert b.append("a", ids[took:], pos[took:], aux[took:], final[took:]) == 3
    second = b.flush()
    assert first.positions.tolist() == [0, 1, 2, 3, 4] and second.positions.tolist() == [5, 6, 7]
    assert first.meta.chunk_id != second.meta.chunk_id


def test_builder_splits_a_sequence_at_a_position_gap():
    b = ChunkBuilder(capacity=16, hidden_size=T, target_model="tiny")
    for start in (0, 7):  # rows 3..6 of the sequence were never exported
        ids, pos, aux, final = rows(start, 3, start)
        b.append("a", ids, pos, aux, final)
    assert b.flush().segments() == [(0, 3), (3, 6)]

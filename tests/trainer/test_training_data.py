"""Training data: sources, validation and dedupe, split, batch plans, prefetch."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from services.trainer.training.data import (
    collate,
    load_dataset,
    local_source,
    plan_batches,
    prefetch,
    s3_source,
    split,
)
from services.trainer.training.head import TargetHead, greedy_dtype


@pytest.fixture(scope="module")
def head(copy_target):
    return TargetHead.load(copy_target)


def test_local_source_reads_files_in_order(tmp_path):
    (tmp_path / "b").write_bytes(b"2")
    (tmp_path / "a").write_bytes(b"1")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c").write_bytes(b"3")
    (tmp_path / ".partial").write_bytes(b"x")  # an upload in progress
    assert list(local_source(tmp_path)) == [b"1", b"2", b"3"]


def test_invalid_foreign_and_duplicate_chunks_are_never_trained_on(head, copy_chunks, wide_chunks):
    good = copy_chunks[:2]
    corrupt = copy_chunks[2][:-100]
    data = load_dataset([good[0], corrupt, good[0], good[1]], head, max_len=64, expected_target="tiny-llama")
    assert data.chunk_ids == ["test-1-0", "test-1-1"]  # the duplicate is read once
    assert len(data.rejected) == 1 and "unreadable" in data.rejected[0][1]
    foreign = load_dataset(good, head, max_len=64, expected_target="other-model")
    assert not foreign.pieces and len(foreign.rejected) == 2 and "expected 'other-model'" in foreign.rejected[0][1]
    again = load_dataset(good, head, max_len=64, skip_ids=["test-1-0"])  # already trained on
    assert again.chunk_ids == ["test-1-1"]


def _engine_logits(head, final):
    """The lm_head as the engine serves it in the default dtype (tide.engine.llama's head)."""
    from tide.engine.llama import logits_head, vocab_logits

    dtype = greedy_dtype()
    return vocab_logits(final.to(dtype), logits_head(head.lm_head.to(dtype)))


def test_pieces_hold_rows_and_the_targets_greedy_tokens(head, copy_chunks):
    data = load_dataset(copy_chunks[:1], head, max_len=16)
    assert all(2 <= len(p) <= 16 for p in data.pieces)
    p = data.pieces[0]
    logits = _engine_logits(head, p.final)
    learn = p.loss_mask  # greedy tokens are computed where they are read: on learnable rows
    assert learn.any() and not learn.all()
    assert torch.equal(p.greedy[learn], logits.argmax(-1)[learn])
    assert not p.greedy[~learn].any()  # prompt rows are not labelled (0), as documented
    assert p.aux.dtype == torch.bfloat16 and p.aux.shape == (len(p), 3 * head.hidden_size)
    # copy target: the greedy continuation repeats, and the data is that continuation
    gen = p.loss_mask[:-1]
    assert torch.equal(p.input_ids[1:][gen], p.greedy[:-1][gen])


def test_prompt_rows_can_be_learnt_with_the_targets_labels(head, copy_chunks):
    """--learn-prompt-rows: prompt rows become learnable and carry the target's own greedy token
    there (not the prompt's next token); the rows and their order are unchanged."""
    plain = load_dataset(copy_chunks[:1], head, max_len=16)
    full = load_dataset(copy_chunks[:1], head, max_len=16, learn_prompt_rows=True)
    assert [len(p) for p in full.pieces] == [len(p) for p in plain.pieces]
    for a, b in zip(plain.pieces, full.pieces, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and b.loss_mask.all()
        assert torch.equal(b.greedy, _engine_logits(head, b.final).argmax(-1))
        assert torch.equal(b.greedy[a.loss_mask], a.greedy[a.loss_mask])
    prompt = ~plain.pieces[0].loss_mask
    assert prompt.any() and full.pieces[0].greedy[prompt].any()


def test_split_is_by_chunk_and_deterministic(head, copy_chunks):
    data = load_dataset(copy_chunks, head, max_len=64)
    a, b = split(data, 0.3, seed=0)
    a2, b2 = split(data, 0.3, seed=0)
    assert a.chunk_ids == a2.chunk_ids and b.chunk_ids == b2.chunk_ids
    assert b.chunk_ids and a.chunk_ids and set(a.chunk_ids).isdisjoint(b.chunk_ids)
    assert sorted(a.chunk_ids + b.chunk_ids) == sorted(data.chunk_ids)
    assert all(p.chunk_id in b.chunk_ids for p in b.pieces)
    assert len(a.pieces) + len(b.pieces) == len(data.pieces)


def test_batch_plan_packs_every_piece_once_per_epoch():
    lengths = [5, 9, 3, 16, 7, 2, 11, 4, 8, 6]
    plan = plan_batches(lengths, batch_rows=2, max_len=16, seed=1, epoch=0)
    used = [i for batch in plan for row in batch for i in row]
    assert sorted(used) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 16 for batch in plan for row in batch)
    assert all(len(batch) <= 2 for batch in plan)
    assert plan == plan_batches(lengths, 2, 16, seed=1, epoch=0)
    assert plan != plan_batches(lengths, 2, 16, seed=1, epoch=1)


def test_collate_marks_pieces_and_padding(head, copy_chunks):
    data = load_dataset(copy_chunks[:1], head, max_len=8)
    batch = collate(data.pieces, [[0, 1], [2]])
    n0, n1, n2 = (len(data.pieces[i]) for i in range(3))
    assert batch.seg[0, :n0].eq(0).all() and batch.seg[0, n0:n0 + n1].eq(1).all()
    assert batch.seg[1, :n2].eq(2).all() and batch.seg[1, n2:].eq(-1).all()
    assert batch.num_tokens == n0 + n1 + n2
    assert torch.equal(batch.aux[0, n0:n0 + n1], data.pieces[1].aux)


def test_prefetch_keeps_order_raises_and_stops():
    assert list(prefetch(range(10), depth=2, fn=lambda x: x * x)) == [x * x for x in range(10)]

    def broken():
        yield 1
        raise RuntimeError("source failed")

    with pytest.raises(RuntimeError, match="source failed"):
        list(prefetch(broken()))
    produced = []

    def endless():
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1

    it = prefetch(endless(), depth=2)
    assert next(it) == 0
    it.close()  # consumer stops early: the thread must stop too
    time.sleep(0.5)
    n = len(produced)
    time.sleep(0.3)
    assert len(produced) == n < 10
    assert not [t for t in threading.enumerate() if t.name == "tide-prefetch" and t.is_alive()]
    # closing waits for a worker busy on an item: one left running into interpreter exit inside a
    # torch op aborted pytest's process (SIGABRT, "terminate called without an active exception")
    it = prefetch(range(5), depth=1, fn=lambda x: time.sleep(0.3) or x)
    assert next(it) == 0
    it.close()
    assert not [t for t in threading.enumerate() if t.name == "tide-prefetch" and t.is_alive()]


def test_s3_source_reads_verified_chunks(s3_client, s3_bucket, copy_chunks, head):
    from tide import blobs

    for i, blob in enumerate(copy_chunks[:3]):
        blobs.put_bytes(s3_client, s3_bucket, f"chunks/tiny/{i:03d}", blob)
    blobs.put_bytes(s3_client, s3_bucket, "elsewhere/x", b"not a chunk")
    got = list(s3_source(f"s3://{s3_bucket}/chunks/", client=s3_client))
    assert got == copy_chunks[:3]
    data = load_dataset(s3_source(f"s3://{s3_bucket}/chunks/", client=s3_client), head, max_len=64)
    assert data.chunk_ids == ["test-1-0", "test-1-1", "test-1-2"] and not data.rejected

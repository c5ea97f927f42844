"""End to end: train_draft from chunk files, export, fine-tune; the target's layers are never read;
the evaluator's parallel chains equal drafting one token at a time."""

from __future__ import annotations

import json

import safetensors
import torch
import torch.nn.functional as F

from services.trainer.training.data import load_dataset
from services.trainer.training.evaluate import evaluate
from services.trainer.training.export import read_record
from services.trainer.training.head import TargetHead, draft_vocab_from_counts
from services.trainer.training.loop import TrainConfig, train
from services.trainer.training.run import build_draft, train_draft
from tide.eagle3 import load_checkpoint, validate_checkpoint_dir
from tide.engine import llama

CFG = TrainConfig(steps=6, batch_rows=4, max_len=64, warmup_steps=2, log_every=3, progress=False)


def write_chunks(blobs, path):
    path.mkdir()
    for i, blob in enumerate(blobs):
        (path / f"chunk-{i:03d}.safetensors").write_bytes(blob)
    return path


def test_train_export_and_fine_tune_never_touch_decoder_layers(copy_target, copy_chunks, tmp_path, monkeypatch):
    read: list[str] = []
    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            read.append(name)
            return self.f.get_slice(name)

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    def forbidden(*args, **kwargs):
        raise AssertionError("the trainer loaded the target model")

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    monkeypatch.setattr(llama.LlamaModel, "load", forbidden)
    monkeypatch.setattr(safetensors.torch, "load_file", _guard(safetensors.torch.load_file, copy_target.path))

    data_dir = write_chunks(copy_chunks, tmp_path / "chunks")
    out = tmp_path / "draft-1"
    summary = train_draft(copy_target.path, str(data_dir), out, cfg=CFG, draft_vocab_size=32)
    assert read and not [n for n in read if n.startswith("model.layers.")]
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(read)

    cfg = validate_checkpoint_dir(out)
    assert cfg.draft_vocab_size == 32 and cfg.aux_layers == (1, 3, 4)
    record = read_record(out)
    assert set(record["chunk_ids"]).isdisjoint(summary["eval_chunk_ids"]) and record["chunk_ids"]
    assert record["evaluation"]["candidate"]["acceptance"]["3"] >= 1.0
    assert record["parent"] is None and record["args"]["steps"] == 6
    assert json.loads((out / "config.json").read_text())["tide"]["target_model"] == copy_target.path.name

    fine = train_draft(copy_target.path, str(data_dir), tmp_path / "draft-2", init=out, cfg=CFG)
    assert fine["baseline"] is not None and fine["candidate"] is not None
    head = TargetHead.load(copy_target)
    a = load_checkpoint(out, head.embed, head.config)
    b = load_checkpoint(tmp_path / "draft-2", head.embed, head.config)
    assert torch.equal(a.d2t, b.d2t)  # fine-tuning keeps the vocabulary
    assert not torch.equal(a.fc.weight, b.fc.weight)
    assert read_record(tmp_path / "draft-2")["parent"] == str(out)
    assert not [n for n in read if n.startswith("model.layers.")]


def _guard(load_file, target_dir):
    def guarded(path, *args, **kwargs):
        assert not str(path).startswith(str(target_dir)), "read the target's whole weights file"
        return load_file(path, *args, **kwargs)
    return guarded


def test_vocabulary_from_counts():
    from collections import Counter

    d2t, t2d = draft_vocab_from_counts(Counter({7: 5, 3: 5, 9: 1, 1: 9}), 3, 12)
    assert (torch.arange(3) + d2t).tolist() == [1, 3, 7]  # most frequent, ties to the smaller id, sorted
    assert t2d.nonzero().flatten().tolist() == [1, 3, 7]
    d2t, _ = draft_vocab_from_counts(Counter({5: 1}), 4, 12)
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 2, 5]  # filled with the smallest unseen ids


def test_new_draft_starts_from_the_targets_head(copy_target, copy_chunks):
    head = TargetHead.load(copy_target)
    data = load_dataset(copy_chunks, head, max_len=64)
    draft = build_draft(head, data, draft_vocab_size=16)
    kept = torch.arange(16) + draft.d2t
    assert torch.equal(draft.lm_head.weight, head.lm_head[kept])
    assert torch.equal(draft.norm.weight, head.norm)
    greedy = torch.cat([p.greedy[p.loss_mask] for p in data.pieces])
    top = torch.bincount(greedy, minlength=head.vocab_size).argsort(descending=True)[:8]
    assert draft.t2d[top].all()  # the most frequent greedy tokens are in the vocabulary


class ChainCache:
    """The engine's view of one chain: the draft's step-0 keys of rows 0..r, then its own."""

    def __init__(self, k, v):
        self.k, self.v = [k], [v]

    def __call__(self, q, k, v):
        self.k.append(k)
        self.v.append(v)
        return F.scaled_dot_product_attention(q, torch.cat(self.k, 2), torch.cat(self.v, 2), enable_gqa=True)


def test_evaluator_equals_drafting_one_token_at_a_time(wide_target, wide_chunks):
    head = TargetHead.load(wide_target)
    data = load_dataset(wide_chunks[:1], head, max_len=64)
    data.pieces = data.pieces[:1]
    draft = build_draft(head, data, draft_vocab_size=64, seed=5)
    train_steps = TrainConfig(steps=30, batch_rows=1, max_len=64, lr=3e-3, warmup_steps=1, progress=False)
    train(draft, head, data, train_steps)  # memorise part of the piece: some chains right, some wrong
    with torch.no_grad():  # sharpen attention so that which keys a chain sees changes its tokens
        draft.midlayer.self_attn.q_proj.weight.mul_(4.0)
        draft.midlayer.self_attn.k_proj.weight.mul_(4.0)
    result = evaluate(draft, data, head, gammas=(1, 2, 3), max_len=64)
    piece, G = data.pieces[0], 3
    n = len(piece)
    base: list = []

    def record(q, k, v):
        base.append((k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    totals, starts = {1: 0, 2: 0, 3: 0}, 0
    with torch.no_grad():
        h0 = draft.project(piece.aux[None])
        next_tokens = torch.cat([piece.input_ids[1:], piece.input_ids[:1]])[None]  # x_{r+1} at row r
        draft.step(next_tokens, h0, piece.positions[None], record)
        (bk, bv), = base
        for r in range(n - G):
            if piece.positions[r] == 0 or not piece.loss_mask[r + 1]:
                continue
            starts += 1
            # token 1: row r again over rows 0..r; tokens 2..: rows 0..r plus the chain's own keys
            cache = ChainCache(bk[:, :, :r + 1], bv[:, :, :r + 1])
            hidden, tok, run, alive = h0[:, r:r + 1], next_tokens[:, r:r + 1], 0, True
            for j in range(G):
                attend = _rows_up_to(bk, bv, r) if j == 0 else cache
                hidden = draft.step(tok, hidden, piece.positions[None, r:r + 1] + j, attend)
                tok = draft.to_target_ids(draft.logits(hidden).argmax(-1))
                # the stored state of row r+1+j continues the chain only if the data took the
                # greedy token there (bf16 rounding of `final` flips a near-tie argmax now and then)
                checkable = j == 0 or int(piece.input_ids[r + 1 + j]) == int(piece.greedy[r + j])
                alive = alive and checkable and int(tok) == int(piece.greedy[r + 1 + j])
                run += alive
                if j + 1 in totals:
                    totals[j + 1] += run + 1
    assert result.chains == starts and starts > 20
    assert 1.0 < result.acceptance[3] < 4.0  # a mix of hits and misses, so the comparison means something
    for g in (1, 2, 3):
        assert abs(result.acceptance[g] - totals[g] / starts) < 1e-6, (g, result.acceptance, totals)


def _rows_up_to(bk, bv, r):
    return lambda q, k, v: F.scaled_dot_product_attention(q, bk[:, :, :r + 1], bv[:, :, :r + 1], enable_gqa=True)

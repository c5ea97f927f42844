"""Greedy generation with hidden-state capture, as the workers capture it: the data of `tide draft
bootstrap` and `tide draft eval` (engine set-up, prompt encoding, continuous generation of prompt
groups, and the per-sequence chunk sink)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from tide.chunks import ChunkBuilder, encode_chunk, learnable_rows
from tide.prompts import Prompt, encode_prompt, load_prompts


def prompt_key(p: Prompt) -> str:
    return hashlib.sha256(f"{p.source}\0{p.chat}\0{p.text}".encode()).hexdigest()[:16]


def load_prompt_files(files: Iterable, limit: int | None = None) -> list[Prompt]:
    """Prompts of every file (see tide.prompts), duplicates dropped, at most `limit` per file."""
    seen, out = set(), []
    for f in files:
        for p in load_prompts(f, limit):
            k = prompt_key(p)
            if k not in seen:
                seen.add(k)
                out.append(p)
    return out


def progress_bar(total, desc: str, unit: str, enabled: bool, initial: int = 0):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=not enabled, dynamic_ncols=True)


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Set torch's intra-op threads for the block (None: leave as is)."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class SequenceChunks:
    """Capture listener turning engine rows into chunk blobs, one whole sequence at a time.

    Rows are collected per request while the engine runs; `close(request_ids)` appends each
    finished sequence's rows, in order, to a `ChunkBuilder` (a new chunk starts when a sequence
    does not fit the current one; longer sequences are split) and returns the encoded chunks with
    deterministic ids `<prefix>-<k>` (a rerun of the same group rewrites the same files)."""

    def __init__(self, hidden_size: int, target_model: str, chunk_tokens: int = 2048, worker_id: str = "bootstrap",
                 workload: str = "bootstrap") -> None:
        self.builder = ChunkBuilder(chunk_tokens, hidden_size, target_model, worker_id)
        self.workload = workload
        self.rows: dict[str, list] = {}
        self.prompt_lens: dict[str, int] = {}

    def __call__(self, rows) -> None:  # engine capture listener (CapturedRows)
        for r in rows:
            self.prompt_lens[r.request_id] = r.num_prompt
            self.rows.setdefault(r.request_id, []).append(
                (r.start, list(r.token_ids), r.aux.to("cpu", torch.bfloat16, copy=True),
                 r.final.to("cpu", torch.bfloat16, copy=True)))

    def close(self, request_ids: list[str], prefix: str) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []

        def flush() -> None:
            chunk = self.builder.flush(workload=self.workload, chunk_id=f"{prefix}-{len(out)}")
            if chunk is not None:
                out.append((chunk.meta.chunk_id, encode_chunk(chunk)))

        for rid in request_ids:
            parts = sorted(self.rows.pop(rid, []), key=lambda p: p[0])
            if not parts:
                continue
            start = parts[0][0]
            ids = [t for p in parts for t in p[1]]
            aux = torch.cat([p[2] for p in parts])
            final = torch.cat([p[3] for p in parts])
            pos, mask = learnable_rows(start, len(ids), self.prompt_lens.pop(rid, 0))
            if len(ids) > self.builder.free and self.builder.num_tokens:
                flush()
            done = 0
            while done < len(ids):
                done += self.builder.append(rid, ids[done:], pos[done:], aux[done:], final[done:], mask[done:])
                if self.builder.free == 0:
                    flush()
        flush()
        return out


@dataclass
class GroupResult:
    keys: list[str]
    chunks: list[tuple[str, bytes]]
    output_tokens: list[int]  # per prompt
    seconds: float
    verify_steps: int = 0
    accepted_tokens: int = 0


def generate_groups(engine, sink: SequenceChunks, groups: Iterable[list[tuple[str, list[int]]]], max_tokens: int,
                    speculative: bool = False, on_done: Callable[[int], None] | None = None,
                    admit: Callable[[], bool] = lambda: True,
                    cut: Callable[[], bool] = lambda: False) -> Iterator[GroupResult]:
    """Greedy continuations of each group's items ((key, prompt ids)), groups back to back in one
    continuous batch: the next group joins as soon as the engine has a free slot and nothing
    waiting, so one group's tail (its last, longest sequences) overlaps the next group's start
    instead of leaving slots idle. Yields each group's result when its last sequence finishes
    (chunk ids from the group's keys, so a rerun rewrites the same files); `admit()` is asked
    before each new group joins (False: no more groups; those running still finish).
    `cut()` is asked before each engine step: True cancels every running sequence, and their
    groups are yielded with the tokens generated so far (a greedy prefix is as good training data
    as a whole continuation; the rows captured are exactly the tokens the target processed), and
    no group joins after. `on_done(n)`: n more sequences finished (progress bars)."""
    from tide.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=max_tokens)
    pending, running = iter(groups), []  # running: (prefix, items, seqs, t0)
    more = True
    while True:
        sched = engine.scheduler
        if more and not sched.waiting and len(sched.active) < sched.max_batch:
            items = next(pending, None) if admit() else None
            if items is None:
                more = False
            elif not items:
                continue
            else:
                prefix = group_prefix([k for k, _ in items])
                seqs = [engine.add_request(f"{prefix}/{i}", ids, params, speculative, workload=sink.workload)
                        for i, (_, ids) in enumerate(items)]
                running.append((prefix, items, seqs, time.perf_counter()))
                continue
        if not running:
            return
        before = sum(s.status.is_finished() for _, _, seqs, _ in running for s in seqs)
        if cut():
            more = False
            for _, _, seqs, _ in running:
                for s in seqs:
                    if not s.status.is_finished():
                        engine.cancel(s.request_id)
        if engine.has_work():
            engine.step()
        after = sum(s.status.is_finished() for _, _, seqs, _ in running for s in seqs)
        if after > before and on_done is not None:
            on_done(after - before)
        for group in [g for g in running if all(s.status.is_finished() for s in g[2])]:
            running.remove(group)
            prefix, items, seqs, t0 = group
            yield GroupResult(
                keys=[k for k, _ in items], chunks=sink.close([s.request_id for s in seqs], prefix),
                output_tokens=[s.num_output for s in seqs], seconds=time.perf_counter() - t0,
                verify_steps=sum(s.verify_steps for s in seqs), accepted_tokens=sum(s.accepted_tokens for s in seqs))


def write_chunks(directory: Path, chunks: Iterable[tuple[str, bytes]]) -> list[str]:
    """Each (chunk id, blob) of `GroupResult.chunks` as `<id>.safetensors` in `directory` (`write_blob`);
    returns the file names, in order."""
    return [write_blob(Path(directory), f"{cid}.safetensors", blob).name for cid, blob in chunks]


def write_blob(directory: Path, name: str, data: bytes) -> Path:
    """Atomic write (temp file + rename): a crash never leaves a half-written chunk under `name`."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    path = directory / name
    os.replace(tmp, path)
    return path


def group_prefix(keys: list[str]) -> str:
    return "boot-" + hashlib.sha256("\0".join(keys).encode()).hexdigest()[:12]


def encode_prompts(tokenizer, prompts: list[Prompt], max_prompt_tokens: int) -> tuple[list[tuple[str, list[int]]], int]:
    """[(key, ids)] of the prompts that fit `max_prompt_tokens`, and how many were too long."""
    out, skipped = [], 0
    for p in prompts:
        ids = encode_prompt(tokenizer, p)
        if not ids or len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        out.append((prompt_key(p), ids))
    return out, skipped


# Prompts are grouped by length within windows of this many groups. Decode attention reads every
# sequence's keys up to the longest context in the batch, so batch mates of similar prompt length
# waste less of it: on the bootstrap's prompt mix (reference model, 150 s each, one run) batch 32
# made 179 tokens/s unsorted and 201 sorted in windows of 8 groups; batch 64, 233 with windows of
# 2 groups or of 8. Small windows keep generation in the seeded shuffle's order: when the budget
# ends inside a window, its longest prompts are the ones left out, so 2 groups bias little.
LENGTH_SORT_WINDOW = 2


def length_sorted_groups(items: list[tuple[str, list[int]]], group: int,
                         window: int = LENGTH_SORT_WINDOW) -> Iterator[list[tuple[str, list[int]]]]:
    """Groups of `group` consecutive items ((key, prompt ids)), sorted by prompt length within
    each window of `window` groups (a stable sort: the same items give the same groups)."""
    for a in range(0, len(items), group * window):
        part = sorted(items[a:a + group * window], key=lambda kv: len(kv[1]))
        for b in range(0, len(part), group):
            yield part[b:b + group]


def make_engine(model, batch: int, max_prompt_tokens: int, max_tokens: int, drafter=None, gamma: int = 0):
    from tide.engine.engine import EngineConfig, LLMEngine
    from tide.policies import FixedGamma

    max_len = min(max_prompt_tokens + max_tokens + 1, model.cfg.max_position_embeddings)
    cfg = EngineConfig(max_batch=batch, max_seq_len=max_len, max_gamma=max(gamma, 1), worker_id="bootstrap")
    return LLMEngine(model, cfg, drafter=drafter, policy=FixedGamma(gamma))


def capturing_engine(model, target_model: str, batch: int, max_prompt_tokens: int, max_tokens: int, *,
                     drafter=None, gamma: int = 0, chunk_tokens: int = 2048,
                     workload: str = "bootstrap") -> tuple:
    """`make_engine`'s engine with a `SequenceChunks` sink listening to its committed rows, as an
    inference worker captures them: (engine, sink), what `generate_groups` takes."""
    engine = make_engine(model, batch, max_prompt_tokens, max_tokens, drafter, gamma)
    sink = SequenceChunks(model.cfg.hidden_size, target_model, chunk_tokens, workload=workload)
    engine.capture_listeners.append(sink)
    return engine, sink

"""A training run's memory is bounded by TIDE_TRAINER_MEMORY_MB: it takes the oldest buffered chunks
that fit (the rest stay buffered) and does not start where the target's fixed part alone does not."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from services.trainer.cycle import FAILED, TrainingCycle
from services.trainer.drafts import BaseDraft
from services.trainer.manifest import ManifestEntry
from services.trainer.memory_budget import MiB, run_memory, take_within
from services.trainer.settings import TrainerSettings
from tide.target import resolve_target


def _entry(i: int, tokens: int, target: str) -> ManifestEntry:
    return ManifestEntry(f"c{i}", "b", f"k{i}", "0" * 64, 10, tokens, target, "", "", "", float(i), float(i))


def _cycle(tiny_dir, memory_mb: int, seen: list) -> TrainingCycle:
    settings = TrainerSettings(target=str(tiny_dir), memory_mb=memory_mb, replay=0, eval_history_tokens=0)
    registry = SimpleNamespace(base=lambda target: BaseDraft("", "", False, None))
    cycle = TrainingCycle(settings, None, SimpleNamespace(), registry)
    cycle._blobs = lambda entries, extra=(): seen.append([e.chunk_id for e in entries]) or iter(())
    return cycle


def _train(*args, **kwargs):
    raise RuntimeError("stopped after the data was chosen")  # the test looks only at what it was given


def test_the_fixed_part_grows_with_the_target_and_a_token_with_its_hidden_size():
    ref = run_memory({"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                      "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True},
                     8192, batch_rows=8, max_len=512)
    big = run_memory({"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                      "num_attention_heads": 32, "num_key_value_heads": 8}, 8192, batch_rows=8, max_len=512)
    assert ref.per_token_bytes == 8 * 576 + 25 and big.per_token_bytes == 8 * 4096 + 25
    assert 1 * 2**30 < ref.fixed_bytes < 4 * 2**30  # the reference draft trains beside its worker on a small machine
    assert big.fixed_bytes > 4 * ref.fixed_bytes  # an 8B target's head and draft: far more
    assert ref.parts["target head"] < big.parts["target head"] and sum(big.parts.values()) == big.fixed_bytes
    assert big.max_tokens(big.fixed_bytes - 1) == 0 and ref.max_tokens(ref.fixed_bytes + 10 * ref.per_token_bytes) == 10


def test_take_within_keeps_the_oldest_that_fit():
    entries = [_entry(i, 100, "t") for i in range(4)]
    assert [e.chunk_id for e in take_within(entries, 250)] == ["c0", "c1"]
    assert take_within(entries, 99) == []


def test_a_run_takes_the_oldest_chunks_its_budget_holds(tiny_dir):
    target = str(tiny_dir)
    need = run_memory(resolve_target(target).config, 8192, 8, 512)
    tokens = 100_000
    chunk = tokens * need.per_token_bytes
    seen: list = []
    cycle = _cycle(tiny_dir, math.ceil((need.fixed_bytes + 2.5 * chunk) / MiB), seen)
    entries = [_entry(i, tokens, target) for i in range(4)]
    result = cycle.run("run-a", target, entries, "test", _train, lambda **kw: SimpleNamespace(**kw))
    assert seen == [["c0", "c1"]]  # two fit; c2 and c3 stay buffered (no run record names them)
    assert result.result == FAILED and "stopped after the data was chosen" in result.outcome.detail


@pytest.mark.parametrize("over", [False, True])
def test_a_run_whose_fixed_part_does_not_fit_is_not_started(tiny_dir, over):
    target = str(tiny_dir)
    need = run_memory(resolve_target(target).config, 8192, 8, 512)
    seen: list = []
    budget_mb = need.fixed_bytes // MiB if over else math.ceil((need.fixed_bytes + 10 * need.per_token_bytes) / MiB)
    cycle = _cycle(tiny_dir, budget_mb, seen)
    result = cycle.run("run-b", target, [_entry(0, 10**9 if not over else 10, target)], "test", _train,
                       lambda **kw: SimpleNamespace(**kw))
    assert seen == [] and result.result == FAILED
    assert "TIDE_TRAINER_MEMORY_MB" in result.outcome.detail and "stay buffered" in result.outcome.detail

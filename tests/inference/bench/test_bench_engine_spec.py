"""`tide bench engine`'s speculation rows (#30's interface) on the tiny target: every row of a batch
decodes every prompt (greedy, so each decodes the same tokens), one adaptive row per batch."""

from __future__ import annotations

import random

from support.engine import tiny_eagle3_drafter

from benchmarks.engine import spec_sweep
from tide.engine.profiling import profile_latency


def test_rows_cover_every_configuration_and_decode_every_prompt(tiny_model):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 96) for _ in range(4)] * 3 for _ in range(5)]
    eagle = tiny_eagle3_drafter(tiny_model, max_batch=4, max_len=2100)
    profile = profile_latency(tiny_model, eagle, [1, 4], [1, 2, 3], reps=1)
    rows = spec_sweep(tiny_model, eagle, prompts, [1, 4], [0, 2], ["ngram", "hybrid"], 12, profile)
    for b in (1, 4):
        mine = [r for r in rows if r["batch"] == b]
        assert [(r["drafter"], r["gamma"], r.get("policy")) for r in mine] == [
            ("none", 0, None), ("ngram", 2, None), ("hybrid", 2, None), ("hybrid", None, "adaptive")]
        assert all(r["tree"] is None and r["tok_s"] > 0 and r["accept_length"] >= 1.0 for r in mine)
        assert {r["output_tokens"] for r in mine} == {mine[0]["output_tokens"]}  # the same decode each time
        assert mine[0]["output_tokens"] > 5 * 4  # every prompt decoded, not just one
        assert mine[1]["accept_length"] > 1.0  # the repeated prompts gave the n-gram copies to accept


def test_the_hybrid_with_a_memory_recalls_the_runs_earlier_requests(tiny_model):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 96) for _ in range(10)] for _ in range(2)] * 2  # each prompt twice
    eagle = tiny_eagle3_drafter(tiny_model, max_batch=1, max_len=2100)
    profile = profile_latency(tiny_model, eagle, [1], [1, 2, 3], reps=1)
    rows = spec_sweep(tiny_model, eagle, prompts, [1], [2], ["hybrid", "hybrid+memory"], 12, profile, memory_mb=1)
    by = {(r["drafter"], r.get("policy")): r for r in rows}
    assert "memory" not in by[("hybrid", None)]["by_source"]
    assert by[("hybrid+memory", None)]["by_source"]["memory"]["steps"] > 0
    assert by[("hybrid+memory", None)]["output_tokens"] == by[("hybrid", None)]["output_tokens"]

"""`tide bench weights` end to end on a tiny target: every format loads, the reference agrees with
itself, the quantized formats read fewer bytes a step and report quality and speed."""

from __future__ import annotations

import argparse

from support.bootstrap import save_tiny_chat_target

from benchmarks import weights


def test_bench_weights_compares_formats_side_by_side(tmp_path):
    target = save_tiny_chat_target(tmp_path / "tiny")  # 64 wide, 128-token vocabulary: int4 takes every shape
    args = argparse.Namespace(formats=["fp32", "int8", "int4"], dtype="fp32", target=str(target.path),
                              texts=["gsm8k_test.jsonl[:2]", "humaneval.jsonl.gz[:1]"],
                              prompts=["gsm8k_test.jsonl[60:76]"], tokens=4, rounds=1, json=None)
    res = weights.run(args)
    q, step = res["quality"], res["step_weights_mb"]
    assert q["fp32"]["next_token_agreement"] == 1.0 and q["fp32"]["tokens"] > 100
    assert all(0 < q[f]["next_token_agreement"] <= 1 and q[f]["perplexity"] > 1 for f in ("int8", "int4"))
    assert step["int8"] < step["fp32"] / 2 and step["int4"] < step["fp32"]  # int4 keeps the head in fp32
    assert res["held_weights_mb"]["int4"] > step["fp32"]  # the float copies prompts go through
    assert res["greedy"]["fp32"]["identical_outputs"] == 1.0
    for f in args.formats:
        assert res["speed"][f]["batch1"]["tok_s"] > 0 and res["speed"][f]["batch16"]["tok_s"] > 0
    assert res["speed"]["fp32"]["batch1"]["ratio"] == 1.0

"""`tide bench policies` end to end on the tiny target: a tiny trace, every policy, JSON keys and plots."""

from __future__ import annotations

import argparse
import json
import random

import pytest
import torch

from services.inference import bench_policies as bp

PHASE_KEYS = {"tok_s", "mean_latency_s", "p99_latency_s", "tpot_ms", "mean_gamma", "accept_length"}


def test_trace_is_seeded_and_phased():
    phases = (bp.PhaseSpec("low", 5, 1.0), bp.PhaseSpec("high", 5, 8.0), bp.PhaseSpec("bursty", 5, 2.0, burst=4))
    a, b = bp.make_trace(phases, 10, 3, (4, 8)), bp.make_trace(phases, 10, 3, (4, 8))
    assert a == b and a != bp.make_trace(phases, 10, 4, (4, 8))
    assert all(x.t_s <= y.t_s for x, y in zip(a, a[1:], strict=False))
    assert {x.phase for x in a} == {0, 1, 2} and all(0 <= x.prompt < 10 and 4 <= x.max_tokens <= 8 for x in a)
    per = [sum(x.phase == i for x in a) for i in range(3)]
    assert per[1] > per[0]  # the high-rate phase brings more requests
    labels = [p[0] for p in bp.policy_list(quick=True)]
    assert labels[:4] == ["none", "static-1", "static-3", "static-5"]
    assert {"adaptive", "tide", "nightjar"} <= set(labels)
    assert len(bp.policy_list(quick=False)) == len(labels) + 2


def test_bench_runs_end_to_end_on_tiny_model(tiny_model, tmp_path):
    parser = argparse.ArgumentParser()
    bp.add_arguments(parser)
    out, plots = tmp_path / "bench.json", tmp_path / "plots"
    args = parser.parse_args(["--quick", "--json", str(out), "--plots", str(plots), "--max-batch", "4",
                              "--max-gamma", "3", "--min-tokens", "4", "--max-tokens", "10", "--drain-s", "5",
                              "--profile-reps", "1", "--profile-cache", str(tmp_path / "cache"),
                              "--threads", "1", "--clock", "cpu"])  # CPU-time clock: load on the machine barely matters
    rng = random.Random(0)
    args.prompt_ids = [[1] + [rng.randrange(3, 96) for _ in range(rng.randint(4, 20))] for _ in range(12)]
    args.phases = (bp.PhaseSpec("low", 0.5, 6.0), bp.PhaseSpec("high", 0.5, 60.0),
                   bp.PhaseSpec("bursty", 0.5, 10.0, burst=4))
    threads = torch.get_num_threads()
    try:
        res = bp.run(args, model=tiny_model, model_id="tiny")
        args.policies, args.repeat = [("none", "static", {"gamma": 0}), ("static-1", "static", {"gamma": 1})], 2
        again = bp.run(args, model=tiny_model, model_id="tiny")
        args.repeat = 1
        args.clock = "wall"
        wall = bp.run(args, model=tiny_model, model_id="tiny")
    finally:
        torch.set_num_threads(threads)
    res["plots"] = bp.plots(res, plots)
    out.write_text(json.dumps(res))
    got = json.loads(out.read_text())
    assert got["drafter"] == "ngram" and got["clock"] == "cpu" and got["profile"]["T_ms"] and "D0_ms" in got["profile"]
    assert set(got["policies"]) == {label for label, _, _ in bp.policy_list(quick=True)}
    for label, r in got["policies"].items():
        assert set(r["phases"]) == {"low", "high", "bursty"}, label
        for st in [*r["phases"].values(), r["overall"]]:
            assert set(st) >= PHASE_KEYS, label
        assert r["overall"]["tokens"] > 0 and r["unfinished"] == 0
        assert r["timeline"] and all(len(p) == 3 for p in r["timeline"])
    assert got["policies"]["none"]["overall"]["mean_gamma"] == 0
    assert got["policies"]["static-3"]["overall"]["mean_gamma"] > 0
    # every policy served the same requests; greedy speculation is lossless, so the same tokens
    assert len({r["overall"]["tokens"] + r["drain"]["tokens"] for r in got["policies"].values()}) == 1
    assert set(got["oracle"]) == {"low", "high", "bursty"}
    for v in got["oracle"].values():
        assert v["policy"] in ("none", "static-1", "static-3", "static-5") and v["tok_s"] >= 0
    assert {"tide", "adaptive", "best"} <= set(got["checks"])
    assert set(got["checks"]["adaptive"]["vs_peers_overall"]) == set(bp.PEERS)
    for name in ("throughput.png", "gamma.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert again["profile"]["cached"] and list(again["policies"]) == ["none", "static-1"]  # profile from the cache
    rounds = again["policies"]["static-1"]["rounds"]  # --repeat 2: medians over two interleaved rounds
    assert len(rounds) == 2 and again["policies"]["static-1"]["overall"]["tok_s"] == pytest.approx(
        sum(r["overall_tok_s"] for r in rounds) / 2)
    assert not wall["profile"]["cached"] and wall["profile"]["meta"]["clock"] == "wall"  # the clock is in the key
    assert wall["policies"]["none"]["overall"]["tokens"] > 0


@pytest.mark.parametrize("argv", [["--quick"], []])
def test_cli_arguments(argv):
    parser = argparse.ArgumentParser()
    bp.add_arguments(parser)
    args = parser.parse_args(argv)
    assert args.quick == bool(argv) and args.draft is None and args.max_batch == 16


def test_tide_cli_registers_bench_policies(capsys):
    from tide.cli import main

    for kind in ("policies", "engine"):
        with pytest.raises(SystemExit) as exc:
            main(["bench", kind, "--help"])
        assert exc.value.code == 0 and "--quick" in capsys.readouterr().out

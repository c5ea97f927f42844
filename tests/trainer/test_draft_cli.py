"""`tide draft ...`: registration, argument mapping, errors, and fine-tuning a bootstrapped draft."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest

from tests.support.bootstrap import tiny_bootstrap
from tools.cli import build_parser, main
from tools.draft import draft_cli


def test_gamma_lists():
    assert draft_cli._gammas("1..5") == [1, 2, 3, 4, 5]
    assert draft_cli._gammas("3") == [3]
    assert draft_cli._gammas("1,3") == [1, 3]
    for bad in ("0", "1..9", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            draft_cli._gammas(bad)


def test_draft_commands_are_registered(capsys):
    for cmd, flag in (("bootstrap", "--minutes"), ("eval", "--gamma"), ("finetune", "--chunks")):
        with pytest.raises(SystemExit) as e:
            main(["draft", cmd, "--help"])
        assert e.value.code == 0
        assert flag in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["draft", "bootstrap", "--prompts", "x.jsonl"])  # --minutes and --out are required


def test_bootstrap_cli_maps_arguments(tmp_path, capsys):
    got = {}

    def fake(cfg, started):
        got["cfg"], got["started"] = cfg, started
        return {"draft": str(tmp_path / "draft"), "accept_length": {"3": 2.0}, "top1": [0.5], "wall_minutes": 1.0,
                "generation": {"output_tokens_train": 10}, "training": {"steps": 3}}

    called = time.monotonic()
    args = build_parser().parse_args(["draft", "bootstrap", "--target", "ref", "--prompts", "a.jsonl", "b.jsonl",
                                      "--minutes", "12", "--out", str(tmp_path), "--gen-fraction", "0.3",
                                      "--max-tokens", "128", "--threads", "2", "--no-progress"])
    assert args.handler is draft_cli.run_bootstrap  # what `tide draft bootstrap` runs
    rc = draft_cli.run_bootstrap(args, run=fake)
    assert rc == 0
    cfg = got["cfg"]
    assert (cfg.target, cfg.prompts, cfg.minutes, cfg.gen_fraction, cfg.max_tokens, cfg.threads, cfg.progress) == (
        "ref", ["a.jsonl", "b.jsonl"], 12.0, 0.3, 128, 2, False)
    # the budget counts from the process's start (this pytest process is older than the call), not
    # from the bootstrap's own start: the command's wall time is what --minutes bounds
    assert got["started"] < called - 0.5
    assert json.loads(capsys.readouterr().out)["accept_length"] == {"3": 2.0}
    assert main(["draft", "bootstrap", "--prompts", "a", "--minutes", "0", "--out", str(tmp_path)]) == 2


def test_process_age_counts_the_time_before_the_call():
    code = "import time; time.sleep(1.0); from tools.draft.draft_cli import process_age_s; print(process_age_s())"
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 1.0 <= age < 30.0


def test_eval_of_a_missing_draft_fails_cleanly(tmp_path, capsys):
    rc = main(["draft", "eval", "--draft", str(tmp_path / "nope"), "--prompts", "x.jsonl", "--json",
               str(tmp_path / "r.json")])
    assert rc == 1
    assert "neither a draft checkpoint nor a bootstrap directory" in capsys.readouterr().err


def test_finetune_from_a_bootstrapped_draft(tmp_path_factory, tmp_path):
    _, _, paths = tiny_bootstrap(tmp_path_factory)
    out, summary = tmp_path / "ft", tmp_path / "ft.json"
    rc = main(["draft", "finetune", "--from", str(paths["out"]), "--chunks", str(paths["out"] / "chunks" / "train"),
               "--out", str(out), "--steps", "4", "--warmup-steps", "2", "--batch-rows", "4", "--max-len", "256",
               "--json", str(summary), "--threads", "1", "--no-progress"])
    assert rc == 0
    res = json.loads(summary.read_text())
    assert res["train"]["steps"] == 4
    assert set(res["accept_length_3"]) == {"before", "after", "better"}
    record = json.loads((out / "training_record.json").read_text())
    assert record["parent"] == str(paths["out"] / "draft")
    assert (out / "config.json").exists()

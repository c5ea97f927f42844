"""`tide policies simulate` entry point."""

import json

from tide.policies.cli import simulate_main


def test_simulate_main_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = simulate_main(["--phase-s", "5", "--policies", "adaptive,tide", "--max-gamma", "4", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "adaptive" in text and "oracle" in text and "no-spec" in text
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"no-spec", "static-3", "adaptive", "tide"}
    assert report["phases"] == ["low", "high", "low-shift", "high-2", "bursty"]
    assert report["profile"]["D0_ms"] == 1.7


def test_unknown_policy_is_an_error(capsys):
    assert simulate_main(["--policies", "nope", "--json", "-"]) == 2
    assert "unknown" in capsys.readouterr().err

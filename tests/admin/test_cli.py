"""`tidectl drafts ...` end to end against a real registry (in-process main() and the installed script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from registry.harness import TARGET, TOKEN

from tools.admin.cli import _user, main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def run_json(capsys, *argv: str):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_list_and_show(seeded, capsys):
    _, (v1, v2, v3) = seeded
    code, out, _ = run(capsys, "drafts", "list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["VERSION", "CREATED", "STATE", "PARENT", "EVAL"]
    assert [ln.split()[0] for ln in lines[1:]] == [v1, v2, v3] and "accept_length=1.6" in lines[2]
    data = run_json(capsys, "drafts", "list", TARGET)
    assert [d["version"] for d in data["drafts"]] == [v1, v2, v3]
    assert data["drafts"][1]["parent_version"] == v1 and data["drafts"][1]["provenance"] == {"run": "run-1"}
    assert data["pointer"]["effective"] == "" and data["pointer"]["generation"] == 0
    code, out, _ = run(capsys, "drafts", "show", v2)
    assert code == 0 and "model.safetensors" in out and f"parent     {v1}" in out
    shown = run_json(capsys, "--json", "drafts", "show", v2)  # --json accepted before the subcommand too
    assert shown["version"] == v2 and len(shown["artifact"]["files"][0]["sha256"]) == 64
    assert shown["eval_metrics"] == {"accept_length": pytest.approx(1.6)} and shown["state"] == []


def test_promote_pin_unpin_rollback(seeded, capsys):
    _, (v1, v2, v3) = seeded
    p = run_json(capsys, "drafts", "promote", v1, "--reason", "bootstrap")
    assert (p["current"], p["effective"], p["generation"]) == (v1, v1, 1)
    p = run_json(capsys, "drafts", "promote", v2, "--expect-current", v1)
    assert (p["current"], p["previous"]) == (v2, [v1])
    code, out, _ = run(capsys, "drafts", "pin", v3, "--reason", "canary")
    assert code == 0 and f"pinned {v3}" in out and f"run {v3}" in out
    p = run_json(capsys, "drafts", "show", TARGET)
    assert (p["effective"], p["pinned"], p["current"]) == (v3, v3, v2)
    assert p["history"][0] | {"time_unix_s": 0, "time": ""} == {
        "action": "pin",
        "from_version": v2,
        "to_version": v3,
        "reason": "canary",
        "actor": f"tidectl:{_user()}",
        "time_unix_s": 0,
        "time": "",
    }
    code, out, _ = run(capsys, "drafts", "list")
    assert "effective,pinned" in out and "current" in out
    code, _, err = run(capsys, "drafts", "rollback", "--expect-current", v1)  # stale: v2 is current
    assert code == 4 and f"is '{v2}', not '{v1}'" in err
    # the only target is inferred
    code, out, _ = run(capsys, "drafts", "rollback", "--reason", "acceptance fell", "--expect-current", v2)
    assert code == 0 and f"rolled back to {v1}" in out and f"pinned to {v3}" in out
    p = run_json(capsys, "drafts", "unpin", TARGET)
    assert (p["effective"], p["pinned"], p["generation"]) == (v1, "", 5)
    assert [e["action"] for e in p["history"]] == ["unpin", "rollback", "pin", "promote", "promote"]


@pytest.mark.parametrize(
    ("argv", "status", "code", "message"),
    [
        (["drafts", "show", f"{TARGET}/v0042"], 3, "NOT_FOUND", "no draft version"),
        (["drafts", "pin", f"{TARGET}/v0042"], 3, "NOT_FOUND", "no draft version"),
        (["drafts", "rollback", TARGET], 4, "FAILED_PRECONDITION", "no previous draft"),
        (
            ["drafts", "promote", f"{TARGET}/v0001", "--expect-current", f"{TARGET}/v0002"],
            4,
            "FAILED_PRECONDITION",
            "not 'tiny-llama/v0002'",
        ),
        (["drafts", "unpin", "not a target"], 2, "INVALID_ARGUMENT", "invalid target_model"),
        (["drafts", "pin", f"{TARGET}/v0001", "--token", "wrong"], 5, "UNAUTHENTICATED", "invalid bearer token"),
    ],
)
def test_errors_map_to_exit_codes(seeded, capsys, argv, status, code, message):
    got, out, err = run(capsys, *argv)
    assert got == status and err.startswith(f"tidectl: {code}: ") and message in err and out == ""
    got, out, _ = run(capsys, *argv, "--json")
    assert got == status and json.loads(out)["error"]["code"] == code


def test_missing_token_and_unreachable_registry(seeded, capsys, monkeypatch):
    _, (v1, _, _) = seeded
    monkeypatch.delenv("TIDE_ADMIN_TOKEN")
    code, _, err = run(capsys, "drafts", "promote", v1)
    assert code == 5 and "pass --token or set TIDE_ADMIN_TOKEN" in err
    code, _, err = run(capsys, "drafts", "promote", v1, "--token", TOKEN)
    assert code == 0
    code, _, err = run(capsys, "--registry", "127.0.0.1:9", "drafts", "list")
    assert code == 6 and "registry at 127.0.0.1:9 unavailable" in err


def test_installed_script(seeded):
    _, (v1, _, _) = seeded
    script = os.path.join(os.path.dirname(sys.executable), "tidectl")
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "tools.admin.cli"]
    done = subprocess.run(
        [*cmd, "drafts", "promote", v1, "--json"], capture_output=True, text=True, timeout=60, env=os.environ.copy()
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["effective"] == v1
    done = subprocess.run([*cmd, "drafts", "list"], capture_output=True, text=True, timeout=60, env=os.environ.copy())
    assert done.returncode == 0 and v1 in done.stdout and "effective,current" in done.stdout

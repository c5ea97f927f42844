"""How tidectl finds a running `tide up` stack: the pointer file, and what makes it ignore one."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

from tools.stackfile import POINTER, find_stack, remove_pointer, write_json_atomically, write_pointer


def _run_dir(tmp_path, registry="127.0.0.1:5"):
    run_dir = tmp_path / "var" / "run-1"
    run_dir.mkdir(parents=True)
    (run_dir / "stack.json").write_text(json.dumps({"endpoints": {"registry": registry}}))
    (run_dir / "admin-token").write_text("secret\n")
    return run_dir


def test_a_live_stack_is_found_with_its_token(tmp_path):
    run_dir = _run_dir(tmp_path)
    write_pointer(tmp_path / "var", run_dir)
    found = find_stack(tmp_path / "var")
    assert found is not None and found.endpoints["registry"] == "127.0.0.1:5" and found.admin_token == "secret"


def test_a_killed_stacks_pointer_is_ignored(tmp_path):
    run_dir = _run_dir(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "var" / POINTER).write_text(json.dumps({"run_dir": str(run_dir), "pid": dead.pid}))
    assert find_stack(tmp_path / "var") is None


def test_remove_leaves_a_newer_stacks_pointer(tmp_path):
    old, new = _run_dir(tmp_path), tmp_path / "var" / "run-2"
    write_pointer(tmp_path / "var", new)
    remove_pointer(tmp_path / "var", old)
    assert (tmp_path / "var" / POINTER).exists()
    remove_pointer(tmp_path / "var", new)
    assert not (tmp_path / "var" / POINTER).exists()


def test_no_stack_no_pointer(tmp_path):
    assert find_stack(tmp_path / "nothing") is None


def test_a_reader_never_sees_a_half_written_stack_file(tmp_path):
    # The supervisor rewrites stack.json on every state change while /v1/status and tidectl read it.
    path = tmp_path / "stack.json"
    big = {"services": {f"svc-{i}": {"state": "ready", "restarts": i, "log": "x" * 2000} for i in range(64)}}
    write_json_atomically(path, big)
    stop = threading.Event()

    def rewrite():
        while not stop.is_set():
            write_json_atomically(path, big)

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        reads = [json.loads(path.read_text()) for _ in range(300)]
    finally:
        stop.set()
        writer.join()
    assert all(r == big for r in reads)
    assert [p.name for p in tmp_path.iterdir()] == ["stack.json"]  # no temporary left behind

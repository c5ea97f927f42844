"""tide.datakeys' key file: created once (mode 0600) and kept, the one-shot `python -m tide.datakeys`
docker-compose runs, and comments (with commas) in a key file."""

from __future__ import annotations

import os
import stat

import pytest

from tide.datakeys import Keyring, KeyringError, ensure_key_file, main, new_key_line


def test_a_key_file_is_created_once_with_mode_0600_and_kept(tmp_path):
    path = tmp_path / "keys" / "data-keys"
    assert ensure_key_file(path, "k1") is True
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    ring = Keyring.load(path=str(path))
    assert ring.current == "k1" and len(ring.keys) == 1
    assert ensure_key_file(path, "k2") is False and Keyring.load(path=str(path)) == ring  # the same key
    assert ring.open(ring.seal(b"tokens")) == b"tokens"
    assert [p.name for p in path.parent.iterdir()] == ["data-keys"]  # no temporary file left


def test_an_existing_file_without_a_key_is_refused(tmp_path):
    (tmp_path / "k").write_text("# nothing, here\n")
    with pytest.raises(KeyringError, match="holds no key"):
        ensure_key_file(tmp_path / "k", "k1")


def test_the_one_shot_command_creates_then_keeps(tmp_path, capsys):
    path = tmp_path / "data-keys"
    assert main([str(path)]) == 0 and "created" in capsys.readouterr().out
    before = path.read_text()
    assert main([str(path), "other"]) == 0 and "kept" in capsys.readouterr().out
    assert path.read_text() == before and Keyring.load(path=str(path)).current == "k1"
    assert main([]) == 2


def test_comments_may_hold_commas(tmp_path):
    text = (f"# first key, made today\n{new_key_line('a')}  # rotated in, later\n"
            f"{new_key_line('b')},{new_key_line('c')}\n")
    assert [k for k, _ in Keyring.parse(text).keys] == ["a", "b", "c"]

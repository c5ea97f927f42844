"""Results a reader can use: no tracked file cites a work log by its running number, and every
`docs/results/...` path a tracked file names exists.

A measurement is cited by its topic folder (`docs/results/<topic>`) and, where it helps, a table's
name and the machine kind; `docs/results/README.md` indexes the topics. The patterns are built from
pieces so that this file does not match them itself.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_WORD = "sess" + "ion"
RUNNING_NUMBER = re.compile(_WORD + r"[ -]?[0-9]|" + _WORD + r"s [0-9]", re.IGNORECASE)
RESULTS_PATH = re.compile("docs/" + r"results/[A-Za-z0-9_./<>*{}-]+")
TRAILING = ".,:;)`'\""
PLACEHOLDER = set("<>*{}")


def check_text(text: str, root: Path = ROOT) -> list[str]:
    """What in `text` a reader could not follow: a work log's running number, or a results path
    that is neither a file nor a folder under `root` (globs and `<placeholders>` are skipped)."""
    found = [f"running number {m.group(0)!r}" for m in RUNNING_NUMBER.finditer(text)]
    for m in RESULTS_PATH.finditer(text):
        path = m.group(0).rstrip(TRAILING)
        if PLACEHOLDER & set(path):
            continue
        if not (root / path).exists():
            found.append(f"missing path {path}")
    return found


def tracked_texts() -> list[tuple[str, str]]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    texts = []
    for raw in listed.split(b"\0"):
        if not raw:
            continue
        name = raw.decode()
        try:
            data = (ROOT / name).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            continue
        if b"\0" in data[:8192]:
            continue  # binary
        texts.append((name, data.decode("utf-8", errors="replace")))
    return texts


def test_no_tracked_file_cites_a_running_number_or_a_missing_results_path() -> None:
    bad = {name: found for name, text in tracked_texts() if (found := check_text(text))}
    assert not bad, bad


def test_the_check_reports_a_running_number_and_a_missing_path() -> None:
    text = "as measured in " + _WORD + " 7 (see " + "docs/" + "results/nope/x.json)."
    found = check_text(text)
    assert any(f.startswith("running number") for f in found), found
    assert "missing path docs/" + "results/nope/x.json" in found, found
    assert len(found) == 2, found


def test_the_check_accepts_folders_files_and_placeholders() -> None:
    text = (
        "docs/" + "results/speculation, `docs/" + "results/README.md`: docs/" + "results/<topic>/README.md, "
        "docs/" + "results/bootstrap/ab-*-eval.json, an HTTP " + _WORD + ", the " + _WORD + "s of a user."
    )
    assert check_text(text) == []


def test_every_results_topic_is_indexed() -> None:
    """docs/results/README.md lists every topic folder (and only those)."""
    results = ROOT / "docs" / "results"
    folders = {d.name for d in results.iterdir() if d.is_dir()}
    indexed = set(re.findall(r"^\| \[([\w-]+)\]\(\1/README\.md\)", (results / "README.md").read_text(), re.M))
    assert indexed == folders

"""tide.prompts: the shared-data formats, and slices for disjoint training / held-out sets."""

import json

import pytest

from tide.prompts import load_prompts


@pytest.fixture
def gsm_file(tmp_path):
    path = tmp_path / "gsm8k_mini.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": "a"}) + "\n" for i in range(10)))
    return path


def test_reads_the_format_and_domain(gsm_file):
    prompts = load_prompts(gsm_file)
    assert [p.text for p in prompts] == [f"q{i}" for i in range(10)]
    assert {p.domain for p in prompts} == {"gsm8k"} and all(p.chat for p in prompts)


def test_slices_make_disjoint_sets_that_cover_the_file(gsm_file):
    head, tail = load_prompts(f"{gsm_file}[:7]"), load_prompts(f"{gsm_file}[7:]")
    assert [p.text for p in head] == [f"q{i}" for i in range(7)]
    assert [p.text for p in tail] == ["q7", "q8", "q9"]
    assert [p.text for p in load_prompts(f"{gsm_file}[-2:]", limit=1)] == ["q8"]


def test_limit_without_slice(gsm_file):
    assert len(load_prompts(gsm_file, limit=3)) == 3


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_prompts(tmp_path / "nope.jsonl[1:]")

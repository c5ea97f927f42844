"""Prompt sets for benchmarks, bootstrap and evaluation, read from the public formats in shared/data.

Formats (by file name, `.jsonl` or `.jsonl.gz`): Spec-Bench questions (`turns`, first turn used,
domain = `category`), GSM8K (`question`, domain "gsm8k"), HumanEval (`prompt`, domain
"humaneval"), Alpaca seed tasks (`instruction` + first instance `input`, domain "alpaca"), or any
JSONL with a `prompt` or `text` field (domain = file stem). Plain `.txt` files: one prompt a line.
The data directory defaults to `$TIDE_DATA_DIR`, else `../shared/data` beside the repository.
A name may end in a Python slice of the file's prompts, e.g. `humaneval.jsonl.gz[:132]` and
`humaneval.jsonl.gz[132:]` for disjoint training and held-out sets, or with a step,
`spec_bench_questions.jsonl[0::2]` and `[1::2]` to split every category in two.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    text: str
    domain: str
    source: str  # file name the prompt came from
    chat: bool = True  # apply the chat template (HumanEval prompts are raw code completions)


def data_dir() -> Path:
    env = os.environ.get("TIDE_DATA_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def resolve_prompt_file(name: str | os.PathLike) -> Path:
    """A path as given, or a file name looked up in the data directory."""
    path = Path(name)
    if path.exists():
        return path
    candidate = data_dir() / path
    if candidate.exists():
        return candidate
    raise FileNotFoundError(f"prompt file {name!r} not found (looked in . and {data_dir()})")


def read_rows(path: Path):
    """The JSON rows of a .jsonl or .jsonl.gz file, in order."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


_SLICE = re.compile(r"^(?P<name>.+)\[(?P<start>-?\d*):(?P<stop>-?\d*)(?::(?P<step>-?\d*))?\]$")


def split_slice(name: str | os.PathLike) -> tuple[str | os.PathLike, slice | None]:
    """("file", slice) for "file[start:stop]" or "file[start:stop:step]"; (name, None) when there is
    no slice (or the file exists as named)."""
    m = _SLICE.match(str(name))
    if m is None or Path(name).exists():
        return name, None
    as_int = lambda s: int(s) if s else None  # noqa: E731
    return m["name"], slice(as_int(m["start"]), as_int(m["stop"]), as_int(m["step"] or ""))


def load_prompts(name: str | os.PathLike, limit: int | None = None) -> list[Prompt]:
    """The prompts of a file (see the module doc for formats and slices); at most `limit` of them
    (after slicing)."""
    name, part = split_slice(name)
    if part is not None:
        return _load_file(name)[part][:limit]
    return _load_file(name, limit)


def _load_file(name: str | os.PathLike, limit: int | None = None) -> list[Prompt]:
    path = resolve_prompt_file(name)
    stem = path.name.split(".")[0]
    out: list[Prompt] = []
    if path.suffix == ".txt":
        out = [Prompt(line.strip(), stem, path.name) for line in path.read_text().splitlines() if line.strip()]
    else:
        for row in read_rows(path):
            if "turns" in row:
                out.append(Prompt(row["turns"][0], row.get("category", stem), path.name))
            elif "question" in row:
                out.append(Prompt(row["question"], "gsm8k" if "gsm8k" in stem else stem, path.name))
            elif "canonical_solution" in row:
                out.append(Prompt(row["prompt"], "humaneval", path.name, chat=False))
            elif "instruction" in row:
                inp = (row.get("instances") or [{}])[0].get("input", "")
                out.append(Prompt(f"{row['instruction']}\n\n{inp}".strip(), "alpaca", path.name))
            elif "prompt" in row or "text" in row:
                out.append(Prompt(row.get("prompt") or row["text"], stem, path.name))
            else:
                raise ValueError(f"{path}: a row has none of turns/question/prompt/instruction/text")
            if limit is not None and len(out) >= limit:
                break
    return out[:limit] if limit is not None else out


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids: the chat template with a generation prompt for chat prompts, raw text otherwise."""
    if prompt.chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer.encode(prompt.text)

"""Deployment-like prompt sets for the speculation memory, written to benchmarks/workloads/.

    python -m benchmarks.workloads          # (re)write the files from ../shared/data and a fixed seed

Each file is gzip JSONL with a `prompt` per row (tide.prompts reads it; a chat prompt, the
domain is the file name), in the order a server would see the requests:

- repeated_questions: 16 Spec-Bench / Alpaca questions asked 4 times each by "different users",
  half verbatim, half paraphrased by a greeting before or a request after the question, shuffled
  (what FAQ-like traffic looks like). Repetition across requests.
- templated_extraction: one instruction (the product's system prompt) and a JSON template over 48
  synthetic person records. Repetition across requests: the keys, the template, the shapes.
- coding_agents: 4 agents take turns editing one module (3 HumanEval solutions), each request
  showing the module and asking for one change and the whole module back, 48 requests. Repetition
  across requests (every answer re-emits what other agents' answers emitted) and within.
- repair_loop: 48 HumanEval functions with one line broken, each request quoting the broken
  function and a failing test and asking for the corrected function. Repetition within a request
  only (prompt lookup's ground); the control for "the memory does not get in the way".

The non-repetitive control is an existing set (spec_bench_questions.jsonl).
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

from tide.prompts import data_dir, load_prompts, read_rows

OUT = Path(__file__).resolve().parent / "workloads"
SEED = 60

FIRST = ["Ana", "Bo", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena"]
LAST = ["Silva", "Nguyen", "Okafor", "Schmidt", "Kowalski", "Haddad", "Tanaka", "Moreau", "Rossi", "Berg"]
CITIES = ["Lisbon", "Hanoi", "Lagos", "Berlin", "Krakow", "Beirut", "Osaka", "Lyon", "Turin", "Oslo"]
JOBS = ["nurse", "welder", "teacher", "pilot", "chemist", "baker", "architect", "accountant"]
EXTRACT = (
    "You are a data-entry assistant. Extract the person described below into JSON with exactly these "
    'keys: {"first_name": string, "last_name": string, "age": integer, "city": string, '
    '"occupation": string, "email": string}. Reply with the JSON object only.\n\nRecord: '
)


def repeated_questions(rng: random.Random) -> list[str]:
    pool = [p.text for p in load_prompts("spec_bench_questions.jsonl[::10]")][:8]
    pool += [p.text for p in load_prompts("alpaca_seed_tasks.jsonl[::20]") if len(p.text) < 400][:8]
    before = ["Hi! ", "Hello, quick question. ", "Hey there. ", ""]
    after = [" Thanks!", " Please be concise.", " Answer in a few sentences.", ""]
    out = []
    for q in pool:
        for user in range(4):
            if user % 2 == 0:
                out.append(q)
            elif user == 1:
                out.append(rng.choice(before[:3]) + q)
            else:
                out.append(q + rng.choice(after[:3]))
    rng.shuffle(out)
    return out


def templated_extraction(rng: random.Random, n: int = 48) -> list[str]:
    out = []
    for _ in range(n):
        first, last, city, job = rng.choice(FIRST), rng.choice(LAST), rng.choice(CITIES), rng.choice(JOBS)
        age = rng.randint(21, 70)
        email = f"{first.lower()}.{last.lower()}@example.org"
        record = rng.choice(
            [
                f"{first} {last}, {age}, works as a {job} in {city}. Contact: {email}.",
                f"Name: {last}, {first}. Age {age}. Lives in {city}; occupation {job}; e-mail {email}",
                f"Our new member {first} {last} ({age}) is a {job} from {city} and can be reached at {email}.",
            ]
        )
        out.append(EXTRACT + record)
    return out


def _humaneval() -> list[dict]:
    return list(read_rows(data_dir() / "humaneval.jsonl.gz"))


AGENT_TASKS = (
    "add type hints to every variable in `{f}`",
    "rename the loop variables of `{f}` to longer names",
    "add a short comment above each statement of `{f}`",
    "make `{f}` raise ValueError on empty input",
)


def _agent_request(rng: random.Random, agent: int, module: str, names: list[str]) -> str:
    task = rng.choice(AGENT_TASKS).format(f=rng.choice(names))
    return (f"You are coding agent {agent + 1} of 4 working on the module utils.py. Task: {task}.\n\n"
            f"Current utils.py:\n```python\n{module}\n```\n\nReply with the complete updated utils.py.")


def coding_agents(rng: random.Random) -> list[str]:
    rows = _humaneval()
    module = "\n\n".join((rows[i]["prompt"] + rows[i]["canonical_solution"]).strip() for i in (0, 2, 4))
    names = [rows[i]["entry_point"] for i in (0, 2, 4)]
    return [_agent_request(rng, turn % 4, module, names) for turn in range(48)]


def repair_loop(rng: random.Random) -> list[str]:
    rows = _humaneval()[10:]
    out = []
    for row in rows:
        lines = (row["prompt"] + row["canonical_solution"]).rstrip().split("\n")
        body = [i for i, ln in enumerate(lines) if ln.startswith("        ") and "return" not in ln]
        if not body:
            continue
        i = rng.choice(body)
        lines[i] = lines[i].replace("+", "-", 1) if "+" in lines[i] else lines[i] + "  # TODO"
        broken = "\n".join(lines)
        out.append(
            f"Your previous answer was:\n```python\n{broken}\n```\nIt fails a test of "
            f"`{row['entry_point']}`. Fix the bug and reply with the corrected function only."
        )
        if len(out) == 48:
            break
    return out


# 40 modules x 24 turns: ~2900 requests of the stream before a module returns (30 minutes of
# traffic at 4 streams here serve ~2000)
AGENT_TURNS_PER_MODULE = 24


def repetitive_stream(rng: random.Random, n: int, heldout: bool = False) -> list[str]:
    """`n` requests of a long deployment-like stream (the repetitive horizon of `tide bench adapt`):
    each request, one in three, is an FAQ question (a pool of 96 Spec-Bench / Alpaca questions under
    Zipf popularity, so popular ones recur, verbatim or with a greeting or a request around them), a
    fresh record to extract under the product's JSON template, or a coding agent's turn on the current
    project (4 agents x 6 turns over a module of 3 HumanEval functions, then the next module). Fresh
    content keeps arriving: no request list is replayed. `heldout`: the questions and modules the
    served stream never uses (for draft evaluations on traffic it has not seen)."""
    qs = [p.text for p in load_prompts("spec_bench_questions.jsonl") if len(p.text) < 400][:96]
    qs += [p.text for p in load_prompts("alpaca_seed_tasks.jsonl") if len(p.text) < 400][:24]
    pool = qs[96:] if heldout else qs[:96]
    weights = [1 / (rank + 1) for rank in range(len(pool))]
    rows = _humaneval()
    rows = rows[120:] if heldout else rows[:120]
    modules = [rows[i:i + 3] for i in range(0, len(rows) - 2, 3)]
    before, after = ["Hi! ", "Hello, quick question. ", "Hey there. "], [" Thanks!", " Please be concise."]
    out, agent_turn = [], 0
    while len(out) < n:
        kind = rng.randrange(3)
        if kind == 0:
            q = rng.choices(pool, weights)[0]
            out.append(rng.choice([q, q, rng.choice(before) + q, q + rng.choice(after)]))
        elif kind == 1:
            out.append(templated_extraction(rng, 1)[0])
        else:
            module = modules[(agent_turn // AGENT_TURNS_PER_MODULE) % len(modules)]
            code = "\n\n".join((r["prompt"] + r["canonical_solution"]).strip() for r in module)
            out.append(_agent_request(rng, agent_turn % 4, code, [r["entry_point"] for r in module]))
            agent_turn += 1
    return out


WORKLOADS = {
    "repeated_questions": repeated_questions,
    "templated_extraction": templated_extraction,
    "coding_agents": coding_agents,
    "repair_loop": repair_loop,
}


def main() -> int:
    OUT.mkdir(exist_ok=True)
    for name, make in WORKLOADS.items():
        prompts = make(random.Random(f"{SEED}-{name}"))
        path = OUT / f"{name}.jsonl.gz"
        # mtime=0: the same bytes on every run (the gzip header stores a time otherwise)
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            for p in prompts:
                f.write((json.dumps({"prompt": p}) + "\n").encode())
        print(f"{path.relative_to(OUT.parent.parent)}: {len(prompts)} prompts, {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

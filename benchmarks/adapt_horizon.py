"""`tide bench adapt --scenario horizon`: one shift, then a long horizon of the new domain (issue 34).

A deployment shifts once and then serves the new traffic for hours. The starting draft is the bench's
chat bootstrap (benchmarks.adapt.starting_draft: Spec-Bench and Alpaca, never GSM8K); the traffic is
GSM8K *train* questions for the whole horizon (`--horizon-s`, default 40 minutes per mode, `--quick`
15), at steady concurrency, every request a distinct question. Static and online each run once on a
fresh stack, in an order alternated by `--seed`.

`--traffic repetitive` serves deployment-like traffic instead (`repetitive_prompts`: FAQ questions
that recur, templated extraction, coding agents re-emitting one module), and "online" there is the
speculation memory (`--memory-mb`) with the draft's fine-tune, "static" neither.

What this module adds to the three-phase bench (benchmarks.adapt runs the stacks):

- `horizon_prompts`: the served questions, the held-out ones (never served) and the warm-up ones,
  disjoint, from one seeded shuffle of gsm8k_train.jsonl.
- `heldout_chunks`: the target's own greedy continuations of the held-out questions, with captured
  hidden states, written once as chunks and cached ($TIDE_CACHE_DIR/bench-adapt/horizon-heldout-<key>)
  before any timed part. Every draft the report names is evaluated on exactly these chunks at fixed
  γ = 3 (`eval_accept_length_g3`: the served accept length services.trainer's eval computes), so the
  criterion does not move with the γ the live policy picks.
- `thirds`: per equal third of the horizon, client-side tok/s, the live accept length, and the
  draft version that served at the third's end (from the poller's samples), evaluated afterwards.
- `offline_reference`: the starting draft fine-tuned offline on the chunks the online stack collected
  (downloaded from its S3 before it stops), the trainer's recipe (services.trainer.training, the
  online trainer's learning rate, rows and row length), at most `OFFLINE_PASSES` passes or
  `offline_budget_s` seconds, evaluated on the same held-out chunks: what an offline team would ship.
- `time_to_recover_s`: the first time online's live accept length is >= 1.1x static's and stays so
  for 2 minutes (windows of `RECOVER_BIN_S`).
- `checks`: the issue's done-when on this run.

benchmarks.adapt calls `evaluate_mode` after each mode's stack has stopped, `finish` after both, and
`print_table` for the summary.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path

from benchmarks import adapt_stats as stats
from tide.prompts import Prompt, load_prompts

DOMAIN = ("gsm8k", "gsm8k_train.jsonl")
# The repetitive variant (`--traffic repetitive`): deployment-like traffic that repeats across requests,
# where "online" adds the speculation memory to the draft's fine-tune (benchmarks.adapt.mode_env)
REPETITIVE = "repetitive"
REPETITIVE_REQUESTS = 6000  # more than 40 minutes at 4 streams serve here: the stream never wraps
HELDOUT_PROMPTS = 64  # held-out questions: ≈ 8k continuation tokens at 128 each
WARM_PROMPTS = 4  # warm-up requests before the timed traffic (never served again)
EVAL_GAMMA = 3
OFFLINE_PASSES = 10.0  # the offline budget: at most 10 passes or 20 minutes
OFFLINE_MAX_S = 1200.0
RECOVER_RATIO, RECOVER_SUSTAIN_S, RECOVER_BIN_S = 1.1, 120.0, 30.0
MAX_CYCLE_EVALS = 8  # training cycles' candidates evaluated on the held-out chunks (≈ 22 s each here)
# the done-when: last third online/static tok/s and eval accept length; online vs offline
MIN_TOK_S_RATIO, MIN_EVAL_RATIO, MIN_VS_OFFLINE = 1.15, 1.2, 0.9


def horizon_prompts(seed: int, max_chars: int,
                    traffic: str = "gsm8k") -> tuple[list[Prompt], list[Prompt], list[Prompt]]:
    """(served, held out, warm-up) GSM8K train questions, disjoint, from one shuffle by `seed`. The
    held-out set does not depend on `seed` (every run's drafts are compared on the same chunks).
    `traffic="repetitive"`: `repetitive_prompts` instead."""
    if traffic == "repetitive":
        return repetitive_prompts(seed)
    ps = [p for p in load_prompts(DOMAIN[1]) if len(p.text) <= max_chars]
    unique = list({p.text: p for p in ps}.values())  # a repeated question would be served twice
    fixed = set(random.Random(1234).sample(range(len(unique)), min(HELDOUT_PROMPTS, len(unique) // 4)))
    heldout = [unique[i] for i in sorted(fixed)]
    rest = [p for i, p in enumerate(unique) if i not in fixed]
    random.Random(seed * 31 + 7).shuffle(rest)
    return rest[WARM_PROMPTS:], heldout, rest[:WARM_PROMPTS]


def repetitive_prompts(seed: int) -> tuple[list[Prompt], list[Prompt], list[Prompt]]:
    """(served, held out, warm-up) of the repetitive traffic (benchmarks.workloads.repetitive_stream):
    FAQ questions, templated extraction and coding agents interleaved, fresh content throughout; the
    held-out requests use questions and modules the served stream never does, and do not depend on
    `seed`; the warm-up requests are extractions (their records never recur)."""
    from benchmarks.workloads import repetitive_stream

    wrap = lambda texts: [Prompt(t, REPETITIVE, "benchmarks.workloads") for t in texts]  # noqa: E731
    served = wrap(repetitive_stream(random.Random(seed * 31 + 7), REPETITIVE_REQUESTS))
    heldout = wrap(repetitive_stream(random.Random(1234), HELDOUT_PROMPTS, heldout=True))
    warm = wrap(templated_warmup(random.Random(seed + 99)))
    return served, heldout, warm


def templated_warmup(rng: random.Random) -> list[str]:
    from benchmarks.workloads import templated_extraction

    return templated_extraction(rng, WARM_PROMPTS)


def bounds(horizon_s: float, traffic: str = "gsm8k") -> list[tuple[str, float, float]]:
    return [(REPETITIVE if traffic == "repetitive" else DOMAIN[0], 0.0, horizon_s)]


def mode_order(seed: int, modes: list[str]) -> list[str]:
    """Static first on even seeds, online first on odd ones (the machine drifts over an hour)."""
    ordered = [m for m in ("static", "online") if m in modes]
    return ordered if seed % 2 == 0 else ordered[::-1]


def heldout_chunks(draft_dir: Path, target: str, prompts: list[Prompt], max_tokens: int,
                   cache: Path) -> tuple[Path, dict]:
    """The held-out chunks (generated now when not cached) and the starting draft's eval on them."""
    from tide.target import resolve_target
    from tools.draft.draft_eval import evaluate_on_prompts

    body = "".join(json.dumps({"prompt": p.text}) + "\n" for p in prompts)
    key = hashlib.sha256(json.dumps([resolve_target(target).model_id, body, max_tokens]).encode()).hexdigest()[:12]
    out = cache / f"horizon-heldout-{key}"
    done = out / "done.json"
    if done.exists():
        return out / "chunks", evaluate_g3(draft_dir, out / "chunks", target)
    shutil.rmtree(out, ignore_errors=True)  # an interrupted generation leaves chunks that would count twice
    out.mkdir(parents=True)
    (out / "prompts.jsonl").write_text(body)
    print(f"generating the held-out chunks ({len(prompts)} held-out {prompts[0].domain} prompts) into {out}",
          flush=True)
    # chat-templated as served (Prompt.chat), greedy, capture on; the starting draft evaluated on them
    r = evaluate_on_prompts(draft_dir, [str(out / "prompts.jsonl")], target, gammas=(EVAL_GAMMA,),
                            max_tokens=max_tokens, batch=16, chunks_dir=out / "chunks", progress=False)
    done.write_text(json.dumps({"prompts": r["prompts"], "output_tokens": r["output_tokens"]}))
    return out / "chunks", {"eval_accept_length_g3": r["accept_length"][str(EVAL_GAMMA)], "rows": r["rows"]}


def evaluate_g3(draft_dir: Path, chunks: Path, target: str) -> dict:
    """The draft's served accept length at γ = 3 on `chunks` (tools.draft.draft_eval's measure;
    ≈ 22 s for the 13.5k held-out rows here, nearly all of it the evaluation itself)."""
    from tools.draft.draft_eval import evaluate_on_chunks

    r = evaluate_on_chunks(draft_dir, chunks, target, gammas=(EVAL_GAMMA,))
    return {"eval_accept_length_g3": r["accept_length"][str(EVAL_GAMMA)], "rows": r["rows"]}


def evaluate_many(draft_dirs: list[Path], chunks: Path, target: str) -> list[dict]:
    return [evaluate_g3(d, chunks, target) for d in draft_dirs]


def spaced(n: int, k: int) -> list[int]:
    """Up to `k` indices of range(n), evenly spaced, the last one always included."""
    if n <= k:
        return list(range(n))
    return sorted({round((i + 1) * n / k) - 1 for i in range(k)})


def version_at(samples: list[dict], t: float) -> str | None:
    """The draft version every worker served at the last sample at or before `t` (None: none yet, or
    workers mid-swap)."""
    v = None
    for s in samples:
        if s["t"] > t:
            break
        if s.get("draft_version") and "," not in s["draft_version"]:
            v = s["draft_version"]
    return v


def thirds(records: list[dict], samples: list[dict], horizon_s: float) -> list[dict]:
    """Three equal windows of the horizon: tok_s, live accept length, the version serving at the end."""
    out = []
    for i in range(3):
        a, b = i * horizon_s / 3, (i + 1) * horizon_s / 3
        w = stats.window(records, a, b)
        out.append({"start_s": round(a, 2), "end_s": round(b, 2), "tok_s": w["tok_s"],
                    "accept_length": w["accept_length"], "drafted_share": w["drafted_share"],
                    "tokens": w["tokens"], "draft_version": version_at(samples, b)})
    return out


def cpu_share(samples: list[dict], key: str = "trainer") -> list[list[float]]:
    """[[t, CPU-seconds per second], ...] of a process between consecutive samples' `cpu_s[key]`."""
    pts = [(s["t"], s["cpu_s"][key]) for s in samples if (s.get("cpu_s") or {}).get(key) is not None]
    return [[round((t0 + t1) / 2, 2), round((c1 - c0) / (t1 - t0), 3)]
            for (t0, c0), (t1, c1) in zip(pts, pts[1:], strict=False) if t1 > t0]


def speculation_memory_held(samples: list[dict]) -> dict | None:
    """The speculation memory over the run (None: the workers have none): its largest accounted bytes
    against its budget, the tokens it ended with, and the worker's RSS at the start and the end."""
    mem = [(s["t"], s["speculation_memory"][0], s.get("rss_bytes")) for s in samples if s.get("speculation_memory")]
    if not mem:
        return None
    return {"budget_bytes": mem[-1][1]["budget_bytes"], "max_bytes": max(m["bytes"] for _, m, _ in mem),
            "final_bytes": mem[-1][1]["bytes"], "final_tokens": mem[-1][1]["tokens"],
            "max_tokens": max(m["tokens"] for _, m, _ in mem),
            "within_budget": all(m["bytes"] <= m["budget_bytes"] for _, m, _ in mem),
            "rss_bytes_first_last": [mem[0][2], mem[-1][2]], "samples": len(mem), "last_t_s": mem[-1][0]}


def time_to_recover(static: list[dict], online: list[dict], horizon_s: float) -> float | None:
    """First window start from which online's live accept length stays >= RECOVER_RATIO x static's
    for RECOVER_SUSTAIN_S (windows of RECOVER_BIN_S; a window where either has no verify step breaks a
    run). None: never."""
    n = int(horizon_s // RECOVER_BIN_S)
    need = max(1, round(RECOVER_SUSTAIN_S / RECOVER_BIN_S))
    ok = []
    for i in range(n):
        a, b = i * RECOVER_BIN_S, (i + 1) * RECOVER_BIN_S
        s, o = stats.window(static, a, b)["accept_length"], stats.window(online, a, b)["accept_length"]
        ok.append(s is not None and o is not None and o >= RECOVER_RATIO * s)
    for i in range(n - need + 1):
        if all(ok[i:i + need]):
            return i * RECOVER_BIN_S
    return None


def download_chunks(s3, bucket: str, prefix: str, dest: Path, key_file: str = "") -> int:
    """Every chunk blob under `prefix` into `dest` (verified against its stored SHA-256; opened with
    the stack's data keys `key_file` when it has one: the offline trainer reads plain chunks); the count."""
    from tide import blobs
    from tide.datakeys import Keyring

    ring = Keyring.load(path=key_file) if key_file else Keyring.empty()
    dest.mkdir(parents=True, exist_ok=True)
    keys = blobs.list_keys(s3, bucket, prefix)
    for i, key in enumerate(keys):
        (dest / f"{i:06d}.chunk").write_bytes(ring.open(blobs.get_bytes(s3, bucket, key)))
    return len(keys)


def offline_reference(draft_dir: Path, chunks: Path, heldout: Path, target: str, out: Path,
                      budget_s: float, lr: float, batch_rows: int, max_len: int) -> dict:
    """The starting draft fine-tuned offline on `chunks` (see the module doc) and evaluated on `heldout`."""
    from services.trainer.training.loop import TrainConfig
    from services.trainer.training.run import train_draft
    from tide.eagle3.checkpoint import find_checkpoint_dir
    from tools.draft.generation import torch_threads

    if not any(chunks.glob("*.chunk")) and not any(chunks.glob("*.safetensors")):  # the stack's or a capture's
        return {"eval_accept_length_g3": None, "tokens": 0, "note": "the online stack collected no chunks"}
    cfg = TrainConfig(epochs=OFFLINE_PASSES, max_seconds=budget_s, batch_rows=batch_rows, max_len=max_len, lr=lr,
                      progress=False)
    t0 = time.monotonic()
    with torch_threads(len(os.sched_getaffinity(0))):  # the stacks are down: every CPU this process may use
        # eval_fraction: the trainer's own split is not the criterion (the held-out chunks are); keep it small
        summary = train_draft(target, chunks, out, init=find_checkpoint_dir(draft_dir), cfg=cfg, eval_fraction=0.02)
    tr = summary["train"]
    return {**evaluate_g3(out, heldout, target), "tokens": chunk_tokens(chunks, target, max_len),
            "trained_tokens": tr["tokens"], "steps": tr["steps"],
            "train_seconds": round(tr["seconds"], 1), "wall_s": round(time.monotonic() - t0, 1),
            "recipe": {"passes_max": OFFLINE_PASSES, "seconds_max": budget_s, "lr": lr, "batch_rows": batch_rows,
                       "max_len": max_len}}


def chunk_tokens(chunks: Path, target: str, max_len: int) -> int:
    """Tokens (rows) in the chunks under `chunks`, as the trainer reads them."""
    from services.trainer.training.data import load_dataset
    from services.trainer.training.head import TargetHead
    from tide.target import resolve_target

    return load_dataset(chunks, TargetHead.load(resolve_target(target)), max_len).num_tokens


def checks(res: dict) -> dict:
    """The issue's done-when on this run (None where a number is missing)."""
    s, o = res["static"]["thirds"][-1], res["online"]["thirds"][-1]
    tok = stats._ratio(o["tok_s"], s["tok_s"])
    ev = stats._ratio(o.get("eval_accept_length_g3"), s.get("eval_accept_length_g3"))
    off = stats._ratio(res.get("online_final_eval_accept_length_g3"),
                       (res.get("offline_reference") or {}).get("eval_accept_length_g3"))
    ok = lambda r, m: None if r is None else r >= m  # noqa: E731
    return {"last_third_tok_s_ratio": tok, "last_third_eval_ratio": ev, "online_vs_offline": off,
            "meets": {f"tok_s_x{MIN_TOK_S_RATIO:.2f}": ok(tok, MIN_TOK_S_RATIO),
                      f"eval_x{MIN_EVAL_RATIO:.2f}": ok(ev, MIN_EVAL_RATIO),
                      f"vs_offline_x{MIN_VS_OFFLINE:.2f}": ok(off, MIN_VS_OFFLINE)}}


def evaluate_mode(res: dict, mode_dir: Path, draft_dir: Path, heldout: Path, horizon_s: float, target: str) -> None:
    """A mode's `thirds`, and each third's serving draft and the training cycles' candidates (up to
    MAX_CYCLE_EVALS of them, evenly spaced, the last included) evaluated on the held-out chunks at
    γ = 3 (from the stack's draft cache; the starting draft from `draft_dir`), into `res`."""
    from tide.registry_client import target_key

    res["thirds"] = thirds(res["requests"], res["samples"], horizon_s)
    if (held := speculation_memory_held(res["samples"])) is not None:
        res["speculation_memory"] = held
    # candidates registered during the traffic (the registry may hold a starter draft from before)
    res["candidates"] = [c for c in res.get("candidates", []) if c["t_s"] >= 0]
    cands = res["candidates"]
    picked = spaced(len(cands), MAX_CYCLE_EVALS)
    versions = list(dict.fromkeys([t["draft_version"] for t in res["thirds"]] + [cands[i]["version"] for i in picked]))
    path = lambda v: draft_dir if v in (None, res["starting_version"]) else mode_dir / "draft-cache" / target_key(v)  # noqa: E731
    have = [v for v in versions if path(v).exists()]
    evals = dict(zip(have, (e["eval_accept_length_g3"] for e in
                            evaluate_many([path(v) for v in have], heldout, target)), strict=True))
    for third in res["thirds"]:
        third["eval_accept_length_g3"] = evals.get(third["draft_version"])
    promoted = {p["version"] for p in res.get("promotions", [])}
    for c in cands:  # in creation order: the held-out curve of the loop's cycles
        c["eval_accept_length_g3"], c["promoted"] = evals.get(c["version"]), c["version"] in promoted
    res["final_eval_accept_length_g3"] = res["thirds"][-1]["eval_accept_length_g3"]


def finish(res: dict, online_dir: Path, draft_dir: Path, heldout: Path, target: str, horizon_s: float,
           offline_budget_s: float, trainer_env: dict[str, str]) -> None:
    """After both modes: the offline reference (the online trainer's recipe from `trainer_env`, its
    variables as the run set them), time to recover and the checks, into `res`."""
    from services.trainer.settings import TrainerSettings

    lr = float(trainer_env.get("TIDE_TRAINER_LR", TrainerSettings.model_fields["lr"].default))
    rows = int(trainer_env.get("TIDE_TRAINER_BATCH_ROWS", TrainerSettings.model_fields["batch_rows"].default))
    max_len = int(trainer_env.get("TIDE_TRAINER_MAX_LEN", TrainerSettings.model_fields["max_len"].default))
    print(f"offline reference: the starting draft fine-tuned on the online stack's chunks "
          f"(<= {OFFLINE_PASSES:g} passes, <= {offline_budget_s:.0f} s)", flush=True)
    res["offline_reference"] = offline_reference(draft_dir, online_dir / "collected-chunks", heldout, target,
                                                 online_dir / "offline-reference", offline_budget_s, lr, rows, max_len)
    res["online_final_eval_accept_length_g3"] = res["online"].get("final_eval_accept_length_g3")
    res["collected_tokens"] = res["online"].get("collected_tokens")
    if "static" in res:
        res["time_to_recover_s"] = time_to_recover(res["static"]["requests"], res["online"]["requests"], horizon_s)
        res["checks"] = checks(res)


def print_table(res: dict) -> None:
    fmt = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    print(f"\n{'':10s}" + "".join(f"{f'third {i + 1}':>27s}" for i in range(3)) + f"{'overall':>10s}"
          + f"{'trainer CPU s':>15s}{'collected':>11s}")
    print(f"{'':10s}" + f"{'tok/s':>9s}{'live acc':>9s}{'eval g3':>9s}" * 3 + f"{'tok/s':>10s}")
    for mode in (m for m in ("static", "online") if m in res):
        r = res[mode]
        print(f"{mode:10s}" + "".join(f"{fmt(t['tok_s']):>9s}{fmt(t['accept_length'], 2):>9s}"
                                      f"{fmt(t.get('eval_accept_length_g3'), 3):>9s}" for t in r["thirds"])
              + f"{fmt(r['overall']['tok_s']):>10s}{fmt(r.get('trainer_cpu_s')):>15s}"
              + f"{r.get('collected_tokens') or 0:>11d}")
    off = res.get("offline_reference") or {}
    print(f"starting draft eval g3 {fmt(res['starting_draft'].get('eval_accept_length_g3'), 3)}; offline reference "
          f"{fmt(off.get('eval_accept_length_g3'), 3)} on {off.get('tokens', 0)} tokens; online final "
          f"{fmt(res.get('online_final_eval_accept_length_g3'), 3)}; time to recover "
          f"{fmt(res.get('time_to_recover_s'), 0)} s")
    for mode in (m for m in ("static", "online") if (res.get(m) or {}).get("speculation_memory")):
        m = res[mode]["speculation_memory"]
        print(f"{mode}: speculation memory at most {m['max_bytes'] / 2**20:.1f} MiB "
              f"of its {m['budget_bytes'] / 2**20:.0f} "
              f"({'within' if m['within_budget'] else 'OVER'} budget in {m['samples']} samples), ended holding "
              f"{m['final_tokens']} tokens (most {m['max_tokens']})")
    for p in res["promotions"]:
        print(f"promotion at {p['t_s']:.0f} s: {p['version']} (eval accept length {fmt(p['eval_accept_length'], 2)})")
    if "checks" in res:
        print("checks: " + json.dumps(res["checks"]["meets"]))

"""Does the default stack ever serve slower than no speculation? (issue #31's "defaults that never hurt")

    python -m benchmarks.experiments.defaults_ab --base-url http://127.0.0.1:8000 --minutes 15 \
        --prompts spec_bench_questions.jsonl gsm8k_test.jsonl humaneval.jsonl.gz --json ab.json

Against a running stack (`make run`: the default settings, the online loop collecting and training),
rounds of `tide bench serve` runs at each concurrency, each run twice back to back — the default
request, and the same with `speculative: false` — order flipped every round, until `--minutes` have
passed. The ratio default / plain of output tokens/s is taken within each pair, so a drift of the
machine or a promotion of the loop hits both sides of a ratio alike. Prompts advance through the
files round by round (each request a prompt not sent before in this run, while they last).
Prints and writes per concurrency: every round's ratio with its time, the minimum and the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import serve
from tide.prompts import load_prompts


def one_run(base_url: str, prompts: Path, concurrency: int, n: int, max_tokens: int, extra: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        argv = ["--base-url", base_url, "--prompts", str(prompts), "--concurrency", str(concurrency),
                "--num-prompts", str(n), "--max-tokens", str(max_tokens), "--json", str(out)]
        if extra:
            argv += ["--extra-body", json.dumps(extra)]
        assert serve.main(argv) == 0
        return json.loads(out.read_text())["results"][0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--prompts", nargs="+", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests-per-client", type=int, default=2, help="requests per client in each run [2]")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    pool = [q for f in args.prompts for q in load_prompts(f)]
    # interleave the files so every run mixes domains
    by_file: dict[str, list] = {}
    for q in pool:
        by_file.setdefault(q.source, []).append(q)
    mixed = [q for group in zip(*by_file.values(), strict=False) for q in group]
    cursor, rounds, t0 = 0, [], time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        while time.monotonic() - t0 < args.minutes * 60:
            r = len(rounds)
            row = {"round": r, "t_s": round(time.monotonic() - t0, 1), "runs": {}}
            for c in args.concurrency:
                n = c * args.requests_per_client
                batch = [mixed[(cursor + i) % len(mixed)] for i in range(n)]
                cursor += n
                path = Path(tmp) / f"r{r}-c{c}.jsonl"
                path.write_text("".join(json.dumps({"prompt": q.text}) + "\n" for q in batch))
                modes = [("default", {}), ("plain", {"speculative": False})]
                res = {name: one_run(args.base_url, path, c, n, args.max_tokens, extra)
                       for name, extra in (modes if r % 2 == 0 else modes[::-1])}
                ratio = res["default"]["output_tok_s"] / res["plain"]["output_tok_s"]
                row["runs"][c] = {"default_tok_s": res["default"]["output_tok_s"],
                                  "plain_tok_s": res["plain"]["output_tok_s"], "ratio": round(ratio, 3),
                                  "accept_length": res["default"]["accept_length"],
                                  "failed": res["default"]["requests_failed"] + res["plain"]["requests_failed"]}
                print(f"round {r} t={row['t_s']:6.0f}s c={c:2d}: default {res['default']['output_tok_s']:6.1f} "
                      f"plain {res['plain']['output_tok_s']:6.1f} tok/s  ratio {ratio:.3f}  accept "
                      f"{res['default']['accept_length']}", flush=True)
            rounds.append(row)
    summary = {}
    for c in args.concurrency:
        ratios = [row["runs"][c]["ratio"] for row in rounds]
        med = {k: round(statistics.median(row["runs"][c][k] for row in rounds), 1) for k in ("default_tok_s",
                                                                                             "plain_tok_s")}
        summary[c] = {"min": min(ratios), "median": round(statistics.median(ratios), 3), "rounds": len(ratios),
                      **{f"{k}_median": v for k, v in med.items()}}
        print(f"c={c:2d}: ratio min {summary[c]['min']:.3f} median {summary[c]['median']:.3f} "
              f"over {len(ratios)} rounds", flush=True)
    Path(args.json).write_text(json.dumps({"config": vars(args), "summary": summary, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

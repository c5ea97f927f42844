"""TIDE beside llama-server at the sizes CPU users serve: one table row per size and precision.

    python -m benchmarks.model_sizes --llama-server llama.cpp/build/bin/llama-server \\
        --models DIR [--sizes 0.5b 1.5b 3b] [--types BF16 Q8_0 Q4_0] [--json out.json]

For each random-weight Llama-shaped GGUF file (`python -m benchmarks.gguf_models`, written into
DIR when missing) TIDE serves it in the matching precision class (BF16 / F16 -> bf16, Q8_0 ->
int8, Q4_0 / Q4_1 -> int4) through `tide up --target FILE --drafter none`, then llama.cpp's
server serves the same file, one after the other (`--interleave ROUNDS`: both up at once, their
decode runs alternating, medians), both with the same slots × context (`--slots`,
`--context`: TIDE_MAX_BATCH / TIDE_MAX_SEQ_LEN, llama-server's -np / -c) and 2 threads; each
reports seconds to ready, the serving processes' RSS (TIDE: gateway + worker; the trainer and
the stack's storage apart) and plain decode tok/s at 1 and 4 streams (`ignore_eos`, fixed
lengths, best of 2; the values do not change the speed of plain decoding). Then, in this process,
the verification cost profile at one stream: T(1, n) for n = 1..16 at a 128-token context
(tide.engine.profiling.profile_target), the numbers that say how much speculation can gain at
that size.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import model_start

TIDE_WEIGHTS = {"BF16": "bf16", "F16": "bf16", "Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}


def model_file(models: Path, size: str, qtype: str) -> Path:
    path = models / f"llama-{size}-random.{qtype}.gguf"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "benchmarks.gguf_models", "--size", size, "--type", qtype,
                        "--out", str(models)], check=True)
    return path


def tide_row(path: Path, weights: str, port: int, max_tokens: int, timeout_s: float) -> dict:
    data = Path(tempfile.mkdtemp(prefix="tide-size-"))
    base = f"http://127.0.0.1:{port}"
    proc, ready_s = model_start.start(str(path), port, weights, data, timeout_s, "none")
    try:
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        mem = model_start.memory(base)
        tok_s = {str(n): model_start.decode(base, model, n, max_tokens) for n in (1, 4)}
        after = model_start.memory(base)
        kv_line = kv_cache_line(data)
        return {"weights": weights, "ready_s": ready_s, "serving_mb": mem["serving_mb"],
                "serving_after_decode_mb": after["serving_mb"], "rss_mb": after["rss_mb"],
                "serving_full_kv_mb": after["serving_full_kv_mb"],  # as if every slot were full
                "decode_tok_s": tok_s, "kv_cache": kv_line}
    finally:
        model_start.stop(proc)
        shutil.rmtree(data, ignore_errors=True)


def interleaved_rows(path: Path, weights: str, binary: str, port: int, slots: int, context: int, max_tokens: int,
                     rounds: int, timeout_s: float) -> tuple[dict, dict]:
    """(TIDE's row, llama-server's) with both servers up at once and their decode runs alternating,
    which one goes first alternating too: `rounds` single runs each at 1 and at 4 streams, the
    median reported (the runs under "decode_runs"). On these VMs memory bandwidth moves by 10-40 %
    within a minute (3B bf16 one stream, the same server: 6.1 to 9.9 tok/s across 20 runs), so
    one server's runs followed by the other's compare two moments as much as two servers."""
    import statistics

    data = Path(tempfile.mkdtemp(prefix="tide-size-"))
    base, ls_base = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"
    proc, ready_s = model_start.start(str(path), port, weights, data, timeout_s, "none")
    ls_proc = None
    try:
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        mem = model_start.memory(base)
        ls_proc, ls_ready, ls_cmd = model_start.start_llama_server(binary, path, port + 1, slots, context, timeout_s)
        ls_rss = model_start.process_rss_mb(ls_proc)
        runs: dict[str, dict[str, list[float]]] = {"tide": {}, "llama": {}}
        for n in (1, 4):
            ours, theirs = runs["tide"].setdefault(str(n), []), runs["llama"].setdefault(str(n), [])
            for i in range(rounds):
                pair = [(ours, base, model), (theirs, ls_base, "model")]
                for out, url, name in pair if i % 2 == 0 else pair[::-1]:
                    out.append(model_start.decode(url, name, n, max_tokens, rounds=1))
        after = model_start.memory(base)
        median = {k: {n: round(statistics.median(v), 2) for n, v in r.items()} for k, r in runs.items()}
        tide = {"weights": weights, "ready_s": ready_s, "serving_mb": mem["serving_mb"],
                "serving_after_decode_mb": after["serving_mb"], "rss_mb": after["rss_mb"],
                "serving_full_kv_mb": after["serving_full_kv_mb"], "decode_tok_s": median["tide"],
                "decode_runs": runs["tide"], "kv_cache": kv_cache_line(data)}
        llama = {"ready_s": ls_ready, "rss_mb": ls_rss, "rss_after_decode_mb": model_start.process_rss_mb(ls_proc),
                 "decode_tok_s": median["llama"], "decode_runs": runs["llama"], "command": ls_cmd}
        return tide, llama
    finally:
        if ls_proc is not None:
            model_start.stop(ls_proc)
        model_start.stop(proc)
        shutil.rmtree(data, ignore_errors=True)


def kv_cache_line(data: Path) -> str | None:
    """The worker's "KV cache: ..." start line (its slots, context and bytes), from the stack's logs."""
    for log in sorted(data.rglob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "KV cache:" in line:
                try:
                    return str(json.loads(line)["msg"])  # the services log JSON lines
                except (ValueError, KeyError, TypeError):
                    return line.strip()
    return None


def verify_costs(path: Path, weights: str, ns: range, reps: int) -> dict[str, float]:
    """T(1, n) in ms, n in `ns`, on the worker's model (the weights as it loads them, 2 threads)."""
    import torch

    from tide.engine.llama import LlamaModel
    from tide.engine.profiling import profile_target
    from tide.precision import resolve_weights
    from tide.target import resolve_target

    torch.set_num_threads(2)
    dtype, fmt = resolve_weights(weights)
    model = LlamaModel.load(resolve_target(path), dtype=dtype, weight_format=fmt)
    try:
        table = profile_target(model, [1], list(ns), reps)[1]
    finally:
        del model
        gc.collect()
    return {str(n): ms for n, ms in table.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=Path, required=True, help="directory of the GGUF files (written when missing)")
    ap.add_argument("--sizes", nargs="+", default=["0.5b", "1.5b", "3b"])
    ap.add_argument("--types", nargs="+", default=["BF16", "Q8_0", "Q4_0"], choices=sorted(TIDE_WEIGHTS))
    ap.add_argument("--llama-server", help="a llama-server binary (omitted: TIDE's rows alone)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="both servers up at once, ROUNDS alternating decode runs each (medians); 0 = one "
                         "server after the other, best of 2 [0]")
    ap.add_argument("--verify-max-n", type=int, default=16, help="T(1, n) for n = 1..this; 0 = none [16]")
    ap.add_argument("--verify-reps", type=int, default=3)
    ap.add_argument("--port", type=int, default=8290)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    os.environ["TIDE_MAX_BATCH"], os.environ["TIDE_MAX_SEQ_LEN"] = str(args.slots), str(args.context)
    rows = []
    for size in args.sizes:
        for qtype in args.types:
            path = model_file(args.models, size, qtype)
            weights = TIDE_WEIGHTS[qtype]
            row: dict = {"size": size, "type": qtype, "file_gib": round(path.stat().st_size / 2**30, 2),
                         "read_warm_s": model_start.read_seconds(path, cold=False)}
            if args.llama_server and args.interleave:
                print(f"{size} {qtype}: TIDE {weights} and llama-server, interleaved", flush=True)
                row["tide"], row["llama_server"] = interleaved_rows(
                    path, weights, args.llama_server, args.port, args.slots, args.context, args.max_tokens,
                    args.interleave, args.timeout)
            else:
                print(f"{size} {qtype}: TIDE {weights}", flush=True)
                row["tide"] = tide_row(path, weights, args.port, args.max_tokens, args.timeout)
            if args.llama_server and not args.interleave:
                print(f"{size} {qtype}: llama-server", flush=True)
                row["llama_server"] = model_start.llama_server(args.llama_server, path, args.port + 1, args.slots,
                                                               args.context, args.max_tokens, args.timeout)
            if args.verify_max_n:  # 0: no verification profile
                t0 = time.monotonic()
                row["tide"]["verify_ms"] = verify_costs(path, weights, range(1, args.verify_max_n + 1),
                                                        args.verify_reps)
                row["verify_profile_s"] = round(time.monotonic() - t0, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.json:  # after every row: a long run that stops keeps what it measured
                args.json.write_text(json.dumps({"slots": args.slots, "context": args.context,
                                                 "max_tokens": args.max_tokens, "rows": rows}, indent=1) + "\n")
    print(table(rows))


def table(rows: list[dict]) -> str:
    """The README's markdown rows: TIDE / llama-server side by side per size and precision."""
    out = ["| size | file | TIDE | tok/s 1 stream (TIDE / llama / ratio) | 4 streams | ready s (TIDE / llama) "
           "| serving RSS GB (TIDE / llama / ratio) | every slot full |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, ls = r["tide"], r.get("llama_server")

        def pair(a, b, digits=2):
            return f"{a:.{digits}f} / {b:.{digits}f} / {a / b:.2f}" if b else f"{a:.{digits}f}"

        one = pair(t["decode_tok_s"]["1"], ls["decode_tok_s"]["1"] if ls else None)
        four = pair(t["decode_tok_s"]["4"], ls["decode_tok_s"]["4"] if ls else None)
        ready = f"{t['ready_s']} / {ls['ready_s']}" if ls else f"{t['ready_s']}"
        rss = pair(t["serving_after_decode_mb"] / 1024, ls["rss_after_decode_mb"] / 1024 if ls else None)
        full = pair(t["serving_full_kv_mb"] / 1024, ls["rss_after_decode_mb"] / 1024 if ls else None) \
            if "serving_full_kv_mb" in t else "-"
        out.append(f"| {r['size']} | {r['type']} | {t['weights']} | {one} | {four} | {ready} | {rss} | {full} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()

"""`tide up --target FILE` on a model of any size: how long until it serves, what it holds, how fast
it decodes.

    python -m benchmarks.model_start --target llama-8b-random.Q8_0.gguf [--weights int8] [--starts 2]
        [--drop-caches] [--json out.json]

Each start is a fresh `tide up` (its own data directory) timed from the command to the worker's
"ready" line; `--drop-caches` empties the page cache first (root only), so the first start reads
the file from disk as a first start on a fresh machine does. The first start of a file also
describes it once (tide.target) and measures the worker's latency profile (tide.engine.profiling,
cached); later starts find both. After the last start: the resident memory of every process
(gateway's /v1/status), then plain decoding (`ignore_eos`, fixed lengths) at 1 and 4 streams
through the OpenAI API, tokens/s of the output tokens. Also `cat FILE > /dev/null` from a cold
cache: the time to read the file once, the issue's yardstick for a first start.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

READY = re.compile(r"inference-0 ready on")


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_seconds(path: Path, cold: bool) -> float | None:
    if cold and not drop_caches():
        return None
    t0 = time.monotonic()
    with path.open("rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass
    return round(time.monotonic() - t0, 2)


def start(target: str, port: int, weights: str | None, data_dir: Path, timeout_s: float,
          drafter: str) -> tuple[subprocess.Popen, float]:
    """A `tide up` serving `target`, and the seconds until its worker was ready."""
    cmd = [sys.executable, "-m", "tools.cli", "up", "--target", target, "--port", str(port),
           "--data-dir", str(data_dir), "--drafter", drafter, "--no-collection"]
    if weights:
        cmd += ["--weights", weights]
    log = (data_dir / "up.log").open("w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_ready(proc, lambda: bool(READY.search((data_dir / "up.log").read_text(errors="replace"))), timeout_s,
               f"tide up (see {data_dir / 'up.log'})")
    return proc, round(time.monotonic() - t0, 1)


def wait_ready(proc: subprocess.Popen, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `ready` until it holds; raise (stopping `proc`) when `proc` exits or `timeout_s` passes."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if ready():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}")
        time.sleep(0.5)
    stop(proc)
    raise TimeoutError(f"{what} not ready in {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def memory(base: str, tries: int = 30) -> dict:
    """MiB per process of the stack (the gateway's /v1/status), and gateway + workers together.
    Just after the start the status page may not have every process's reading yet: asked again."""
    for _ in range(tries):
        status = httpx.get(f"{base}/v1/status", timeout=30).json()
        rss = {name: round((s.get("rss_bytes") or 0) / 2**20) for name, s in status.get("services", {}).items()}
        if rss.get("inference-0") and rss.get("gateway"):
            break
        time.sleep(1)
    serving = sum(v for k, v in rss.items() if k == "gateway" or k.startswith("inference"))
    # The KV cache is held as written (tide.allocator.zeros_on_demand): with every slot full the
    # serving processes would hold the unwritten rest too.
    kv = sum(w.get("memory", {}).get("kv_cache_bytes") or 0 for w in status.get("workers", []))
    written = sum(w.get("memory", {}).get("kv_cache_resident_bytes") or 0 for w in status.get("workers", []))
    return {"rss_mb": rss, "serving_mb": serving, "stack_mb": sum(rss.values()), "kv_cache_mb": round(kv / 2**20),
            "kv_cache_resident_mb": round(written / 2**20),
            "serving_full_kv_mb": serving + round((kv - written) / 2**20)}


def decode(base: str, model: str, streams: int, max_tokens: int, rounds: int = 2) -> float:
    """Output tokens/s of `streams` concurrent completions of `max_tokens` each (best of `rounds`)."""
    body = {"model": model, "prompt": "The history of the city begins", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}

    def one(_):
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=3600)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    best = 0.0
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        for _ in range(rounds):
            t0 = time.monotonic()
            tokens = sum(pool.map(one, range(streams)))
            best = max(best, tokens / (time.monotonic() - t0))
    return round(best, 2)


def start_llama_server(binary: str, target: Path, port: int, slots: int, context: int,
                       timeout_s: float) -> tuple[subprocess.Popen, float, str]:
    """llama.cpp's server on the same file, as TIDE's worker runs it: 2 threads, `slots` slots of
    `context` tokens each (its -c is the total); (process, seconds to ready, command line)."""
    cmd = [binary, "-m", str(target), "--port", str(port), "-t", "2", "-tb", "2", "-np", str(slots),
           "-c", str(slots * context), "--no-webui"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def healthy() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_ready(proc, healthy, timeout_s, f"llama-server ({' '.join(cmd)})")
    return proc, round(time.monotonic() - t0, 1), " ".join(cmd)


def process_rss_mb(proc: subprocess.Popen) -> int:
    from tide.memory import tree_rss_bytes

    return round(sum(tree_rss_bytes(proc.pid).values()) / 2**20)


def llama_server(binary: str, target: Path, port: int, slots: int, context: int, max_tokens: int,
                 timeout_s: float) -> dict:
    """`start_llama_server`, then its seconds to ready, RSS, decode tok/s at 1 and 4 streams."""
    proc, ready, cmd = start_llama_server(binary, target, port, slots, context, timeout_s)
    try:
        rss = process_rss_mb(proc)
        tok_s = {str(n): decode(f"http://127.0.0.1:{port}", "model", n, max_tokens) for n in (1, 4)}
        return {"ready_s": ready, "rss_mb": rss, "rss_after_decode_mb": process_rss_mb(proc), "decode_tok_s": tok_s,
                "command": cmd}
    finally:
        stop(proc)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--weights", default=None)
    ap.add_argument("--drafter", default="eagle3", help="the worker's drafter (decode runs ask for none) [eagle3]")
    ap.add_argument("--starts", type=int, default=2)
    ap.add_argument("--drop-caches", action="store_true", help="empty the page cache before the first start (root)")
    ap.add_argument("--port", type=int, default=8190)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--llama-server", help="a llama-server binary: run it on the same file after TIDE, "
                    "with the slots and context TIDE's worker derived (--slots / --context)")
    ap.add_argument("--slots", type=int, default=10)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--skip-tide", action="store_true", help="only the llama-server run")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    target = Path(args.target)
    out: dict = {"target": str(target), "file_gib": round(target.stat().st_size / 2**30, 2),
                 "read_cold_s": read_seconds(target, cold=True) if args.drop_caches else None, "starts": []}
    base = f"http://127.0.0.1:{args.port}"
    for i in range(0 if args.skip_tide else args.starts):
        data = Path(tempfile.mkdtemp(prefix="tide-start-"))
        if i == 0 and args.drop_caches:
            drop_caches()
        proc, ready_s = start(str(target), args.port, args.weights, data, args.timeout, args.drafter)
        out["starts"].append(ready_s)
        print(f"start {i + 1}: ready in {ready_s} s", flush=True)
        last = i == args.starts - 1
        try:
            if last:
                model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
                out["memory"] = memory(base)
                out["decode_tok_s"] = {str(n): decode(base, model, n, args.max_tokens) for n in (1, 4)}
                out["memory_after_decode"] = memory(base)
        finally:
            stop(proc)
            shutil.rmtree(data, ignore_errors=True)
    if args.llama_server:
        if args.drop_caches:
            drop_caches()
        out["llama_server"] = llama_server(args.llama_server, target, args.port + 1, args.slots, args.context,
                                           args.max_tokens, args.timeout)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()

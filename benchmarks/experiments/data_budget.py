"""Does the chunk bucket stay within its byte budget while the loop collects, trains and promotes?
(issue #61's measurement: "a 30-minute collection run at the default settings keeps the bucket
within its budget, and the loop still trains and promotes")

    nice -n 19 python -m benchmarks.experiments.data_budget --minutes 30 --budget-mib 128 --pause-s 2 \
        --json docs/results/data-handling/budget-128mib.json

Starts the default stack in-process (`tide up`'s Stack: the reference target, the online loop on,
the generated data key) with one change: the trainer's TIDE_CHUNK_BUCKET_BYTES (`--budget-mib`; 0 =
the default 8 GiB), so that a short run on a small machine reaches it. `--clients` closed-loop chat
clients (greedy, `--tokens` output tokens, `--pause-s` between requests) send varied prompts through
the gateway for `--minutes`. Every `--sample-s` seconds it records what the trainer reports
(`/v1/status` trainer.data: bucket bytes against the budget, deletions by reason), what S3 holds under
`chunks/` (listed: object count and bytes, independent of the trainer's own bookkeeping), the
workers' spool bytes on disk, collection on/off, the trainer's state, training cycles and
promotions. At the end: the maxima, how often and by how much S3 held more than the budget (the
budget is applied every TIDE_TRAINER_SWEEP_INTERVAL_S, so the bucket can exceed it by what the
workers write in one interval), and whether the stored blobs are sealed (tide.datakeys' header).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tide.blobs import StorageSettings
from tide.datakeys import MAGIC
from tools.launcher import BUCKET, Stack, StackConfig, service_env

TOPICS = ["the sea", "a mountain", "bread", "rain", "a library", "trains", "the moon", "coffee", "winter",
          "a city", "music", "gardens", "rivers", "clocks", "birds", "friendship", "chess", "volcanoes",
          "bicycles", "tea", "deserts", "bridges", "owls", "autumn"]
TASKS = ["Write a short story about {}.", "Explain {} to a child.", "List five facts about {}.",
         "Write a poem about {}.", "Describe a day spent with {}.", "What would a scientist say about {}?"]


def chunk_objects(s3) -> tuple[int, int]:
    """(objects, bytes) under chunks/ in the bucket."""
    n = size = 0
    for obj in s3.list_objects(BUCKET, prefix="chunks/", recursive=True):
        n, size = n + 1, size + (obj.size or 0)
    return n, size


def sealed_share(s3, limit: int = 200) -> tuple[int, int]:
    """(sealed, checked) among up to `limit` chunk blobs: their first bytes are tide.datakeys' MAGIC."""
    sealed = checked = 0
    for obj in s3.list_objects(BUCKET, prefix="chunks/", recursive=True):
        if checked >= limit:
            break
        r = s3.get_object(BUCKET, obj.object_name, offset=0, length=len(MAGIC))
        try:
            sealed += r.read() == MAGIC
        finally:
            r.close()
            r.release_conn()
        checked += 1
    return sealed, checked


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def load(base: str, model: str, stop: threading.Event, clients: int, tokens: int, pause_s: float,
         outcomes: list[int]) -> list[threading.Thread]:
    def run(i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(base_url=base, timeout=600) as c:
            while not stop.is_set():
                prompt = rng.choice(TASKS).format(rng.choice(TOPICS))
                try:
                    r = c.post("/v1/chat/completions", json={
                        "model": model, "max_tokens": tokens, "temperature": 0,
                        "messages": [{"role": "user", "content": prompt}]})
                    outcomes.append(r.status_code)
                except httpx.HTTPError:
                    outcomes.append(-1)
                stop.wait(pause_s)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    return threads


def sample(base: str, s3, spool: Path, t0: float) -> dict:
    doc = httpx.get(f"{base}/v1/status", timeout=30).json()
    tr, ctl = doc.get("trainer") or {}, doc.get("controller") or {}
    data = tr.get("data") or {}
    n, size = chunk_objects(s3)
    cycles = (doc.get("training") or {}).get("cycles") or []
    return {"t_s": round(time.monotonic() - t0, 1), "s3_chunks": n, "s3_chunk_bytes": size,
            "bucket_chunk_bytes": data.get("bucket_chunk_bytes"), "budget_bytes": data.get("bucket_budget_bytes"),
            "deleted": data.get("chunks_deleted") or {}, "bytes_deleted": data.get("chunk_bytes_deleted"),
            "quarantined": data.get("chunks_quarantined"), "spool_bytes": dir_bytes(spool),
            "collection": (ctl.get("collection") or {}).get("enabled"), "trainer": tr.get("state"),
            "buffered_tokens": tr.get("buffered_tokens"), "cycles": len(cycles),
            "promoted": sum(bool(c.get("promoted")) for c in cycles),
            "effective": ((doc.get("registry") or {}).get("pointer") or {}).get("effective"),
            "tokens_per_s": (doc.get("fleet") or {}).get("tokens_per_s")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--budget-mib", type=float, default=0.0, help="TIDE_CHUNK_BUCKET_BYTES in MiB (0: the default)")
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--pause-s", type=float, default=0.5)
    ap.add_argument("--sample-s", type=float, default=20.0)
    ap.add_argument("--target", default="ref")
    ap.add_argument("--data-dir", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="tide-data-budget-"))
    env = {"trainer": {"TIDE_CHUNK_BUCKET_BYTES": str(int(args.budget_mib * (1 << 20)))}} if args.budget_mib else {}
    cfg = StackConfig(port=0, target=args.target, data_dir=data_dir, env=env)
    stack = Stack(cfg)
    samples: list[dict] = []
    outcomes: list[int] = []
    stop = threading.Event()
    try:
        ep = stack.start()
        base = f"http://{ep.gateway_host}:{ep.gateway_port}"
        s3 = StorageSettings.from_env(service_env("trainer", cfg, ep)).s3_client()
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        print(f"stack up ({base}, model {model}, data in {data_dir}); load for {args.minutes} min", flush=True)
        t0 = time.monotonic()
        threads = load(base, model, stop, args.clients, args.tokens, args.pause_s, outcomes)
        end = t0 + 60 * args.minutes
        while time.monotonic() < end:
            time.sleep(min(args.sample_s, max(0.0, end - time.monotonic())))
            stack.supervise()
            try:
                s = sample(base, s3, data_dir / "spool", t0)
            except (httpx.HTTPError, ValueError) as e:
                print(f"sample failed: {e}", flush=True)
                continue
            samples.append(s)
            print(json.dumps(s), flush=True)
        stop.set()
        for t in threads:
            t.join(timeout=600)
        sealed, checked = sealed_share(s3)
        last = samples[-1] if samples else {}
        budget = last.get("budget_bytes") or 0
        over = [s for s in samples if budget and s["s3_chunk_bytes"] > budget]
        summary = {
            "minutes": args.minutes, "clients": args.clients, "tokens": args.tokens, "pause_s": args.pause_s,
            "target": args.target, "requests": len(outcomes), "requests_ok": outcomes.count(200),
            "budget_bytes": budget,
            "max_s3_chunk_bytes": max((s["s3_chunk_bytes"] for s in samples), default=None),
            "max_trainer_bucket_bytes": max((s["bucket_chunk_bytes"] or 0 for s in samples), default=None),
            "samples_over_budget": len(over), "samples": len(samples),
            "max_over_budget_bytes": max((s["s3_chunk_bytes"] - budget for s in over), default=0),
            "final_s3_chunk_bytes": last.get("s3_chunk_bytes"), "final_s3_chunks": last.get("s3_chunks"),
            "deleted": last.get("deleted"), "bytes_deleted": last.get("bytes_deleted"),
            "quarantined": last.get("quarantined"), "max_spool_bytes": max((s["spool_bytes"] for s in samples),
                                                                           default=None),
            "cycles": last.get("cycles"), "promoted": last.get("promoted"), "effective": last.get("effective"),
            "sealed_blobs": sealed, "checked_blobs": checked,
        }
        print(json.dumps(summary, indent=1), flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"summary": summary, "samples": samples}, separators=(",", ":")))
        return 0
    finally:
        stop.set()
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())

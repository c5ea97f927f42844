"""Serving throughput with hidden-state collection on vs off (BRIEF §6: collection is nearly free).

    python -m benchmarks.collection --batch 1 16 --tokens 64 --repeats 3

Runs the real service stack (engine, worker, telemetry, exporter writing real chunks to S3 and
refs to Redis) on the configured target (default: the reference model, bf16). Redis and S3 come
from TIDE_REDIS_URL / TIDE_S3_* when TIDE_S3_ENDPOINT is set, else local servers are started
(tide.servers). For each batch size, off and on alternate `repeats` times (collection flipped by a
controller Decision, as in production); each run submits `batch` greedy requests at once with
`tokens` output tokens each (EOS ignored) and measures output tokens per second of wall time.
Both modes generate identical tokens, so the work is the same. Also reported: the time the
capture hook itself takes (the serving thread's only extra work when collection is on) as a
share of the on-runs' wall time, a figure that CPU contention from other processes barely skews.
Prints a table; --json writes it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import uuid

from services.inference.app import build, load_target
from services.inference.requests import ErrorEvent, FinalEvent, GenerationRequest
from services.inference.settings import InferenceSettings
from tide.blobs import StorageSettings
from tide.decisions import Decision
from tide.servers import local_data_plane

TOPICS = ["the sea", "a mountain", "bread", "rain", "a library", "trains", "the moon", "coffee", "winter", "a city",
          "music", "gardens", "rivers", "clocks", "birds", "friendship"]


def run_once(worker, prompts: list[str], tokens: int, tag: str) -> float:
    """Output tokens per second for all prompts submitted at once."""
    t0 = time.perf_counter()
    handles = [worker.submit(GenerationRequest(request_id=f"{tag}-{i}", prompt_text=p, max_tokens=tokens,
                                               temperature=0.0, ignore_eos=True)) for i, p in enumerate(prompts)]
    total = 0
    for h in handles:
        while True:
            ev = h.events.get(timeout=600)
            if isinstance(ev, FinalEvent):
                total += ev.completion_tokens
                break
            if isinstance(ev, ErrorEvent):
                raise RuntimeError(ev.message)
    return total / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        env = local_data_plane(stack, dict(os.environ))
        env.setdefault("TIDE_STREAM_PREFIX", f"bench-{uuid.uuid4().hex[:8]}")
        base = InferenceSettings.from_env(env)
        settings = InferenceSettings(**{**base.__dict__, "listen": "127.0.0.1:0", "metrics_port": 0,
                                        "max_batch": max(args.batch), "max_seq_len": 512,
                                        "storage": StorageSettings.from_env(env)})
        model, tokenizer, model_id = load_target(settings)
        svc = build(settings, model=model, tokenizer=tokenizer, model_id=model_id)
        stack.callback(svc.stop, 1.0)
        worker = svc.worker
        hook_s = [0.0]
        add = svc.exporter.add

        def timed_add(rows, prompt_lens) -> None:
            t = time.perf_counter()
            add(rows, prompt_lens)
            hook_s[0] += time.perf_counter() - t

        svc.exporter.add = timed_add
        run_once(worker, ["Warm up."], 8, "warm")
        rows = []
        for batch in args.batch:
            prompts = [f"Write a short poem about {TOPICS[i % len(TOPICS)]}." for i in range(batch)]
            speeds: dict[bool, list[float]] = {False: [], True: []}
            hook_s[0], on_wall = 0.0, 0.0
            for rep in range(args.repeats):
                for on in (False, True):
                    worker.apply_decision(Decision(decision_id=uuid.uuid4().hex, collection_enabled=on))
                    t0 = time.perf_counter()
                    speeds[on].append(run_once(worker, prompts, args.tokens, f"b{batch}-{rep}-{int(on)}"))
                    on_wall += (time.perf_counter() - t0) if on else 0.0
            off, on = statistics.median(speeds[False]), statistics.median(speeds[True])
            rows.append({"batch": batch, "tokens": args.tokens, "off_tok_s": off, "on_tok_s": on,
                         "on_over_off": on / off, "hook_share": hook_s[0] / on_wall,
                         "runs_off": speeds[False], "runs_on": speeds[True]})
        svc.exporter.flush_soon()
        svc.exporter.wait_idle(30)
        st = svc.exporter.stats
        print(f"target {model_id} ({settings.dtype}, {settings.device}), drafter {settings.drafter}, "
              f"policy {settings.policy} {dict(settings.policy_params)}")
        print(f"{'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} {'hook %':>7}  runs off | on")
        for r in rows:
            runs = " ".join(f"{x:.1f}" for x in r["runs_off"]) + " | " + " ".join(f"{x:.1f}" for x in r["runs_on"])
            print(f"{r['batch']:>5} {r['off_tok_s']:>10.1f} {r['on_tok_s']:>10.1f} {r['on_over_off']:>7.3f} "
                  f"{100 * r['hook_share']:>7.2f}  {runs}")
        print(f"exported: {st.chunks_written} chunks, {st.tokens_exported} rows, {st.bytes_written / 1e6:.1f} MB; "
              f"dropped rows: buffers full {st.tokens_dropped_full}, S3 {st.tokens_dropped_s3}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "exporter": st.__dict__, "target": model_id}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

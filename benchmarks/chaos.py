"""`tide chaos`: kill the stack's processes one at a time under load, and count what it cost.

    tide chaos [--quick] [--scenarios kill-trainer,kill-worker,...] [--json FILE]

Starts a whole stack in this process (tools.launcher.Stack, supervised as `tide up` is: a process
that dies is restarted on its address with backoff) with hidden-state collection forced on, small
chunks and a short flush interval (every request's tokens end up in chunks within seconds; as many
chunk buffers as hold the rows of the worker's default 3 x 2048, so the exporter has the slack it
has in production) and the trainer's automatic training off (the suite is about chunk intake, not
training). Then, per
scenario, with `--clients` closed-loop clients sending greedy completions (short `--max-tokens`,
`ignore_eos`) through the gateway:

  pre     load for `--pre-s` seconds, until chunks are flowing (a new chunk blob is in S3);
  fault   kill -9 one process (trainer, controller, registry, worker inference-0, Redis, S3), or
          SIGSTOP S3 for `--stop-s` seconds then SIGCONT;
  recover load goes on until the killed process is `ready` again in stack.json, then `--post-s`;
  drain   load stops; wait (at most `--drain-s`) until every chunk of the scenario is recorded in
          the trainer's manifest or dead-lettered and the workers' spools are empty.

Per scenario (JSON and a table): `requests` (sent, ok, failed), `unavailable_s` (the longest span of
the load window without a successful response), `restarts` (per process, from stack.json),
`recovery_s` (fault -> the process ready again; the stop's length for SIGSTOP) and `chunks`, read
from S3, the streams and the trainer's manifests (benchmarks.chaos_accounting), not from counters:
`blobs` in S3, `trained` (recorded in the manifest), `dead_lettered`, `in_stream` (still waiting
or pending), `lost` (a blob none of those accounts for; `lost_why` says at which step),
`duplicated` (recorded or trained more than once); plus what the workers' exporters counted as
dropped (their `tide_chunks_dropped` and `tide_chunk_tokens_dropped` counters, summed over worker
restarts): `dropped_counted` chunks that never reached S3 and `dropped_tokens` rows; `in_spool`,
the entries still in the workers' on-disk spools after the drain (their gauge). `written` = blobs +
dropped_counted, every chunk the workers formed. `rows` compares the token rows the
successful requests made the workers process (prompt + completion - 1 each, less the prompt
tokens the prefix cache served: what collection captures) with the rows in the scenario's chunks
and the rows counted as dropped; `unaccounted`, the rest, is what vanished without a count (a killed
worker's chunk buffers) or, negative, what was captured twice (a request retried after its prompt was processed).

Targets (each scenario's `checks`; all must hold for `passed`): `flowing` (chunk blobs were
written), `lost` = 0, `duplicated` = 0, `dropped` (the exporters dropped no chunk and no row) and
`drained` (after the drain nothing waits in a stream or a spool); killing the trainer, controller,
registry, Redis or S3, or stopping S3: >= 99 % of the requests succeed (`availability`) and every
row they served is in a chunk or counted as dropped (`rows`: unaccounted = 0); killing a worker:
only requests in flight at the kill fail (`only_in_flight_failed`: each failed request was sent
before the kill) and service resumes within 30 s (`resumed`: no span without a success longer
than 30 s). Two workers serve, so a worker's death is a retry on the other one for every request
that had not started on it; the killed worker's own way back (process start, model load) is its
`recovery_s`. Every scenario must see its process back within `--recover-timeout-s`
(`recovered`). Exit status 0 when every scenario passed, else 1.

`--quick`: a tiny random Llama with the reference tokenizer (milliseconds a step) built in the
data directory, shorter phases; without it, the reference model (`--target ref`).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.chaos_accounting import Ledger, account, settled
from benchmarks.report import standalone_main, write_json
from tide import blobs, streams
from tide.blobs import StorageSettings

DRAIN_POLL_S = 1.0
SLACK_ROWS = 3 * 2048  # the worker's default chunk buffers x chunk tokens
RESUME_LIMIT_S = 30.0  # a killed worker serves again within this
AVAILABILITY = 0.99  # share of requests that must succeed when no worker is killed
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,",
           "The three laws of thermodynamics state", "To make a cup of tea, first", "SELECT name FROM users WHERE",
           "The mitochondria is", "In 1969, the first humans", "A haiku about the sea:", "import numpy as np\n")


@dataclass(frozen=True)
class Scenario:
    name: str
    unit: str  # the supervisor's name for the process (stack.json "services")
    action: str  # "kill" (SIGKILL) or "stop" (SIGSTOP, SIGCONT after --stop-s)

    @property
    def worker(self) -> bool:
        return self.unit.startswith("inference")


SCENARIOS = (Scenario("kill-trainer", "trainer", "kill"), Scenario("kill-controller", "controller", "kill"),
             Scenario("kill-registry", "registry", "kill"), Scenario("kill-worker", "inference-0", "kill"),
             Scenario("kill-redis", "redis", "kill"), Scenario("kill-s3", "s3", "kill"),
             Scenario("stop-s3", "s3", "stop"))
BY_NAME = {s.name: s for s in SCENARIOS}
QUICK = {"pre_s": 4.0, "post_s": 4.0, "drain_s": 30.0, "chunk_tokens": 64, "flush_s": 1.0, "max_tokens": 16}
FULL = {"pre_s": 15.0, "post_s": 15.0, "drain_s": 90.0, "chunk_tokens": 256, "flush_s": 2.0, "max_tokens": 32}


# ------------------------------------------------------------------------------------ the stack


def tiny_target(path: Path) -> Path:
    """A random 8-layer Llama (hidden 64) with the reference model's tokenizer and chat template, as
    the stack tests use: a step takes milliseconds, the chunks have the real format."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tide.target import resolve_target

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      initializer_range=0.15, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    ref = resolve_target("ref").path
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ref / name, path / name)
    return path


def stack_env(args, data_dir: Path) -> dict[str, dict[str, str]]:
    """Collection on with small chunks flushed often, in as many buffers as hold the rows of the
    defaults' (SLACK_ROWS: what the exporter can hold while its writer is stuck, e.g. on a hung S3);
    the trainer takes chunks in, never trains."""
    return {"inference": {"TIDE_CHUNK_TOKENS": str(args.chunk_tokens), "TIDE_FLUSH_INTERVAL_S": str(args.flush_s),
                          "TIDE_CHUNK_BUFFERS": str(args.chunk_buffers), "TIDE_COLLECTION": "1",
                          "TIDE_DRAFT_CACHE_DIR": str(data_dir / "draft-cache")},
            "controller": {"TIDE_CONTROLLER_COLLECTION": "on"},
            "trainer": {"TIDE_TRAINER_AUTO_TRAIN": "0", "TIDE_TRAINER_AUTO_PROMOTE": "0"}}


class Running:
    """A started stack, supervised by a thread of this process, and what reads its state."""

    def __init__(self, stack) -> None:
        from tools.launcher import BUCKET, STREAM_PREFIX, service_env

        self.stack, self.ep = stack, stack.endpoints
        self.bucket, self.names = BUCKET, streams.StreamNames(STREAM_PREFIX)
        storage = StorageSettings.from_env(service_env("trainer", stack.cfg, self.ep))
        self.s3 = storage.s3_client()
        self.redis = storage.redis_client(socket_timeout=10)
        self.base = f"http://{self.ep.gateway_host}:{self.ep.gateway_port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="chaos-supervisor", daemon=True)
        self._thread.start()

    def _supervise(self) -> None:
        while not self._stop.wait(0.25):
            self.stack.supervise()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.redis.close()

    def services(self) -> dict[str, dict]:
        """stack.json's `services` (state, restarts, last_exit, pid per process)."""
        import json

        path = self.stack.run_dir / "stack.json"
        for _ in range(20):  # the supervisor may be rewriting it
            try:
                return json.loads(path.read_text())["services"]
            except (ValueError, OSError):
                time.sleep(0.05)
        raise RuntimeError(f"cannot read {path}")

    def ledger(self) -> Ledger:
        return Ledger.read(self.s3, self.bucket, self.redis, self.names)

    def blob_ids(self) -> set[str]:
        from benchmarks.chaos_accounting import chunk_id_of_key

        return {chunk_id_of_key(k) for k in blobs.list_keys(self.s3, self.bucket, "chunks/")}


# ------------------------------------------------------------------------------------ load


class Load:
    """`clients` closed-loop clients sending completions through the gateway until `stop()` (or
    `max_requests` sent); each request's send/answer times (monotonic) and outcome are kept."""

    def __init__(self, base: str, model: str, clients: int, max_tokens: int, timeout_s: float,
                 max_requests: int = 100_000) -> None:
        self.base, self.model, self.max_tokens, self.timeout_s = base, model, max_tokens, timeout_s
        self.max_requests, self.records, self._lock = max_requests, [], threading.Lock()
        self._stop, self._sent = threading.Event(), 0
        self._threads = [threading.Thread(target=self._client, args=(i,), name=f"chaos-client-{i}", daemon=True)
                         for i in range(clients)]

    def start(self) -> Load:
        for th in self._threads:
            th.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        for th in self._threads:
            th.join(self.timeout_s + 10)
        return sorted(self.records, key=lambda r: r["t0"])

    def _client(self, i: int) -> None:
        with httpx.Client(base_url=self.base, timeout=self.timeout_s) as http:
            while not self._stop.is_set():
                with self._lock:
                    if self._sent >= self.max_requests:
                        return
                    k, self._sent = self._sent, self._sent + 1
                body = {"model": self.model, "prompt": f"{PROMPTS[k % len(PROMPTS)]} ({k})", "temperature": 0.0,
                        "max_tokens": self.max_tokens, "ignore_eos": True, "workload": "chaos"}
                t0, error, rows = time.monotonic(), "", 0
                try:
                    r = http.post("/v1/completions", json=body)
                    if r.status_code != 200:
                        error = f"HTTP {r.status_code}: {r.text[:120]}"
                    else:
                        usage = r.json()["usage"]
                        # rows captured: the prompt tokens the prefix cache did not serve, then the output
                        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                        rows = usage["prompt_tokens"] - cached + usage["completion_tokens"] - 1
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    error = f"{type(e).__name__}: {e}"[:160]
                    self._stop.wait(0.2)  # the gateway itself unreachable: do not spin
                with self._lock:
                    self.records.append({"t0": t0, "t1": time.monotonic(), "error": error, "tokens": rows})


def unavailable_s(records: list[dict], start: float, end: float) -> float:
    """The longest span of [start, end] with no successful response."""
    marks = [start] + sorted(r["t1"] for r in records if not r["error"]) + [end]
    return max(b - a for a, b in zip(marks, marks[1:], strict=False))


# ------------------------------------------------------------------------------------ dropped


def _scrape(port: int) -> dict[str, float] | None:
    """A worker's dropped-chunk counters (summed over reasons) and its spool's entries (chunks waiting
    for S3, refs for Redis); None when it does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as r:
            text = r.read().decode()
    except OSError:
        return None
    out = {"chunks": 0.0, "tokens": 0.0, "spool": 0.0}
    for fam in text_string_to_metric_families(text):
        if key := {"tide_chunks_dropped": "chunks", "tide_chunk_tokens_dropped": "tokens"}.get(fam.name):
            out[key] += sum(s.value for s in fam.samples if s.name.endswith("_total"))
        elif fam.name == "tide_chunk_spool_entries":
            out["spool"] += sum(s.value for s in fam.samples)
    return out


class DropCounter(threading.Thread):
    """Samples every worker's dropped counters each second; a counter that went down belongs to a
    restarted worker, so what the dead one had counted is kept (totals over restarts). `spooled()`:
    the workers' spool entries now (the last value heard from a worker that does not answer)."""

    def __init__(self, ports: list[int], every_s: float = 1.0) -> None:
        super().__init__(name="chaos-drops", daemon=True)
        self.ports, self.every_s = ports, every_s
        self._last = {p: {"chunks": 0.0, "tokens": 0.0, "spool": 0.0} for p in ports}
        self._base = {p: {"chunks": 0.0, "tokens": 0.0} for p in ports}
        self._lock, self._done = threading.Lock(), threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.every_s):
            self.sample()

    def stop(self) -> None:
        self._done.set()
        self.join(10)

    def sample(self) -> None:
        for p in self.ports:
            got = _scrape(p)
            if got is None:
                continue
            with self._lock:
                for k, v in got.items():
                    if k in self._base[p] and v < self._last[p][k]:  # the worker restarted: counters began again
                        self._base[p][k] += self._last[p][k]
                    self._last[p][k] = v

    def totals(self) -> dict[str, int]:
        self.sample()
        with self._lock:
            return {k: int(sum(self._base[p][k] + self._last[p][k] for p in self.ports)) for k in ("chunks", "tokens")}

    def spooled(self) -> int:
        self.sample()
        with self._lock:
            return int(sum(self._last[p]["spool"] for p in self.ports))


# ------------------------------------------------------------------------------------ a scenario


def _signal(pid: int | None, sig: int) -> None:
    if pid:
        os.kill(pid, sig)


def run_scenario(run: Running, drops: DropCounter, sc: Scenario, args, model: str) -> dict:
    """One scenario on the running stack (module doc: pre, fault, recover, drain)."""
    known0, before, drops0 = run.ledger().known, run.services(), drops.totals()
    load = Load(run.base, model, args.clients, args.max_tokens, args.request_timeout_s).start()
    t_start = time.monotonic()
    deadline = t_start + args.pre_s + 60
    time.sleep(args.pre_s)
    while not (run.blob_ids() - known0) and time.monotonic() < deadline:  # chunks must be flowing
        time.sleep(0.5)
    flowing_at_fault = bool(run.blob_ids() - known0)
    pid = run.services()[sc.unit]["pid"]
    t_fault = time.monotonic()
    recovery_s = None
    if sc.action == "kill":
        _signal(pid, signal.SIGKILL)
        restarts0 = before[sc.unit]["restarts"]
        while time.monotonic() - t_fault < args.recover_timeout_s:
            s = run.services()[sc.unit]
            if s["restarts"] > restarts0 and s["state"] == "ready":
                recovery_s = time.monotonic() - t_fault
                break
            time.sleep(0.2)
    else:
        _signal(pid, signal.SIGSTOP)
        try:
            time.sleep(args.stop_s)
        finally:
            _signal(pid, signal.SIGCONT)
        recovery_s = time.monotonic() - t_fault
    time.sleep(args.post_s)
    records = load.stop()
    t_end = time.monotonic()
    time.sleep(args.flush_s + 1)  # the last partial chunks close
    drain_deadline = time.monotonic() + args.drain_s
    while True:
        try:
            led = run.ledger()
        except Exception:  # S3 or Redis not back yet
            if time.monotonic() > drain_deadline + 60:
                raise
            time.sleep(DRAIN_POLL_S)
            continue
        scope = led.known - known0
        if (settled(led, scope) and not drops.spooled()) or time.monotonic() > drain_deadline:
            break
        time.sleep(DRAIN_POLL_S)
    drained_s = time.monotonic() - t_end
    after, drops1 = run.services(), drops.totals()
    chunks = account(led, scope)
    in_chunks = chunks.pop("rows")
    chunks.update(dropped_counted=drops1["chunks"] - drops0["chunks"],
                  dropped_tokens=drops1["tokens"] - drops0["tokens"], in_spool=drops.spooled())
    chunks["written"] = chunks["blobs"] + chunks["dropped_counted"]
    served = sum(r["tokens"] for r in records)
    rows = {"served": served, "in_chunks": in_chunks, "dropped_counted": chunks["dropped_tokens"],
            "unaccounted": served - in_chunks - chunks["dropped_tokens"]}
    failed = [r for r in records if r["error"]]
    res = {"scenario": sc.name, "unit": sc.unit, "action": sc.action,
           "requests": {"sent": len(records), "ok": len(records) - len(failed), "failed": len(failed)},
           "unavailable_s": round(unavailable_s(records, t_start, t_end), 2),
           "restarts": {n: s["restarts"] - before.get(n, {}).get("restarts", 0) for n, s in after.items()
                        if s["restarts"] != before.get(n, {}).get("restarts", 0)},
           "recovery_s": None if recovery_s is None else round(recovery_s, 2),
           "fault_at_s": round(t_fault - t_start, 2), "load_s": round(t_end - t_start, 2),
           "drain_s": round(drained_s, 2), "flowing_at_fault": flowing_at_fault, "chunks": chunks, "rows": rows,
           "errors": sorted({r["error"][:80] for r in failed})[:3],
           "in_flight_at_fault": sum(r["t0"] <= t_fault <= r["t1"] for r in records),
           "failed_after_fault": sum(r["t0"] > t_fault for r in failed)}
    res["checks"] = checks(res, sc)
    res["passed"] = all(res["checks"].values())
    return res


def checks(res: dict, sc: Scenario) -> dict[str, bool]:
    """The scenario's targets (module doc)."""
    c, req = res["chunks"], res["requests"]
    out = {"flowing": c["blobs"] > 0, "lost": c["lost"] == 0, "duplicated": c["duplicated"] == 0,
           "dropped": c["dropped_counted"] == 0 and c["dropped_tokens"] == 0,
           "drained": c["in_stream"] == 0 and c["in_spool"] == 0,
           "recovered": res["recovery_s"] is not None}
    if sc.worker:
        out["only_in_flight_failed"] = res["failed_after_fault"] == 0 and req["failed"] <= res["in_flight_at_fault"]
        out["resumed"] = res["unavailable_s"] <= RESUME_LIMIT_S
    else:  # no request died with a process: every row served reached a chunk or a drop counter
        out["availability"] = req["sent"] > 0 and req["ok"] >= AVAILABILITY * req["sent"]
        out["rows"] = res["rows"]["unaccounted"] == 0
    return out


def progress_line(i: int, n: int, r: dict) -> str:
    q, c = r["requests"], r["chunks"]
    bad = [k for k, ok in r["checks"].items() if not ok]
    verdict = "PASS" if r["passed"] else "FAIL " + ",".join(bad)
    return (f"[{i}/{n}] {r['scenario']}: {q['ok']}/{q['sent']} ok, unavailable {r['unavailable_s']:.1f} s, "
            f"recovered in {r['recovery_s'] if r['recovery_s'] is not None else '-'} s; chunks {c['written']} "
            f"written, {c['trained']} trained, {c['dead_lettered']} dead-lettered, {c['dropped_counted']} dropped "
            f"({c['dropped_tokens']} rows), {c['lost']} lost, {c['duplicated']} duplicated -> {verdict}")


def table(results: list[dict]) -> str:
    head = ("scenario", "sent", "ok", "failed", "unavail s", "recovery s", "restarts", "written", "trained",
            "dead", "dropped", "rows dropped", "lost", "dup", "result")
    rows = [head]
    for r in results:
        q, c = r["requests"], r["chunks"]
        rows.append((r["scenario"], q["sent"], q["ok"], q["failed"], f"{r['unavailable_s']:.1f}",
                     "-" if r["recovery_s"] is None else f"{r['recovery_s']:.1f}",
                     ",".join(f"{k}={v}" for k, v in r["restarts"].items()) or "-", c["written"], c["trained"],
                     c["dead_lettered"], c["dropped_counted"], c["dropped_tokens"], c["lost"], c["duplicated"],
                     "pass" if r["passed"] else "FAIL: " + ",".join(k for k, ok in r["checks"].items() if not ok)))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = [" | ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ the suite


def resolve(args) -> argparse.Namespace:
    """--quick / full defaults for the phase arguments left unset."""
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.target is None:
        args.target = "tiny" if args.quick else "ref"
    if args.chunk_buffers is None:
        args.chunk_buffers = max(3, SLACK_ROWS // args.chunk_tokens)
    return args


def run(args, say=print) -> dict:
    """The suite (args as add_arguments makes them); the JSON-ready results."""
    from tools.launcher import Stack, StackConfig

    args = resolve(args)
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()] if args.scenarios else list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"tide chaos: unknown scenario(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    t0 = time.monotonic()
    own_dir = args.data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="tide-chaos-")) if own_dir else Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    target = str(tiny_target(data_dir / "chaos-tiny")) if args.target == "tiny" else args.target
    # The trainer at normal priority: under SCHED_IDLE (tide up's default) it gets no CPU while the
    # suite's traffic keeps the worker busy, so neither its own recovery nor the draining of the
    # chunks written during a fault could be seen; the suite measures recovery, not priority.
    cfg = StackConfig(port=0, workers=args.workers, target=target, data_dir=data_dir / "stack",
                      env=stack_env(args, data_dir), startup_timeout_s=args.startup_timeout,
                      background_idle=False)
    stack = Stack(cfg)
    say(f"chaos: starting the stack ({args.workers} workers, target {args.target}) in {data_dir}")
    stack.start()
    startup_s = time.monotonic() - t0
    run_, drops, results = Running(stack), None, []
    try:
        model = httpx.get(f"{run_.base}/v1/models", timeout=30).json()["data"][0]["id"]
        drops = DropCounter([stack.endpoints.metrics[f"inference-{i}"] for i in range(args.workers)])
        drops.start()
        say(f"chaos: stack ready in {startup_s:.0f} s ({run_.base}, model {model}); {len(names)} scenarios")
        for i, name in enumerate(names, 1):
            res = run_scenario(run_, drops, BY_NAME[name], args, model)
            results.append(res)
            say(progress_line(i, len(names), res))
    finally:
        if drops is not None:
            drops.stop()
        run_.close()
        stack.stop()
    passed = all(r["passed"] for r in results)
    out = {"suite": "chaos", "quick": bool(args.quick), "target": args.target, "passed": passed,
           "wall_s": round(time.monotonic() - t0, 1), "startup_s": round(startup_s, 1),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()},
           "config": {k: getattr(args, k) for k in ("workers", "clients", "max_tokens", "pre_s", "post_s", "stop_s",
                                                      "drain_s", "chunk_tokens", "chunk_buffers", "flush_s",
                                                      "request_timeout_s")},
           "targets": {"lost": 0, "duplicated": 0, "availability": AVAILABILITY, "worker_resume_s": RESUME_LIMIT_S},
           "scenarios": results, "run_dir": str(stack.run_dir)}
    if own_dir and passed and not args.keep:
        shutil.rmtree(data_dir, ignore_errors=True)
        out["run_dir"] = None
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny target, shorter phases (minutes)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--scenarios", default="", help=f"comma-separated subset of {', '.join(BY_NAME)} [all]")
    parser.add_argument("--target", default=None, help="'ref', a HF directory or 'tiny' [quick: tiny, else ref]")
    parser.add_argument("--workers", type=int, default=2, help="inference workers [2]")
    parser.add_argument("--clients", type=int, default=3, help="concurrent closed-loop clients [3]")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per completion [quick 16, 32]")
    parser.add_argument("--pre-s", type=float, default=None, help="load before the fault [quick 4, 15]")
    parser.add_argument("--post-s", type=float, default=None, help="load after recovery [quick 4, 15]")
    parser.add_argument("--stop-s", type=float, default=30.0, help="how long S3 stays SIGSTOPped [30]")
    parser.add_argument("--drain-s", type=float, default=None, help="most seconds to wait for the chunks to settle "
                        "after the load [quick 30, 90]")
    parser.add_argument("--recover-timeout-s", type=float, default=120.0,
                        help="most seconds to wait for a killed process to be ready again [120]")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="rows per chunk [quick 64, 256]")
    parser.add_argument("--chunk-buffers", type=int, default=None,
                        help=f"chunk buffers per worker [{SLACK_ROWS} rows / --chunk-tokens, as the defaults hold]")
    parser.add_argument("--flush-s", type=float, default=None, help="partial-chunk flush interval [quick 1, 2]")
    parser.add_argument("--request-timeout-s", type=float, default=60.0, help="per request [60]")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds each service may take to start")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="stack data and logs [a temporary directory, removed when every scenario passed]")
    parser.add_argument("--keep", action="store_true", help="keep the temporary data directory")


def run_cli(args) -> int:
    res = run(args)
    print(table(res["scenarios"]))
    write_json(res, args.json)
    if res["run_dir"]:
        print(f"logs: {res['run_dir']}")
    return 0 if res["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    return standalone_main("tide chaos", __doc__, add_arguments, run_cli, argv)


if __name__ == "__main__":
    raise SystemExit(main())

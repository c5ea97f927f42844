"""`tide bench serve`: a serving benchmark for any OpenAI-compatible endpoint (TIDE, vLLM, SGLang, ...).

    tide bench serve --base-url URL [URL ...] [--label NAME ...] [--model NAME ...] --prompts FILE [FILE ...]
                     (--concurrency C [C ...] | --request-rate R [R ...]) [--max-concurrency N]
                     [--max-tokens N] [--num-prompts N] [--rounds N] [--json FILE] [--plots DIR]

Every request streams (`stream: true`, `stream_options: {"include_usage": true}`), one HTTP
connection per request in flight. Two load shapes, each run once per value given, in order:

  --concurrency C   closed loop: C clients, each sends its next prompt as soon as its last answer
                    ended, until `--num-prompts` requests were sent.
  --request-rate R  open loop: arrivals of a Poisson process of R requests/s (exponential gaps drawn
                    with `--seed`, the same for every rate), `inf` = all at once; at most
                    `--max-concurrency` in flight (unbounded when not given).

Prompts: tide.prompts.load_prompts (Spec-Bench, GSM8K, HumanEval, Alpaca or any `prompt`/`text`
JSONL, `.txt` one a line; `file[:40]` slices), the files' prompts in order, cycled up to
`--num-prompts` (default: each prompt once). `--api chat` sends each as one user message,
`--api completions` as the raw prompt. `--extra-body JSON` is merged into every request (TIDE:
'{"speculative": false}' for plain decoding, '{"ignore_eos": true}' for fixed-length outputs).
`--turns N` (chat, closed loop): each prompt opens a conversation of N requests, turn k resending the
conversation so far (the answers as the server gave them) plus a fixed follow-up question: what a
chat client does, and what a server's prompt cache is for. Each turn is one request in the metrics;
`ttft_ms_by_turn` gives the time to first token per turn.

Metrics per run (names as in vLLM's `bench serve`; latencies in ms, p50/p90/p99 and mean):
  ttft_ms   time to first token: request sent -> first chunk carrying output text. A stream whose
            output decodes to no text at all gets ttft = e2e.
  itl_ms    inter-token latency: the gaps between consecutive text-bearing chunks, over all
            requests. A chunk that carries several tokens (a speculative step's accepted run, say)
            counts its gap once, as vLLM does: with speculation ITL reads per *chunk*, and TPOT is
            the per-token figure.
  tpot_ms   time per output token after the first: (e2e - ttft) / (output tokens - 1) per request
            (requests of one token have none); output tokens = the final chunk's
            `usage.completion_tokens`, or the text-bearing chunks counted when a server sends no usage.
  e2e_ms    request sent -> stream ended (vLLM's e2el).
  output_tok_s        completion tokens of the successful requests / the run's wall time (first
                      request sent -> last one ended); total_tok_s adds their prompt tokens.
  request_throughput  successful requests / wall time.
  goodput             requests/s meeting every `--slo` (e.g. `--slo ttft_ms=500 tpot_ms=100`;
                      metrics ttft_ms, tpot_ms, e2e_ms; null without --slo). A one-token request
                      meets any tpot SLO.
  cached_prompt_tokens  prompt tokens the server reported served from its cache (OpenAI's
                      `usage.prompt_tokens_details.cached_tokens`, summed; null when it reports none).
  accept_length       TIDE's speculation: tokens emitted per verification step over the run,
                      bonus token included, from the `speculation` object on the final chunk
                      (Σ accept_length·verify_steps / Σ verify_steps over the successful requests,
                      the step-weighted mean the gateway itself uses over choices); null when the
                      server sends none or never verified (e.g. `speculative: false`).
A request that fails (HTTP error status, an SSE `error` event, a stream that ends with neither
[DONE] nor a finish_reason, a transport error, `--timeout`) counts in requests_failed, is left out
of every statistic (the most frequent error messages are kept under `errors`), and the run goes on.
`--warmup N` requests are sent one at a time before the runs and counted nowhere.

Several servers (`--base-url A B ...`, named by `--label`, default host:port) are measured in one
command with the same client and prompts: every run (a concurrency or a rate) goes to each server in
turn, `--rounds N` times, the servers' order reversed every other round (A B, B A, ...) so a drift of
the machine hits them alike; rows carry `server` and `round`, and `comparison` gives per run and
server the median over rounds of output tok/s, TTFT p50, TPOT p50, ITL p50 and the tok/s ratio to
the first server. Compare servers on one machine, each with the same cores and threads.

After the runs, each server's resident memory, all of its processes (benchmarks/server_memory.py:
a TIDE stack's /v1/status, else the local processes listening on its port; the worker's RSS beside
its weights and KV cache where the server reports them).

Output: a short table on stdout, a tqdm bar per run on stderr, `--json FILE`:
{"results": [row per run], "config": {...}, "memory": {label: {...} or null}}; `--plots DIR`:
serve_plots (throughput and latency percentiles against concurrency or request rate). Bad arguments
exit 2 before anything is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import itertools
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from benchmarks.report import standalone_main, write_json
from benchmarks.server_memory import print_memory, server_memory
from tide.prompts import Prompt, load_prompts

PERCENTILES = (50, 90, 99)
SLO_METRICS = {"ttft": "ttft_ms", "ttft_ms": "ttft_ms", "tpot": "tpot_ms", "tpot_ms": "tpot_ms",
               "e2e": "e2e_ms", "e2e_ms": "e2e_ms", "e2el": "e2e_ms", "e2el_ms": "e2e_ms"}
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
MAX_ERRORS = 5  # distinct error messages kept per run


class UsageError(Exception):
    """A bad argument: reported with exit status 2 before any request is sent."""


@dataclass
class Outcome:
    """One request as the client saw it (times in seconds)."""

    ok: bool
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server sends it
    speculation: dict | None = None
    text: str = ""  # the answer (kept for the next turn of a conversation)
    turn: int = 1

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass(frozen=True)
class Target:
    """Where and what to send."""

    url: str
    api: str
    model: str
    max_tokens: int
    temperature: float
    extra_body: dict
    headers: dict
    timeout: float

    def body(self, prompt: Prompt, history: tuple[dict, ...] = ()) -> dict:
        """The request for `prompt`; `history`: earlier messages of its conversation (chat)."""
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.api == "chat":
            body["messages"] = [*history, {"role": "user", "content": prompt.text}]
        else:
            body["prompt"] = prompt.text
        return {**body, **self.extra_body}


# ------------------------------------------------------------------------------------ one request


def _error_message(status: int, raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        err = json.loads(text)
        err = err.get("error", err) if isinstance(err, dict) else err
        if isinstance(err, dict):
            text = err.get("message") or err.get("detail") or text
    except ValueError:
        pass
    return f"HTTP {status}: {str(text)[:200]}"


def _chunk_text(choice: dict) -> str:
    """The output text of a streamed choice: completions' `text`, chat's delta content (reasoning too)."""
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return "".join(delta.get(k) or "" for k in ("content", "reasoning_content", "reasoning"))


async def send(client: httpx.AsyncClient, target: Target, prompt: Prompt, history: tuple[dict, ...] = ()) -> Outcome:
    """Stream one request and time it; failures come back as `Outcome(ok=False, error=...)`."""
    start = time.perf_counter()
    try:
        async with asyncio.timeout(target.timeout):
            return await _stream(client, target, prompt, start, history)
    except TimeoutError:
        return Outcome(False, f"timeout after {target.timeout:g} s")
    except httpx.TimeoutException as e:
        return Outcome(False, f"timeout ({type(e).__name__})")
    except httpx.HTTPError as e:
        return Outcome(False, f"{type(e).__name__}: {e}"[:200])


async def _stream(client: httpx.AsyncClient, target: Target, prompt: Prompt, start: float,
                  history: tuple[dict, ...]) -> Outcome:
    ttft: float | None = None
    text: list[str] = []
    last = start
    itl: list[float] = []
    chunks = 0
    usage: dict | None = None
    speculation: dict | None = None
    finished = done = False
    async with client.stream("POST", target.url, json=target.body(prompt, history), headers=target.headers) as resp:
        if resp.status_code != 200:
            return Outcome(False, _error_message(resp.status_code, await resp.aread()))
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, `event:` / `id:` fields, `:` comments
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            try:
                obj = json.loads(payload)
            except ValueError:
                return Outcome(False, f"malformed SSE data: {payload[:100]!r}")
            if not isinstance(obj, dict):
                continue
            if obj.get("error"):
                err = obj["error"]
                message = err.get("message", err) if isinstance(err, dict) else err
                return Outcome(False, f"stream error: {str(message)[:200]}")
            now = time.perf_counter()
            choices = obj.get("choices") or []
            text.extend(_chunk_text(c) for c in choices[:1])
            if any(_chunk_text(c) for c in choices):
                if ttft is None:
                    ttft = now - start
                else:
                    itl.append(now - last)
                last = now
                chunks += 1
            finished = finished or any(c.get("finish_reason") for c in choices)
            if obj.get("usage"):
                usage = obj["usage"]
            if obj.get("speculation"):
                speculation = obj["speculation"]
    e2e = time.perf_counter() - start
    if not (done or finished):
        return Outcome(False, "stream ended without [DONE] or a finish_reason")
    tokens = int(usage.get("completion_tokens") or 0) if usage else chunks
    details = (usage or {}).get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Outcome(True, ttft=e2e if ttft is None else ttft, e2e=e2e, itl=itl, output_tokens=tokens,
                   prompt_tokens=int(usage.get("prompt_tokens") or 0) if usage else 0,
                   cached_tokens=int(cached) if isinstance(cached, int | float) else None,
                   speculation=speculation, text="".join(text))


# ------------------------------------------------------------------------------------ load shapes


def _client(target: Target, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(target.timeout))


# Turn k > 1 of a conversation (`--turns`) asks FOLLOW_UPS[k - 2] (cycled).
FOLLOW_UPS = ("Can you explain that in more detail?", "Now summarize your answer in two sentences.",
              "Give one example that illustrates it.")


async def closed_loop(target: Target, prompts: list[Prompt], concurrency: int, progress,
                      turns: int = 1) -> tuple[list, float]:
    """`concurrency` clients sharing the prompt list, each prompt a conversation of `turns` requests;
    (outcomes, wall seconds)."""
    outcomes: list[Outcome] = []
    queue = iter(prompts)

    async def client_loop(client):
        for prompt in queue:  # shared: each client takes the next prompt
            history: tuple[dict, ...] = ()
            for turn in range(1, turns + 1):
                follow_up = FOLLOW_UPS[(turn - 2) % len(FOLLOW_UPS)]
                ask = prompt if turn == 1 else dataclasses.replace(prompt, text=follow_up)
                outcome = await send(client, target, ask, history)
                outcome.turn = turn
                outcomes.append(outcome)
                progress.update(1)
                if not outcome.ok:
                    progress.update(turns - turn)
                    break
                history = (*history, {"role": "user", "content": ask.text},
                           {"role": "assistant", "content": outcome.text})

    clients = min(concurrency, len(prompts))
    async with _client(target, clients) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        return outcomes, time.perf_counter() - t0


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start of each of `n` Poisson arrivals at `rate`/s (the first at 0; all 0 for inf)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return list(itertools.accumulate((rng.expovariate(rate) for _ in range(n - 1)), initial=0.0))


async def open_loop(target: Target, prompts: list[Prompt], rate: float, cap: int | None, seed: int,
                    progress) -> tuple[list, float]:
    """Poisson arrivals at `rate` requests/s, at most `cap` in flight; (outcomes, wall seconds)."""
    outcomes: list[Outcome] = []
    gate = asyncio.Semaphore(cap) if cap else None

    async def one(client, prompt):
        if gate is None:
            outcomes.append(await send(client, target, prompt))
        else:
            async with gate:
                outcomes.append(await send(client, target, prompt))
        progress.update(1)

    async with _client(target, min(cap or len(prompts), len(prompts))) as client:
        t0 = time.perf_counter()
        tasks = []
        for prompt, at in zip(prompts, arrival_times(len(prompts), rate, seed), strict=True):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, prompt)))
        await asyncio.gather(*tasks)
        return outcomes, time.perf_counter() - t0


# ------------------------------------------------------------------------------------ summaries


def percentiles(values_s: list[float]) -> dict:
    """{"p50", "p90", "p99", "mean"} in ms (None each when there are no values)."""
    if not values_s:
        return {**{f"p{p}": None for p in PERCENTILES}, "mean": None}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    out = {f"p{p}": round(float(np.percentile(ms, p)), 3) for p in PERCENTILES}
    return {**out, "mean": round(float(ms.mean()), 3)}


def meets(o: Outcome, slo: dict[str, float]) -> bool:
    values = {"ttft_ms": o.ttft * 1000, "e2e_ms": o.e2e * 1000,
              "tpot_ms": None if o.tpot is None else o.tpot * 1000}
    return all(values[k] is None or values[k] <= limit for k, limit in slo.items())


def speculation_summary(ok: list[Outcome]) -> tuple[float | None, dict | None]:
    """(accept length over the run, the speculation totals) from the responses' `speculation` objects."""
    specs = [o.speculation for o in ok if isinstance(o.speculation, dict)]
    if not specs:
        return None, None
    num = lambda s, k: float(s.get(k) or 0)  # noqa: E731
    totals = {k: int(sum(num(s, k) for s in specs))
              for k in ("verify_steps", "accepted_tokens", "draft_tokens", "plain_steps")}
    steps = totals["verify_steps"]
    accept = sum(num(s, "accept_length") * num(s, "verify_steps") for s in specs) / steps if steps else None
    totals["draft_acceptance"] = (round(totals["accepted_tokens"] / totals["draft_tokens"], 4)
                                  if totals["draft_tokens"] else None)
    totals["responses"] = len(specs)
    return (round(accept, 4) if accept is not None else None), totals


def summarize(outcomes: list[Outcome], wall_s: float, slo: dict[str, float]) -> dict:
    ok = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    out_tokens = sum(o.output_tokens for o in ok)
    in_tokens = sum(o.prompt_tokens for o in ok)
    per_s = lambda x: round(x / wall_s, 4) if wall_s > 0 else None  # noqa: E731
    accept, spec = speculation_summary(ok)
    errors = collections.Counter(o.error for o in failed).most_common(MAX_ERRORS)
    cached = [o.cached_tokens for o in ok if o.cached_tokens is not None]
    turns = sorted({o.turn for o in ok})
    return {
        "requests_ok": len(ok),
        "requests_failed": len(failed),
        "duration_s": round(wall_s, 3),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "output_tok_s": per_s(out_tokens),
        "total_tok_s": per_s(in_tokens + out_tokens),
        "goodput": per_s(sum(meets(o, slo) for o in ok)) if slo else None,
        "cached_prompt_tokens": sum(cached) if cached else None,
        "ttft_ms": percentiles([o.ttft for o in ok]),
        "ttft_ms_by_turn": {str(t): percentiles([o.ttft for o in ok if o.turn == t]) for t in turns}
        if len(turns) > 1 else None,
        "tpot_ms": percentiles([o.tpot for o in ok if o.tpot is not None]),
        "itl_ms": percentiles([g for o in ok for g in o.itl]),
        "e2e_ms": percentiles([o.e2e for o in ok]),
        "accept_length": accept,
        "speculation": spec,
        "errors": dict(errors),
    }


# ------------------------------------------------------------------------------------ arguments


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf): {text!r}")
    return value


def parse_slo(items: list[str]) -> dict[str, float]:
    """["ttft_ms=500", "tpot:100"] -> {"ttft_ms": 500.0, "tpot_ms": 100.0}."""
    out = {}
    for item in items or []:
        sep = "=" if "=" in item else ":"
        key, _, value = item.partition(sep)
        name = SLO_METRICS.get(key.strip().lower())
        if name is None or not value:
            raise UsageError(f"--slo: expected METRIC=MS with METRIC one of ttft_ms, tpot_ms, e2e_ms; got {item!r}")
        try:
            out[name] = float(value)
        except ValueError:
            raise UsageError(f"--slo {item!r}: {value!r} is not a number of milliseconds") from None
        if not out[name] > 0:
            raise UsageError(f"--slo {item!r}: the limit must be > 0 ms")
    return out


def parse_extra_body(text: str | None) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise UsageError(f"--extra-body is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise UsageError("--extra-body must be a JSON object, e.g. '{\"speculative\": false}'")
    return value


def endpoint_url(base_url: str, api: str) -> str:
    """The endpoint under `base_url` ("http://host:port" or ".../v1")."""
    base = base_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise UsageError(f"--base-url must start with http:// or https://, got {base_url!r}")
    if base.endswith("/v1"):
        base = base[:-3]
    return base + ENDPOINTS[api]


def read_prompts(files: list[str], num_prompts: int | None) -> list[Prompt]:
    """The files' prompts in order, cycled (or cut) to `num_prompts` (None: each once)."""
    prompts: list[Prompt] = []
    for name in files:
        try:
            got = load_prompts(name)
        except Exception as e:  # missing, unreadable, not JSONL, unknown rows, a bad slice ...
            raise UsageError(f"--prompts {name}: cannot read prompts ({type(e).__name__}: {e})") from None
        if not got:
            raise UsageError(f"--prompts {name}: no prompts in it")
        prompts.extend(got)
    n = len(prompts) if num_prompts is None else num_prompts
    return list(itertools.islice(itertools.cycle(prompts), n))


def check(args) -> tuple[Target, list[Prompt], dict[str, float]]:
    """Validate everything that needs no network; UsageError on the first problem."""
    if not args.concurrency and not args.request_rate:
        raise UsageError("give --concurrency C [C ...] and/or --request-rate R [R ...]")
    if any(c < 1 for c in args.concurrency or []):
        raise UsageError("--concurrency values must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise UsageError("--max-concurrency must be >= 1")
    for name in ("max_tokens", "num_prompts"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        raise UsageError("--warmup must be >= 0")
    if not args.timeout > 0:
        raise UsageError("--timeout must be > 0 seconds")
    if not args.temperature >= 0:
        raise UsageError("--temperature must be >= 0")
    if args.rounds < 1:
        raise UsageError("--rounds must be >= 1")
    if args.turns < 1:
        raise UsageError("--turns must be >= 1")
    if args.turns > 1 and (args.api != "chat" or args.request_rate):
        raise UsageError("--turns needs --api chat and closed-loop runs (--concurrency)")
    urls = [endpoint_url(u, args.api) for u in args.base_url]
    extras = [parse_extra_body(e) for e in args.extra_body or [None]]
    if len(extras) not in (1, len(urls)):
        raise UsageError(f"--extra-body: give one JSON object, or one per --base-url ({len(urls)})")
    extra = extras[0]
    slo = parse_slo(args.slo)
    prompts = read_prompts(args.prompts, args.num_prompts)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    target = Target(urls[0], args.api, "", args.max_tokens, args.temperature, extra, headers, args.timeout)
    return target, prompts, slo


def discover_model(target: Target) -> str:
    """The first model of GET /v1/models (when --model is not given)."""
    url = target.url.rsplit("/v1/", 1)[0] + "/v1/models"
    resp = httpx.get(url, headers=target.headers, timeout=min(target.timeout, 30.0))
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


# ------------------------------------------------------------------------------------ driver


@dataclass(frozen=True)
class Server:
    label: str
    base_url: str
    target: Target


def servers(args, target: Target) -> list[Server]:
    """One Server per --base-url (the same client settings; a model each, asked of the server when
    --model does not name it); UsageError for mismatched --label / --model counts."""
    urls = args.base_url
    labels = args.label or [u.split("://", 1)[-1].rstrip("/").removesuffix("/v1") for u in urls]
    models = args.model or [""]
    if len(labels) != len(urls) or len(set(labels)) != len(labels):
        raise UsageError(f"--label: give one distinct name per --base-url ({len(urls)})")
    if len(models) not in (1, len(urls)):
        raise UsageError(f"--model: give one name, or one per --base-url ({len(urls)})")
    models = models * len(urls) if len(models) == 1 else models
    extras = [parse_extra_body(e) for e in args.extra_body or [None]]
    extras = extras * len(urls) if len(extras) == 1 else extras
    out = []
    for label, url, model, extra in zip(labels, urls, models, extras, strict=True):
        t = dataclasses.replace(target, url=endpoint_url(url, args.api), model=model, extra_body=extra)
        if not t.model:
            try:
                t = dataclasses.replace(t, model=discover_model(t))
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
                raise RuntimeError(f"{label}: no --model given and GET /v1/models failed: {e}") from None
        out.append(Server(label, url, t))
    return out


_COMPARED = {"output_tok_s": lambda r: r["output_tok_s"], "ttft_ms_p50": lambda r: r["ttft_ms"]["p50"],
             "tpot_ms_p50": lambda r: r["tpot_ms"]["p50"], "itl_ms_p50": lambda r: r["itl_ms"]["p50"],
             "accept_length": lambda r: r["accept_length"], "cached_prompt_tokens": lambda r: r["cached_prompt_tokens"],
             # the first turn's and the last turn's of `--turns` conversations (None without)
             "ttft_ms_p50_first_turn": lambda r: _turn_ttft(r, min),
             "ttft_ms_p50_last_turn": lambda r: _turn_ttft(r, max)}


def _turn_ttft(row: dict, which) -> float | None:
    by_turn = row.get("ttft_ms_by_turn")
    return by_turn[which(by_turn, key=int)]["p50"] if by_turn else None


def _median_of(rows: list[dict], get) -> float | None:
    values = [v for v in map(get, rows) if v is not None]
    return round(float(np.median(values)), 3) if values else None


def comparison(rows: list[dict], labels: list[str]) -> list[dict]:
    """Per run (concurrency or rate) and server: medians over the rounds, and tok/s vs the first server."""
    out = []
    runs = list(dict.fromkeys((r["concurrency"], r["request_rate"]) for r in rows))
    for conc, rate in runs:
        same = [r for r in rows if (r["concurrency"], r["request_rate"]) == (conc, rate)]
        med = {}
        for label in labels:
            mine = [r for r in same if r["server"] == label]
            med[label] = {key: _median_of(mine, get) for key, get in _COMPARED.items()}
            med[label].update(rounds=len(mine), requests_failed=sum(r["requests_failed"] for r in mine))
        first = med[labels[0]]["output_tok_s"]
        for label in labels:
            tok = med[label]["output_tok_s"]
            out.append({"concurrency": conc, "request_rate": rate, "server": label, **med[label],
                        "tok_s_vs_first": round(tok / first, 3) if tok is not None and first else None})
    return out


def run(args) -> dict:
    """Every run of `args` on every server (validated first: UsageError before anything is sent)."""
    from tqdm import tqdm

    target, prompts, slo = check(args)
    fleet = servers(args, target)
    runs = [("concurrency", c) for c in args.concurrency or []] + [("rate", r) for r in args.request_rate or []]

    async def all_runs() -> list[dict]:
        for srv in fleet if args.warmup else []:
            async with _client(srv.target, 1) as client:
                warm = [await send(client, srv.target, p)
                        for p in itertools.islice(itertools.cycle(prompts), args.warmup)]
            bad = [o.error for o in warm if not o.ok]
            if bad:
                print(f"warning: {srv.label}: {len(bad)} of {len(warm)} warm-up requests failed: {bad[0]}",
                      file=sys.stderr)
        rows = []
        for kind, value in runs:
            for rnd in range(args.rounds):
                for srv in fleet if rnd % 2 == 0 else fleet[::-1]:
                    label = f"concurrency {value}" if kind == "concurrency" else f"rate {value:g}/s"
                    if len(fleet) > 1 or args.rounds > 1:
                        label = f"{srv.label} {label} round {rnd + 1}/{args.rounds}"
                    with tqdm(total=len(prompts) * args.turns, desc=label, unit="req", file=sys.stderr,
                              dynamic_ncols=True) as bar:
                        if kind == "concurrency":
                            outcomes, wall = await closed_loop(srv.target, prompts, value, bar, args.turns)
                            head = {"concurrency": value, "request_rate": None}
                        else:
                            outcomes, wall = await open_loop(srv.target, prompts, value, args.max_concurrency,
                                                             args.seed, bar)
                            head = {"concurrency": args.max_concurrency, "request_rate": _json_rate(value)}
                    rows.append({**head, "server": srv.label, "round": rnd, "num_prompts": len(prompts),
                                 **summarize(outcomes, wall, slo)})
        return rows

    results = asyncio.run(all_runs())
    memory = {s.label: server_memory(s.base_url) for s in fleet}  # after warm-up and every run
    first = fleet[0].target
    config = {
        "base_url": fleet[0].base_url, "endpoint": first.url, "api": args.api, "model": first.model,
        "servers": [{"label": s.label, "base_url": s.base_url, "endpoint": s.target.url, "model": s.target.model,
                     "extra_body": s.target.extra_body} for s in fleet],
        "prompts": [str(p) for p in args.prompts], "num_prompts": len(prompts), "max_tokens": args.max_tokens,
        "temperature": args.temperature, "extra_body": first.extra_body, "concurrency": args.concurrency,
        "request_rate": [_json_rate(r) for r in args.request_rate or []] or None,
        "max_concurrency": args.max_concurrency, "seed": args.seed, "warmup": args.warmup, "rounds": args.rounds,
        "turns": args.turns,
        "timeout_s": args.timeout, "slo": slo or None, "percentiles": list(PERCENTILES),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out = {"results": results, "config": config, "memory": memory}
    if len(fleet) > 1 or args.rounds > 1:
        out["comparison"] = comparison(results, [s.label for s in fleet])
    return out


def _json_rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(res: dict) -> None:
    cols = ("conc", "rate", "ok", "fail", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p50",
            "ITL p99", "E2E p50", "accept", "goodput")
    widths = (5, 6, 5, 5, 7, 10, 9, 9, 9, 8, 8, 9, 7, 8)
    cfg = res["config"]
    for srv in cfg["servers"]:
        rows = [r for r in res["results"] if r["server"] == srv["label"]]
        rounds = f", {cfg['rounds']} rounds" if cfg["rounds"] > 1 else ""
        print(f"\n{srv['label']}: {srv['model']} at {srv['endpoint']} ({cfg['num_prompts']} prompts a run, "
              f"max_tokens {cfg['max_tokens']}{rounds}; latencies in ms)")
        print(" ".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True)))
        for r in rows:
            rate = r["request_rate"]
            cells = (_fmt(r["concurrency"], "d"), "-" if rate is None else str(rate if rate == "inf" else f"{rate:g}"),
                     str(r["requests_ok"]), str(r["requests_failed"]), _fmt(r["request_throughput"], ".2f"),
                     _fmt(r["output_tok_s"]), _fmt(r["ttft_ms"]["p50"]), _fmt(r["ttft_ms"]["p99"]),
                     _fmt(r["tpot_ms"]["p50"]), _fmt(r["itl_ms"]["p50"]), _fmt(r["itl_ms"]["p99"]),
                     _fmt(r["e2e_ms"]["p50"]), _fmt(r["accept_length"], ".2f"), _fmt(r["goodput"], ".2f"))
            print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
        for r in rows:
            for message, count in r["errors"].items():
                label = f"concurrency {r['concurrency']}" if r["request_rate"] is None else f"rate {r['request_rate']}"
                print(f"  {label}: {count} x {message}")
    if res.get("comparison"):
        print(f"\nmedians over {cfg['rounds']} round(s); ratio = output tok/s / {cfg['servers'][0]['label']}'s")
        print(f"{'server':>16} {'conc':>5} {'rate':>6} {'out tok/s':>10} {'TTFT p50':>9} {'TPOT p50':>9} "
              f"{'ITL p50':>8} {'ratio':>6}")
        for c in res["comparison"]:
            rate = c["request_rate"]
            print(f"{c['server']:>16} {_fmt(c['concurrency'], 'd'):>5} {'-' if rate is None else str(rate):>6} "
                  f"{_fmt(c['output_tok_s']):>10} {_fmt(c['ttft_ms_p50']):>9} {_fmt(c['tpot_ms_p50']):>9} "
                  f"{_fmt(c['itl_ms_p50']):>8} {_fmt(c['tok_s_vs_first'], '.3f'):>6}")
    if res.get("memory"):
        print_memory(res["memory"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, nargs="+", metavar="URL",
                        help="the server, e.g. http://127.0.0.1:8000 (a /v1 suffix is fine); several: each run "
                             "goes to each in turn (compared side by side)")
    parser.add_argument("--label", nargs="+", metavar="NAME", help="the servers' names in tables [host:port]")
    parser.add_argument("--model", nargs="+", metavar="NAME",
                        help="model name to request, one for all or one per server [the first of GET /v1/models]")
    parser.add_argument("--prompts", nargs="+", required=True, metavar="FILE",
                        help="prompt files (tide.prompts formats; a name is also looked up in the data dir; "
                             "slices like file[:40])")
    parser.add_argument("--concurrency", type=int, nargs="+", metavar="C",
                        help="closed-loop runs, one per value: C clients sending back to back")
    parser.add_argument("--request-rate", type=_rate, nargs="+", metavar="R",
                        help="open-loop runs, one per value: Poisson arrivals of R requests/s (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, help="open loop: at most this many requests in flight")
    parser.add_argument("--num-prompts", type=int, help="requests per run [each prompt once; cycled when more]")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request [128]")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature [0: greedy]")
    parser.add_argument("--api", choices=tuple(ENDPOINTS), default="chat",
                        help="chat: /v1/chat/completions, completions: /v1/completions [chat]")
    parser.add_argument("--extra-body", nargs="+", metavar="JSON",
                        help="a JSON object merged into every request, e.g. '{\"speculative\": false}'; "
                             "one for all servers or one per server")
    parser.add_argument("--slo", nargs="+", metavar="METRIC=MS",
                        help="goodput SLOs, e.g. ttft_ms=500 tpot_ms=100 (metrics: ttft_ms, tpot_ms, e2e_ms)")
    parser.add_argument("--api-key", help="bearer token [$OPENAI_API_KEY]")
    parser.add_argument("--warmup", type=int, default=0, help="requests sent (one at a time) before the runs, "
                                                              "counted nowhere [0]")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take in all [300]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals [0]")
    parser.add_argument("--rounds", type=int, default=1,
                        help="each run this many times per server, the servers' order reversed every other "
                             "round; `comparison` gives the medians [1]")
    parser.add_argument("--turns", type=int, default=1,
                        help="chat, closed loop: each prompt a conversation of this many requests, each turn "
                             "resending the conversation so far and a follow-up question [1]")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plots", type=Path, metavar="DIR", help="write PNG plots into this directory")


def run_cli(args) -> int:
    try:
        res = run(args)
    except UsageError as e:
        print(f"tide bench serve: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"tide bench serve: {e}", file=sys.stderr)
        return 1
    if args.plots:
        from benchmarks.serve_plots import plot

        res["plots"] = plot(res, args.plots)
    print_table(res)
    write_json(res, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    return standalone_main("tide bench serve", __doc__, add_arguments, run_cli, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Latency profiles of the serving engine: T(b, n), D(b), catch-up c(lag, b), prefill; cached on disk.

`profile_latency(model, drafter, batches, ns, lags, reps)` measures, on this machine and in this
process, the tables the γ policies need (seed 000 §4.1: "profile T(n) and D0 at start-up") and
returns a `tide.policies.profile.LatencyProfile` (every value in milliseconds):

* T(b, n): one target forward of n new tokens for each of b sequences with `CONTEXT` cached
  tokens each (the verify step of γ = n − 1), the fastest of `reps` rounds over the whole grid
  after 2 warm-ups (`interleaved_min_ms`);
* D(b): one draft step for b sequences (EAGLE-3: one new feature row + one token; n-gram: one
  prompt lookup per sequence; no drafter: 0);
* c(lag, b): the extra draft cost of feeding `lag` missed feature rows per sequence (EAGLE-3
  only; the n-gram drafter never lags);
* prefill_ms_per_token: one 128-token prompt chunk of one sequence, per token.

A large model's start profile runs less of its grid (`start_grid`, `start_cost`: `ProfileCost`).

`cached_profile(...)` keeps one JSON file per (target, dtype, device, torch threads, drafter
shape, grid) under `$TIDE_PROFILE_CACHE_DIR` (default `$TIDE_CACHE_DIR/profiles`), so workers do not
re-profile every start. `LiveProfile` is a profile that can re-measure itself in place (`refresh`),
which is how a worker re-profiles on request (a decision with the policy param `reprofile` = 1).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path

import torch

from tide import kernels
from tide.eagle3 import Eagle3Config, Eagle3Draft
from tide.engine.drafters.eagle3 import Eagle3Drafter
from tide.engine.drafters.hybrid import HybridDrafter
from tide.engine.llama import LlamaModel
from tide.engine.model_runner import ModelRunner
from tide.engine.sequence import SamplingParams, Sequence
from tide.policies.costs import profile_cache_dir
from tide.policies.profile import LatencyProfile

log = logging.getLogger(__name__)

CONTEXT = 128  # cached tokens per sequence when timing forwards (a typical chat prompt length)
PREFILL_CHUNK = 128  # tokens in the timed prefill forward
# Policies whose constructor takes a LatencyProfile (tide and adaptive refuse to run without one).
PROFILE_POLICIES = ("tide", "adaptive", "nightjar", "onthefly", "vllm", "dsd")
PROFILE_FORMAT = 3  # bump when what a profile means changes (part of the cache key); 3: minima over rounds


_TIMER: list[Callable[[], float]] = [time.perf_counter]  # what interleaved_min_ms reads (see cpu_timer)


@contextlib.contextmanager
def cpu_timer():
    """Inside: profiles are timed in this thread's CPU time (torch threads = 1), not wall time, so
    other processes on a shared machine barely move them (benchmarks.policies' --clock cpu)."""
    _TIMER.append(time.thread_time)
    try:
        yield
    finally:
        _TIMER.pop()


def interleaved_min_ms(fns: list[Callable[[], object]], reps: int, warmup: int = 2) -> list[float]:
    """Per function, the fastest of `reps` timed runs in ms, the runs taken in rounds over all of
    `fns` (after `warmup` runs of each). Interference from neighbours only ever adds time, and on a
    shared VM it comes in bursts of seconds to minutes: consecutive repetitions of one point all
    land in the same burst (a median of them measured T(16, 1) at 89 ms, above T(16, 2) at 87 ms,
    and made every policy speculate at batch 16), while rounds spread a burst over all points and
    the minimum drops it."""
    timer = _TIMER[-1]
    for fn in fns:
        for _ in range(warmup):
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(max(reps, 1)):
        for i, fn in enumerate(fns):
            t0 = timer()
            fn()
            best[i] = min(best[i], (timer() - t0) * 1e3)
    return best


def fake_seqs(batch: int, length: int, vocab: int | None = None, seed: int = 0) -> list[Sequence]:
    """`batch` sequences in slots 0.. with `length` tokens, all but the last one cached.

    Tokens are 1s, or seeded random ids below `vocab` (realistic work for the n-gram lookup)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(batch):
        toks = [1] * length if vocab is None else torch.randint(3, vocab, (length,), generator=gen).tolist()
        s = Sequence(f"b{i}", toks, length, SamplingParams())
        s.slot, s.num_cached = i, length - 1
        seqs.append(s)
    return seqs


@torch.inference_mode()
def profile_target(model: LlamaModel, batches: Seq[int], ns: Seq[int], reps: int, warmup: int = 2,
                   max_rows: int | None = None) -> dict[int, dict[int, float]]:
    """T(b, n) in ms: one forward of n new tokens for each of b sequences at CONTEXT cached tokens.
    `max_rows`: skip the points of more than this many rows (b × n) past n = 2; a batch's row then
    ends at the largest n within it, and LatencyProfile extrapolates its last slope (linear in the
    rows: where a forward of that many rows is compute-bound, as a large model's is)."""
    runner = ModelRunner(model, max(batches), CONTEXT + max(ns) + 8, max(ns) + 1)
    points, fwds = [], []
    for b in batches:
        seqs = fake_seqs(b, CONTEXT)
        for n in ns:
            if max_rows is not None and n > 2 and b * n > max_rows:
                continue
            points.append((b, n))
            fwds.append(partial(runner.run, seqs, [[7] * n for _ in range(b)], [CONTEXT] * b, [0] * b, False))
    table: dict[int, dict[int, float]] = {b: {} for b in batches}
    for (b, n), ms in zip(points, interleaved_min_ms(fwds, reps, warmup), strict=True):
        table[b][n] = round(ms, 3)
    return table


def bushy_tree(root: int, nodes: int, topk: int = 4):
    """A tree of `nodes` draft nodes filled breadth first, `topk` children per node (what the
    EAGLE-2 selection keeps is bushier near the root; the forward's cost depends on the row count
    and little on the shape)."""
    from tide.engine.tree import DraftTree

    parents = [-1] + [(i - 1) // topk for i in range(1, nodes + 1)]
    tokens = [root] + [7 + (i - 1) % topk for i in range(1, nodes + 1)]
    return DraftTree(tuple(tokens), tuple(parents))


@torch.inference_mode()
def profile_tree(model: LlamaModel, batches: Seq[int], sizes: Seq[int], reps: int) -> dict[int, dict[int, float]]:
    """T_tree(b, N) in ms: one tree-verification forward (ModelRunner.run_tree) of a tree of N draft
    nodes for each of b sequences at CONTEXT cached tokens."""
    trees = {n: bushy_tree(7, n) for n in sizes}
    depth = max(t.depth for t in trees.values())
    runner = ModelRunner(model, max(batches), CONTEXT + 8, depth + max(sizes) + 4)
    points, fwds = [], []
    for b in batches:
        seqs = fake_seqs(b, CONTEXT)
        for n in sizes:
            points.append((b, n))
            fwds.append(partial(runner.run_tree, seqs, [trees[n]] * b, False))
    table: dict[int, dict[int, float]] = {b: {} for b in batches}
    for (b, n), ms in zip(points, interleaved_min_ms(fwds, reps), strict=True):
        table[b][n] = round(ms, 3)
    return table


@torch.inference_mode()
def profile_prefill(model: LlamaModel, reps: int, warmup: int = 2, tokens: int = PREFILL_CHUNK) -> float:
    """ms per prompt token: one `tokens`-token prefill forward of one sequence (last row's logits)."""
    runner = ModelRunner(model, 1, tokens + 8, tokens)
    seq = fake_seqs(1, tokens)
    fwd = partial(runner.run, seq, [[7] * tokens], [0], [tokens - 1], False, prefill=True)
    return round(interleaved_min_ms([fwd], reps, warmup)[0] / tokens, 4)


def target_config(cfg) -> dict:
    """An engine model's config (`LlamaModel.cfg`) as the HF config.json fields that
    `Eagle3Config.for_target` reads: a draft shaped for that model."""
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "max_position_embeddings": cfg.max_position_embeddings}


def random_draft(model: LlamaModel, draft_vocab: int = 8192) -> Eagle3Draft:
    """A random EAGLE-3 draft of the production shape: right for latency, useless for acceptance."""
    draft = Eagle3Draft(Eagle3Config.for_target(target_config(model.cfg), draft_vocab_size=draft_vocab))
    draft = draft.to(model.dtype)
    draft.set_embedding(model.embed)
    return draft


def profile_draft(drafter: Eagle3Drafter, model: LlamaModel, batches: Seq[int], lags: Seq[int],
                  reps: int) -> tuple[dict[int, float], dict[int, dict[int, float]]]:
    """(D(b) ms: one EAGLE-3 draft step with one new feature row; catch-up ms: extra cost of a lag).

    Uses slots 0..max(batches)-1 of `drafter`: pass a drafter no live engine is using."""
    from tide.engine.features import FeatureStore

    width = 3 * model.cfg.hidden_size
    store = FeatureStore(max(batches), CONTEXT + max(lags) + 16, width, model.dtype, model.device)
    store.rows.normal_()
    step_ms, catchup = {}, {}
    for b in batches:
        seqs = fake_seqs(b, CONTEXT + max(lags))
        for s in seqs:
            drafter.add_sequence(s)

        def run(lag: int, seqs=seqs) -> None:
            for s in seqs:
                drafter._consumed[s.request_id] = s.num_cached - lag
            drafter.propose(seqs, [1] * len(seqs), store, [None] * len(seqs))

        step, *lagged = interleaved_min_ms([partial(run, 1)] + [partial(run, lag) for lag in lags], reps)
        step_ms[b] = round(step, 3)
        catchup[b] = {lag: round(max(0.0, ms - step), 3) for lag, ms in zip(lags, lagged, strict=True)}
        for s in seqs:
            drafter.remove_sequence(s)
    return step_ms, catchup


def profile_lookup_draft(drafter, vocab: int, batches: Seq[int], reps: int) -> dict[int, float]:
    """D(b) ms of a weightless drafter (n-gram): one γ = 1 proposal for b random-token sequences."""
    out = {}
    for b in batches:
        seqs = fake_seqs(b, CONTEXT, vocab=vocab, seed=b)
        out[b] = round(interleaved_min_ms([partial(drafter.propose, seqs, [1] * b, None, [None] * b)], reps)[0], 4)
    return out


def _timed_drafter(drafter):
    """The drafter whose steps a profile times: a HybridDrafter's EAGLE-3 draft (its copies cost no
    forward, so D(b) is the cost of the steps that draft: an upper bound per step)."""
    return drafter.eagle if isinstance(drafter, HybridDrafter) else drafter


def drafter_shape(drafter) -> dict:
    """What the draft latency depends on (part of the cache key)."""
    drafter = _timed_drafter(drafter)
    if drafter is None:
        return {"algorithm": "none"}
    if isinstance(drafter, Eagle3Drafter):
        c = drafter.draft.cfg
        return {"algorithm": "eagle3", "hidden": c.hidden_size, "draft_vocab": c.draft_vocab_size,
                "intermediate": c.intermediate_size, "heads": [c.num_attention_heads, c.num_key_value_heads]}
    return {"algorithm": drafter.algorithm.value, "class": type(drafter).__name__,
            **{k: getattr(drafter, k) for k in ("max_n", "min_n") if hasattr(drafter, k)}}


def _for_profiling(drafter: Eagle3Drafter, batches: Seq[int], lags: Seq[int]) -> Eagle3Drafter:
    """A drafter safe to time: a fresh EAGLE-3 wrapper (own KV slots, sized for the grid) sharing
    the draft weights, so a live engine's drafter state is never touched."""
    return Eagle3Drafter(drafter.draft, drafter.version, max(batches), CONTEXT + max(lags) + 16)


def profile_latency(model: LlamaModel, drafter, batches: Seq[int], ns: Seq[int], lags: Seq[int] = (1, 4, 16, 64),
                    reps: int = 5, tree_sizes: Seq[int] = (), cost: ProfileCost | None = None) -> LatencyProfile:
    """Measure a LatencyProfile for `model` + `drafter` (None, an n-gram or an EAGLE-3 drafter);
    `tree_sizes`: also T_tree(b, N) for these tree sizes N; `cost`: how much of the grid is run."""
    t0 = time.perf_counter()
    cost = cost or ProfileCost()
    drafter = _timed_drafter(drafter)
    batches, ns, lags = sorted(set(batches)), sorted(set(ns)), sorted(set(lags))
    t_ms = profile_target(model, batches, ns, reps, cost.warmup, cost.max_rows)
    tree_ms = profile_tree(model, batches, sorted(set(tree_sizes)), reps) if tree_sizes else {}
    c_ms: dict[int, dict[int, float]] = {}
    if drafter is None:
        d_ms = {b: 0.0 for b in batches}
    elif isinstance(drafter, Eagle3Drafter):
        d_ms, c_ms = profile_draft(_for_profiling(drafter, batches, lags), model, batches, lags, reps)
    else:
        d_ms = profile_lookup_draft(drafter, model.cfg.vocab_size, batches, reps)
    meta = {"context_tokens": CONTEXT, "reps": reps, "threads": torch.get_num_threads(),
            "clock": "wall" if _TIMER[-1] is time.perf_counter else "cpu",
            "dtype": str(model.dtype).removeprefix("torch."), "device": str(model.device),
            "weights": getattr(model, "weight_format", "float"), "drafter": drafter_shape(drafter),
            "measured_unix_s": round(time.time(), 1),
            # ModelRunner pads every sequence of a forward to the longest: a verify step costs
            # T(b, 1 + max γ), not T(b, 1 + mean γ) (tide.policies.adaptive reads this)
            "verify_padding": True}
    prof = LatencyProfile(T_ms=t_ms, D0_ms=d_ms[batches[0]], D_ms=d_ms, C_ms=c_ms,
                          prefill_ms_per_token=profile_prefill(model, reps, cost.warmup, cost.prefill_tokens),
                          meta=meta, tree_ms=tree_ms)
    prof.meta["profile_s"] = round(time.perf_counter() - t0, 1)
    return prof


def default_grid(max_batch: int, max_gamma: int) -> tuple[list[int], list[int], list[int]]:
    """(batches, ns, lags) for a worker: powers of two up to max_batch (and max_batch), n = 1..γmax+1
    (every other n past 5, interpolation fills in), lags 1/4/16/64."""
    batches = sorted({1 << k for k in range(max_batch.bit_length()) if 1 << k <= max_batch} | {max_batch})
    top = max(max_gamma, 1) + 1
    ns = sorted({n for n in range(1, top + 1) if n <= 5 or n % 2 == 1} | {top})
    return batches, ns, [1, 4, 16, 64]


# Past this many bytes of weights a worker's start profile takes a thinner grid (`start_grid`): a
# decode step streams the weights once, so an 8B int8 model's step took 0.2-4 s on a 2-vCPU Zen 4
# guest and the full grid (5 batches x 7 ns, 5 rounds) took 429 s of its first start.
LARGE_MODEL_BYTES = 2 << 30
LARGE_MODEL_REPS = 2  # rounds of the thinner grid (the default: 5)


@dataclass(frozen=True)
class ProfileCost:
    """How much of a grid a profile runs: warm-up runs per point, the most rows (b × n) a T(b, n)
    point may have past n = 2 (None: all; `profile_target`), the timed prompt's tokens."""

    warmup: int = 2
    max_rows: int | None = None
    prefill_tokens: int = PREFILL_CHUNK

    def key(self) -> dict:
        """Its part of a cache key: nothing for the default (the keys of profiles cached before stay)."""
        return {} if self == ProfileCost() else {"cost": asdict(self)}


# A large model's start profile also runs less of that grid (`start_cost`): its forwards of many rows
# are compute-bound, near linear in the rows, so T(b, n) past 36 rows (b × n: batch 4 up to γ 8) is
# extrapolated from the batch's last two points; one warm-up; a 64-token timed prompt. At 8B int8 on
# the Zen 5 guest, one after the other: 58.2 s with the default cost, 29.8 s with this one (its
# prompt 1.08x the 128-token one's per token); 24.5 / 26.5 s with 16 rows and 32 tokens, but then
# T(4, 9) came out 21 % below the measured one and the prompt 1.33x (docs/results/model-sizes).
LARGE_MODEL_COST = ProfileCost(warmup=1, max_rows=36, prefill_tokens=64)


def start_cost(weight_bytes: int) -> ProfileCost:
    """The ProfileCost of a worker's start profile for a model of `weight_bytes` (see start_grid)."""
    return LARGE_MODEL_COST if weight_bytes > LARGE_MODEL_BYTES else ProfileCost()


def start_grid(max_batch: int, max_gamma: int, weight_bytes: int,
               max_recall_gamma: int = 0) -> tuple[list[int], list[int], list[int], int]:
    """(batches, ns, lags, reps) a worker profiles at start: `default_grid` and 5 rounds, or for a
    model of more than LARGE_MODEL_BYTES the smallest, a middle and the largest batch, n = 1, 2, 3
    and γmax + 1 (interpolation fills in), in LARGE_MODEL_REPS rounds.

    `max_recall_gamma` > `max_gamma` (a speculation memory's recalls draft that deep): the verify
    rows past γmax + 1 are measured too, at 2·γmax + 1 and max_recall_gamma + 1. Extrapolating from
    the last chain segment under-priced them: on the reference model at 4 streams T(4, n) rose 2.3 ms
    a row up to n = 9 and 3.3-4.6 ms a row past it (docs/results/speculation-memory)."""
    batches, ns, lags = default_grid(max_batch, max_gamma)
    reps = 5
    if weight_bytes > LARGE_MODEL_BYTES:
        batches = sorted({batches[0], batches[len(batches) // 2], batches[-1]})
        ns, reps = [n for n in ns if n <= 3 or n == ns[-1]], LARGE_MODEL_REPS
    if max_recall_gamma > max_gamma:
        deep = {max_recall_gamma + 1} | ({2 * max_gamma + 1} if 2 * max_gamma < max_recall_gamma else set())
        ns = sorted(set(ns) | deep)
    return batches, ns, lags, reps


def cache_dir() -> Path:
    """$TIDE_PROFILE_CACHE_DIR, else $TIDE_CACHE_DIR/profiles (tide.target's cache root, ~/.cache/tide)."""
    return profile_cache_dir()


def cache_key(model_id: str, model: LlamaModel, drafter, batches, ns, lags, cost: ProfileCost | None = None) -> dict:
    """Everything a profile depends on; its SHA-256 names the cache file."""
    return {**(cost or ProfileCost()).key(), "format": PROFILE_FORMAT, "target": model_id, "dtype": str(model.dtype),
            "device": str(model.device),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "context": CONTEXT,
            "clock": "wall" if _TIMER[-1] is time.perf_counter else "cpu",
            "drafter": drafter_shape(drafter), "batches": sorted(set(batches)), "ns": sorted(set(ns)),
            "lags": sorted(set(lags)) if isinstance(_timed_drafter(drafter), Eagle3Drafter) else [],
            # quantized weights (tide.quant) step at other costs; float keys stay as they were
            **({"weights": model.weight_format} if getattr(model, "weight_format", "float") != "float" else {}),
            # on CPU: the fused kernels or torch ops (tide.kernels), and the lm_head's GEMM
            **({"cpu_ops": kernels.path_name(), "head_packed": getattr(model.head, "packed", None) is not None,
                "gemm": getattr(model.layers[0][1], "kind", "quantized")}
               if model.device.type == "cpu" else {})}


def cache_path(key: dict, directory: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in key["target"])[-48:]
    return (directory or cache_dir()) / f"{slug}-{digest}.json"


def cached_profile(model: LlamaModel, drafter, *, model_id: str, batches, ns, lags=(1, 4, 16, 64), reps: int = 5,
                   directory: Path | None = None, refresh: bool = False,
                   cost: ProfileCost | None = None) -> tuple[LatencyProfile, Path, bool]:
    """(profile, its cache file, True when it came from the cache). `refresh` re-measures and rewrites."""
    key = cache_key(model_id, model, drafter, batches, ns, lags, cost)
    path = cache_path(key, directory)
    if not refresh and path.exists():
        try:
            prof = LatencyProfile.load(path)
            if prof.meta.get("cache_key") == key:
                return prof, path, True
        except (ValueError, KeyError, TypeError, OSError) as e:
            log.warning("ignoring unreadable profile cache %s: %s", path, e)
    prof = profile_latency(model, drafter, batches, ns, lags, reps, cost=cost)
    prof.meta["cache_key"] = key
    prof.meta["target"] = model_id
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(prof.to_json())
    tmp.replace(path)  # atomic: concurrent workers never read half a file
    return prof, path, False


class LiveProfile(LatencyProfile):
    """A LatencyProfile that can re-measure itself in place (`refresh()`), keeping its identity so
    every holder (the worker, policies built later) sees the new tables."""

    def attach(self, remeasure: Callable[[], LatencyProfile]) -> LiveProfile:
        self._remeasure = remeasure
        return self

    @classmethod
    def wrap(cls, prof: LatencyProfile, remeasure: Callable[[], LatencyProfile]) -> LiveProfile:
        live = cls(**{f.name: getattr(prof, f.name) for f in fields(LatencyProfile)})
        return live.attach(remeasure)

    def refresh(self) -> LiveProfile:
        new = self._remeasure()
        for f in fields(LatencyProfile):
            setattr(self, f.name, getattr(new, f.name))
        self.__post_init__()  # rebuild the interpolators and drop the lookup memo
        return self


def wants_profile(policy: str, setting: str) -> bool:
    """TIDE_PROFILE_AT_START: "auto" (default) profiles for policies that take a profile; 1/0 force."""
    s = setting.strip().lower()
    if s in ("", "auto"):
        return policy in PROFILE_POLICIES
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"TIDE_PROFILE_AT_START must be auto, 1 or 0, got {setting!r}")

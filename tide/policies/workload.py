"""Synthetic (and replayed) workloads for the policy simulator.

A workload is a sequence of phases. A phase lasts `duration_s` seconds of simulated time and
brings requests either closed-loop (`concurrency` clients, each sending its next request as soon
as the previous one finishes — the load level is the batch size) or open-loop (`rate_rps`
Poisson arrivals; `burst` > 1 makes them arrive in geometric bursts of that mean size).

Every request carries its own acceptance trace: for each output position k a probability p[k]
that the draft predicts token k, and a pre-drawn uniform u[k]. A draft token at depth j
(1-based) covering position k is accepted iff u[k] < p[k] · depth_decay^{j−1} (EAGLE drafts
get worse the deeper they extend their own features; 0.97 per depth by default). Pre-drawing
u makes every policy face exactly the same easy and hard tokens (common random numbers), so
policy differences are not sampling noise. Requests are drawn from an RNG keyed by
(seed, phase, index), independent of when a policy gets to them.

α per request: drawn from Beta around its domain's α (concentration `spread` = 20, so the
per-request standard deviation is ≈ 0.1 at α = 0.6) when the request arrives. A phase's
`alpha_scale` multiplies the acceptance of every token *generated* during that phase, by every
running request: it models the draft itself getting worse or better (a bad or a retrained draft
version being served), while `mix` changes which requests arrive (a workload shift).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tide.telemetry import StepRecord


@dataclass(frozen=True)
class Domain:
    """A workload domain: mean per-token acceptance α and how often output repeats the context."""

    name: str
    alpha: float
    cache_rate: float = 0.3  # P(an output token already occurs in the request's context)
    spread: float = 20.0  # Beta concentration of per-request α around `alpha`


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    concurrency: int | None = None
    rate_rps: float | None = None
    burst: float = 1.0
    mix: Mapping[str, float] | None = None  # domain → weight; None = all domains equally
    alpha_scale: float = 1.0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate_rps is None):
            raise ValueError(f"phase {self.name!r}: give exactly one of concurrency, rate_rps")


@dataclass
class RequestSpec:
    """One request: lengths in tokens, per-output-position acceptance probabilities and uniforms."""

    rid: str
    domain: str
    prompt_len: int
    output_len: int
    accept_p: list[float]
    u: list[float]
    in_cache: list[bool] = field(default_factory=list)

    @classmethod
    def from_probs(
        cls, rid: str, accept_p: Sequence[float], seed: int | str = 0, prompt_len: int = 0, domain: str = "trace"
    ) -> RequestSpec:
        """A request from an explicit per-output-position acceptance trace (uniforms seeded by `seed`)."""
        rng = random.Random(f"{seed}:{rid}")
        n = len(accept_p)
        return cls(
            rid, domain, prompt_len, n, [float(p) for p in accept_p], [rng.random() for _ in range(n)], [False] * n
        )

    def accepted(self, pos: int, gamma: int, depth_decay: float, scale: float = 1.0) -> int:
        """Accepted draft tokens when drafting `gamma` tokens starting at output position `pos`,
        with the draft's acceptance scaled by `scale` (the current phase's `alpha_scale`)."""
        last = min(pos + gamma, self.output_len)
        k, factor = pos, scale
        while k < last and self.u[k] < self.accept_p[k] * factor:
            k += 1
            factor *= depth_decay
        return k - pos


@dataclass(frozen=True)
class Workload:
    phases: tuple[Phase, ...]
    domains: Mapping[str, Domain]
    prompt_len: tuple[int, int] = (32, 160)  # uniform range, tokens
    output_mean: float = 128.0  # tokens; geometric-ish (exponential) lengths, clipped
    output_range: tuple[int, int] = (16, 384)
    depth_decay: float = 0.97
    seed: int = 0
    name: str = "workload"
    replay: tuple[tuple[float, RequestSpec], ...] = ()  # fixed (arrival s, request); phase 0 only

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    def phase_starts_s(self) -> list[float]:
        out, t = [], 0.0
        for p in self.phases:
            out.append(t)
            t += p.duration_s
        return out

    def request(self, phase_idx: int, k: int) -> RequestSpec:
        """The k-th request of phase `phase_idx` — identical for every policy."""
        phase = self.phases[phase_idx]
        rng = random.Random(f"{self.seed}:{phase_idx}:{k}")
        names = sorted(self.domains)
        weights = [float((phase.mix or {}).get(n, 0.0 if phase.mix else 1.0)) for n in names]
        dom = self.domains[rng.choices(names, weights=weights)[0]]
        lo, hi = self.output_range
        out_len = int(min(max(rng.expovariate(1.0 / self.output_mean), lo), hi))
        a = min(max(dom.alpha, 1e-3), 1 - 1e-3)
        alpha = rng.betavariate(dom.spread * a, dom.spread * (1 - a))
        return RequestSpec(
            rid=f"p{phase_idx}-r{k}",
            domain=dom.name,
            prompt_len=rng.randint(*self.prompt_len),
            output_len=out_len,
            accept_p=[alpha] * out_len,
            u=[rng.random() for _ in range(out_len)],
            in_cache=[rng.random() < dom.cache_rate for _ in range(out_len)],
        )

    def arrivals(self, phase_idx: int) -> list[float]:
        """Open-loop arrival offsets (s) within the phase: Poisson, optionally in bursts."""
        phase = self.phases[phase_idx]
        if phase.rate_rps is None or phase.rate_rps <= 0:
            return []
        rng = random.Random(f"{self.seed}:arrivals:{phase_idx}")
        mean_burst = max(phase.burst, 1.0)
        out, t = [], 0.0
        while True:
            t += rng.expovariate(phase.rate_rps / mean_burst)
            if t >= phase.duration_s:
                return out
            size = 1
            while mean_burst > 1 and rng.random() < 1 - 1 / mean_burst:
                size += 1
            out.extend([t] * size)


# --------------------------------------------------------------------------- generators
DEFAULT_DOMAINS = {
    # α per drafted token; BRIEF §5 measured acceptance length 1.48 (chat) … 1.87 (GSM8K) at γ = 3
    # for a *weakly* trained draft (α ≈ 0.33 … 0.5); a draft adapted online does better (seed 000
    # Table 3: 2.1–2.7 at γ = 3, α ≈ 0.55–0.75). The defaults sit in that adapted range.
    "chat": Domain("chat", alpha=0.5, cache_rate=0.2),
    "math": Domain("math", alpha=0.68, cache_rate=0.35),
    "code": Domain("code", alpha=0.78, cache_rate=0.5),
}


def stationary(alpha: float = 0.65, concurrency: int = 4, phase_s: float = 60.0, seed: int = 0) -> Workload:
    """One phase, one domain, constant α."""
    return Workload(
        phases=(Phase("stationary", phase_s, concurrency=concurrency),),
        domains={"d": Domain("d", alpha)},
        seed=seed,
        name="stationary",
    )


def shifting_alpha(
    scales: Sequence[float] = (1.0, 0.0, 1.0),
    concurrency: int = 4,
    phase_s: float = 30.0,
    alpha: float = 0.7,
    seed: int = 0,
) -> Workload:
    """α shifting over time: phase i multiplies α by scales[i] (0 = a useless draft)."""
    return Workload(
        phases=tuple(
            Phase(f"scale{s:g}#{i}", phase_s, concurrency=concurrency, alpha_scale=s) for i, s in enumerate(scales)
        ),
        domains={"d": Domain("d", alpha)},
        seed=seed,
        name="shifting-alpha",
    )


def per_domain(concurrency: int = 8, phase_s: float = 30.0, seed: int = 0) -> Workload:
    """Per-domain α: a code phase, a chat phase, then a mix."""
    return Workload(
        phases=(
            Phase("code", phase_s, concurrency=concurrency, mix={"code": 1.0}),
            Phase("chat", phase_s, concurrency=concurrency, mix={"chat": 1.0}),
            Phase("mixed", phase_s, concurrency=concurrency),
        ),
        domains=DEFAULT_DOMAINS,
        seed=seed,
        name="per-domain",
    )


def low_high(phase_s: float = 60.0, low: int = 2, high: int = 64, seed: int = 0) -> Workload:
    """The default comparison trace: load moving between low and high concurrency (seed 001 Table 2's
    shape), with a workload shift (chat-heavy, weaker draft) in the second low phase and an open-loop
    bursty phase at the end."""
    return Workload(
        phases=(
            Phase("low", phase_s, concurrency=low),
            Phase("high", phase_s, concurrency=high),
            Phase("low-shift", phase_s, concurrency=low, mix={"chat": 3.0, "math": 1.0}, alpha_scale=0.8),
            Phase("high-2", phase_s, concurrency=high * 3 // 4),
            Phase("bursty", phase_s, rate_rps=1.0, burst=4.0),
        ),
        domains=DEFAULT_DOMAINS,
        seed=seed,
        name="low-high",
    )


WORKLOADS = {"low-high": low_high, "stationary": stationary, "shifting-alpha": shifting_alpha, "per-domain": per_domain}


# --------------------------------------------------------------------------- replay
def requests_from_step_records(records: Iterable[StepRecord]) -> list[tuple[float, RequestSpec]]:
    """Rebuild per-request acceptance traces from recorded engine steps, for replay.

    A recorded step of request r with γ and V accepted marks positions pos..pos+V−1 as accepted
    (p = 1) and, when V < γ, position pos+V as rejected (p = 0); the bonus token and every
    position never drafted get the request's Eq.-2 MLE α. Arrival = the first step's time (s,
    relative to the first record). Prompt lengths are unknown in telemetry and set to 0.
    """
    steps: dict[str, list[tuple[float, int, int]]] = {}
    t0: float | None = None
    for rec in records:
        t0 = rec.time_unix_s if t0 is None else min(t0, rec.time_unix_s)
        for rid, g, v in zip(rec.request_ids, rec.gammas, rec.accepted, strict=True):
            steps.setdefault(rid, []).append((rec.time_unix_s, g, v))
    out = []
    for rid, seq in steps.items():
        seq.sort()
        succ = sum(v for _, g, v in seq if g > 0)
        fail = sum(1 for _, g, v in seq if g > 0 and v < g)
        alpha = succ / (succ + fail) if succ + fail else 0.0
        length = sum(v + 1 for _, _, v in seq)
        p = [alpha] * length
        pos = 0
        for _, g, v in seq:
            for k in range(pos, pos + v):
                p[k] = 1.0
            if v < g and pos + v < length:
                p[pos + v] = 0.0
            pos += v + 1
        rng = random.Random(rid)
        u = [rng.random() for _ in p]
        out.append((seq[0][0] - (t0 or 0.0), RequestSpec(rid, "replay", 0, length, p, u, [False] * length)))
    out.sort(key=lambda x: x[0])
    return out


def fixed_workload(
    requests: Iterable[tuple[float, RequestSpec]], tail_s: float = 1.0, depth_decay: float = 1.0, name: str = "fixed"
) -> Workload:
    """A one-phase open-loop workload of given (arrival s, request) pairs — explicit traces."""
    reqs = tuple(sorted(requests, key=lambda x: x[0]))
    duration = (reqs[-1][0] if reqs else 0.0) + tail_s
    return Workload(
        phases=(Phase(name, duration, rate_rps=0.0),),
        domains={name: Domain(name, 0.0)},
        depth_decay=depth_decay,
        name=name,
        replay=reqs,
    )


def replay_workload(records: Iterable[StepRecord], tail_s: float = 1.0) -> Workload:
    """Recorded engine telemetry replayed at its recorded arrival times (see requests_from_step_records)."""
    return fixed_workload(requests_from_step_records(records), tail_s, name="replay")

"""Deterministic replay simulator: continuous batching step by step, calling a policy like the engine.

Per loop iteration: arrivals join the queue; queued requests are admitted up to `max_batch`
(their prompts are prefilled in one forward, `profile.prefill_ms(Σ prompt)` ms, which emits
each admitted request's first token); then one draft+verify step runs over the running batch:

    decide(StepContext) → γ_i (capped, as the engine does, at remaining output − 1);
    verify_ms = T(b, 1 + Σγ_i / b);
    draft_ms = max_i γ_i · D(b) + c(L, b_s)   (catch-up: L = max lag, b_s = #requests with γ_i > 0)
    time += verify_ms + draft_ms;  each request emits min(V_i + 1, remaining) tokens;  observe(...)

V_i comes from the request's pre-drawn acceptance trace (see `workload`) scaled by the phase's
`alpha_scale` at the step's start, so every policy sees the same tokens. A request that decodes
with γ = 0 falls one token further behind its draft (lag + 1); a step with γ > 0 pays the
catch-up and resets lag to 0. Times are ms inside,
seconds in the reported stats. Nothing is random here beyond the workload's seeded traces and
the policy's own seeded RNG, so a (policy, workload, profile) triple always gives one result.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import asdict, dataclass, field

from tide.policies.base import GammaPolicy, RequestView, StepContext, StepFeedback
from tide.policies.profile import LatencyProfile
from tide.policies.workload import RequestSpec, Workload


@dataclass
class PhaseStats:
    """Per-phase (or overall) results. Requests belong to the phase they arrived in; tokens to the
    phase in which they were emitted. Latencies in s, TPOT in ms, throughput in tokens/s."""

    name: str
    duration_s: float
    tokens: int
    tokens_per_s: float
    requests: int
    completed: int
    mean_latency_s: float
    p99_latency_s: float
    mean_tpot_ms: float
    mean_gamma: float
    accept_len: float
    mean_batch: float
    steps: int


@dataclass
class SimResult:
    policy: str
    workload: str
    phases: list[PhaseStats]
    overall: PhaseStats
    requests: int
    tokens_requested: int
    tokens_emitted: int
    sim_time_s: float
    trace: list[tuple[float, int, float]] = field(default_factory=list)  # (t s, batch, mean γ)

    def phase(self, name: str) -> PhaseStats:
        return next(p for p in self.phases if p.name == name)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("trace")
        return d


class _Req:
    __slots__ = ("spec", "arrival", "phase", "closed", "first", "finish", "generated", "lag", "gammas", "accepted")

    def __init__(self, spec: RequestSpec, arrival: float, phase: int, closed: bool, history: int) -> None:
        self.spec, self.arrival, self.phase, self.closed = spec, arrival, phase, closed
        self.first = self.finish = math.nan
        self.generated = self.lag = 0
        self.gammas: deque[int] = deque(maxlen=history)
        self.accepted: deque[int] = deque(maxlen=history)

    def view(self) -> RequestView:
        return RequestView(
            request_id=self.spec.rid,
            recent_gammas=tuple(self.gammas),
            recent_accepted=tuple(self.accepted),
            last_gamma=self.gammas[-1] if self.gammas else 0,
            lag=self.lag,
            context_len=self.spec.prompt_len + self.generated,
            drafter="sim",
        )


class _Acc:
    """Running sums for one phase's step statistics."""

    def __init__(self) -> None:
        self.tokens = self.steps = self.req_steps = self.gamma_sum = self.batch_sum = 0
        self.spec_steps = self.spec_len = 0


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _stats(name: str, duration_s: float, acc: _Acc, reqs: list[_Req]) -> PhaseStats:
    done = [r for r in reqs if not math.isnan(r.finish)]
    lat = [(r.finish - r.arrival) / 1000.0 for r in done]
    tpot = [(r.finish - r.first) / (r.spec.output_len - 1) for r in done if r.spec.output_len > 1]
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan
    return PhaseStats(
        name=name,
        duration_s=duration_s,
        tokens=acc.tokens,
        tokens_per_s=acc.tokens / duration_s if duration_s > 0 else math.nan,
        requests=len(reqs),
        completed=len(done),
        mean_latency_s=mean(lat),
        p99_latency_s=_percentile(lat, 0.99),
        mean_tpot_ms=mean(tpot),
        mean_gamma=acc.gamma_sum / acc.req_steps if acc.req_steps else 0.0,
        accept_len=acc.spec_len / acc.spec_steps if acc.spec_steps else 1.0,
        mean_batch=acc.batch_sum / acc.steps if acc.steps else 0.0,
        steps=acc.steps,
    )


def simulate(
    policy: GammaPolicy,
    workload: Workload,
    profile: LatencyProfile,
    *,
    max_batch: int = 64,
    max_gamma: int = 8,
    history: int = 8,
    record_trace: bool = False,
) -> SimResult:
    """Run `workload` to completion (all arrived requests drained) under `policy`."""
    if max_batch < 1 or max_gamma < 0:
        raise ValueError("need max_batch >= 1 and max_gamma >= 0")
    phases = workload.phases
    starts = [s * 1000.0 for s in workload.phase_starts_s()]
    end = workload.duration_s * 1000.0
    phase_of = lambda t: max(bisect.bisect_right(starts, t) - 1, 0)
    decay = workload.depth_decay

    open_arrivals: list[tuple[float, int, int, RequestSpec | None]] = []
    for i, ph in enumerate(phases):
        if workload.replay and i == 0:
            open_arrivals += [(t_s * 1000.0, 0, k, spec) for k, (t_s, spec) in enumerate(workload.replay)]
        elif ph.rate_rps:
            open_arrivals += [(starts[i] + off * 1000.0, i, k, None) for k, off in enumerate(workload.arrivals(i))]
    open_arrivals.sort(key=lambda a: (a[0], a[1], a[2]))
    pending = deque(open_arrivals)
    closed_starts = [starts[i] for i, ph in enumerate(phases) if ph.concurrency]

    issued = [0] * len(phases)
    closed_in_flight = 0
    all_reqs: list[_Req] = []
    waiting: deque[_Req] = deque()
    running: list[_Req] = []
    accs = [_Acc() for _ in phases]
    drain = _Acc()
    trace: list[tuple[float, int, float]] = []
    t, step = 0.0, 0

    def acc_at(time: float) -> _Acc:
        return accs[phase_of(time)] if time < end else drain

    def finish(r: _Req) -> None:
        nonlocal closed_in_flight
        r.finish = t
        if r.closed:
            closed_in_flight -= 1

    while True:
        while pending and pending[0][0] <= t:
            at, i, k, spec = pending.popleft()
            r = _Req(spec or workload.request(i, k), at, i, False, history)
            all_reqs.append(r)
            waiting.append(r)
        if t < end:
            i = phase_of(t)
            conc = phases[i].concurrency or 0
            while closed_in_flight < conc:
                r = _Req(workload.request(i, issued[i]), t, i, True, history)
                issued[i] += 1
                closed_in_flight += 1
                all_reqs.append(r)
                waiting.append(r)

        admitted = []
        while waiting and len(running) + len(admitted) < max_batch:
            admitted.append(waiting.popleft())
        if admitted:
            t += profile.prefill_ms(sum(r.spec.prompt_len for r in admitted))
            for r in admitted:
                r.first, r.generated = t, 1
                acc_at(t).tokens += 1
                if r.spec.output_len <= 1:
                    finish(r)
                else:
                    running.append(r)

        if not running:
            nexts = [pending[0][0]] if pending else []
            nexts += [s for s in closed_starts if t < s < end]
            if not nexts and not waiting:
                break
            if nexts and not waiting:
                t = max(t, min(nexts))
            continue

        b = len(running)
        ctx = StepContext(batch_size=b, requests=tuple(r.view() for r in running), step=step, max_gamma=max_gamma)
        gammas = [int(g) for g in policy.decide(ctx)]
        if len(gammas) != b or any(g < 0 or g > max_gamma for g in gammas):
            raise ValueError(f"{policy.name}: decide returned {gammas!r} for {b} requests (max γ {max_gamma})")
        # like the engine: never draft past the output (≤ remaining − 1 drafts + the bonus token)
        gammas = [min(g, r.spec.output_len - r.generated - 1) for r, g in zip(running, gammas, strict=True)]

        verify = profile.target_ms(b, 1 + sum(gammas) / b)
        spec_lags = [r.lag for r, g in zip(running, gammas, strict=True) if g > 0]
        draft = max(gammas) * profile.draft_ms(b)
        if spec_lags and max(spec_lags) > 0:
            draft += profile.catchup_ms(max(spec_lags), len(spec_lags))
        t += verify + draft

        scale = phases[phase_of(t - verify - draft)].alpha_scale if t - verify - draft < end else 1.0
        acc = acc_at(t)
        accepted, hits, emitted_total, still = [], [], 0, []
        for r, g in zip(running, gammas, strict=True):
            pos, remaining = r.generated, r.spec.output_len - r.generated
            v = r.spec.accepted(pos, g, decay, scale) if g > 0 else 0
            v = min(v, remaining - 1)
            emitted = v + 1
            accepted.append(v)
            hits.append(sum(r.spec.in_cache[pos : pos + v]))
            r.generated += emitted
            r.lag = 0 if g > 0 else r.lag + emitted
            r.gammas.append(g)
            r.accepted.append(v)
            emitted_total += emitted
            if g > 0:
                acc.spec_steps += 1
                acc.spec_len += emitted
            if r.generated >= r.spec.output_len:
                finish(r)
            else:
                still.append(r)
        acc.tokens += emitted_total
        acc.steps += 1
        acc.req_steps += b
        acc.gamma_sum += sum(gammas)
        acc.batch_sum += b
        policy.observe(
            StepFeedback(
                batch_size=b,
                gammas=tuple(gammas),
                accepted=tuple(accepted),
                step_ms=verify + draft,
                draft_ms=draft,
                verify_ms=verify,
                cache_hits=tuple(hits),
            )
        )
        if record_trace:
            trace.append((t / 1000.0, b, sum(gammas) / b))
        running = still
        step += 1

    by_phase: list[list[_Req]] = [[] for _ in phases]
    for r in all_reqs:
        by_phase[phase_of(r.arrival)].append(r)
    stats = [_stats(ph.name, ph.duration_s, accs[i], by_phase[i]) for i, ph in enumerate(phases)]
    total = _Acc()
    for a in [*accs, drain]:
        for k in vars(total):
            setattr(total, k, getattr(total, k) + getattr(a, k))
    sim_s = t / 1000.0
    return SimResult(
        policy=policy.name,
        workload=workload.name,
        phases=stats,
        overall=_stats("overall", sim_s, total, all_reqs),
        requests=len(all_reqs),
        tokens_requested=sum(r.spec.output_len for r in all_reqs),
        tokens_emitted=total.tokens,
        sim_time_s=sim_s,
        trace=trace,
    )

"""Run several policies on one workload, plus the per-phase static-γ oracle, and tabulate.

The oracle is the best *static* γ per phase: every γ in 0..max_gamma is simulated over the whole
trace, and each phase takes the γ with the highest tokens/s in that phase. It is an upper bound
for "pick γ per load level" but not for per-request or per-step choices, so a policy may beat it.
Its overall tokens/s is Σ_phase best tokens / Σ_phase duration (phase interactions ignored).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tide.policies.base import FixedGamma
from tide.policies.profile import LatencyProfile
from tide.policies.registry import POLICY_NAMES, make_policy
from tide.policies.simulator import SimResult, simulate
from tide.policies.workload import Workload


def oracle(
    workload: Workload, profile: LatencyProfile, *, max_batch: int = 64, max_gamma: int = 8
) -> tuple[dict[str, Any], dict[int, SimResult]]:
    """Best static γ per phase; also returns every static run (keyed by γ)."""
    runs = {
        g: simulate(FixedGamma(g), workload, profile, max_batch=max_batch, max_gamma=max_gamma)
        for g in range(max_gamma + 1)
    }
    phases = []
    tokens = 0
    for i, ph in enumerate(workload.phases):
        g = max(runs, key=lambda k: runs[k].phases[i].tokens_per_s)
        best = runs[g].phases[i]
        tokens += best.tokens
        phases.append({"phase": ph.name, "gamma": g, "tokens_per_s": best.tokens_per_s})
    return {"phases": phases, "tokens_per_s": tokens / workload.duration_s}, runs


def compare(
    workload: Workload,
    profile: LatencyProfile,
    *,
    policies: Sequence[str] = POLICY_NAMES,
    params: Mapping[str, Mapping[str, Any]] | None = None,
    policy_profile: LatencyProfile | None = None,
    max_batch: int = 64,
    max_gamma: int = 8,
) -> dict[str, Any]:
    """Simulate each named policy (plus static γ = 0 and 3) and the oracle on `workload`.

    `profile` is the simulated machine; `policy_profile` (default: the same) is what the
    policies are given — pass a perturbed one to test robustness to a stale profile.
    """
    params = params or {}
    pprof = policy_profile or profile
    orc, static_runs = oracle(workload, profile, max_batch=max_batch, max_gamma=max_gamma)
    results: dict[str, SimResult] = {"no-spec": static_runs[0], "static-3": static_runs[min(3, max_gamma)]}
    for name in policies:
        if name == "static":
            continue
        pol = make_policy(name, params.get(name), pprof)
        results[name] = simulate(pol, workload, profile, max_batch=max_batch, max_gamma=max_gamma)
    return {
        "workload": workload.name,
        "phases": [p.name for p in workload.phases],
        "results": {k: v.to_dict() for k, v in results.items()},
        "oracle": orc,
    }


def format_table(report: Mapping[str, Any], detail: bool = False) -> str:
    """Plain-text tables: per-phase tokens/s (+ oracle), overall latency/γ metrics, and with
    `detail` every policy's per-phase latency, TPOT, mean γ and accept length."""
    phases = report["phases"]
    res = report["results"]
    w = max(10, *(len(p) + 2 for p in phases))
    lines = [f"{'policy':<12}" + "".join(f"{p:>{w}}" for p in phases) + f"{'overall':>{w}}{'vs no-spec':>12}"]
    base = res["no-spec"]["overall"]["tokens_per_s"]
    for name, r in res.items():
        row = "".join(f"{ph['tokens_per_s']:>{w}.1f}" for ph in r["phases"])
        tps = r["overall"]["tokens_per_s"]
        lines.append(f"{name:<12}{row}{tps:>{w}.1f}{tps / base:>11.3f}x")
    orc = report["oracle"]
    row = "".join(f"{ph['tokens_per_s']:>{w}.1f}" for ph in orc["phases"])
    lines.append(f"{'oracle':<12}{row}{orc['tokens_per_s']:>{w}.1f}")
    lines.append(f"{'(oracle γ)':<12}" + "".join(f"{ph['gamma']:>{w}d}" for ph in orc["phases"]))
    lines.append("")
    lines.append(f"{'policy':<12}{'lat mean s':>11}{'lat p99 s':>11}{'TPOT ms':>9}{'mean γ':>8}{'acc len':>9}")
    for name, r in res.items():
        o = r["overall"]
        lines.append(
            f"{name:<12}{o['mean_latency_s']:>11.2f}{o['p99_latency_s']:>11.2f}{o['mean_tpot_ms']:>9.1f}"
            f"{o['mean_gamma']:>8.2f}{o['accept_len']:>9.2f}"
        )
    if detail:
        lines.append("")
        lines.append(
            f"{'policy':<12}{'phase':<12}{'tok/s':>8}{'lat mean s':>11}{'lat p99 s':>11}{'TPOT ms':>9}"
            f"{'mean γ':>8}{'acc len':>9}{'batch':>7}"
        )
        for name, r in res.items():
            for ph in r["phases"]:
                lines.append(
                    f"{name:<12}{ph['name']:<12}{ph['tokens_per_s']:>8.1f}{ph['mean_latency_s']:>11.2f}"
                    f"{ph['p99_latency_s']:>11.2f}{ph['mean_tpot_ms']:>9.1f}{ph['mean_gamma']:>8.2f}"
                    f"{ph['accept_len']:>9.2f}{ph['mean_batch']:>7.1f}"
                )
    return "\n".join(lines)

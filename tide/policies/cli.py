"""`tide policies simulate`: every policy on one synthetic trace, as a table and a JSON report."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from tide.policies.compare import compare, format_table
from tide.policies.profile import LatencyProfile, synthetic_profile
from tide.policies.registry import POLICY_NAMES
from tide.policies.workload import WORKLOADS


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="tide policies simulate", description=__doc__)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="low-high", help="synthetic trace")
    p.add_argument("--phase-s", type=float, default=None, help="phase length, s (default: the trace's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--policies",
        default=",".join(n for n in POLICY_NAMES if n != "static"),
        help="comma-separated policy names (static γ=0, γ=3 and the oracle always run)",
    )
    p.add_argument("--params", default="{}", help='JSON {"policy": {param: value}} passed to make_policy')
    p.add_argument("--profile", type=Path, default=None, help="LatencyProfile JSON (default: synthetic)")
    p.add_argument(
        "--policy-profile",
        type=Path,
        default=None,
        help="profile the policies are given, if not the simulated machine's (robustness)",
    )
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-gamma", type=int, default=8)
    p.add_argument("--detail", action="store_true", help="also print every policy's per-phase metrics")
    p.add_argument("--json", type=Path, default=Path("policy-sim.json"), help="report path ('-' to skip)")
    return p


def _finite(obj):
    """NaN (e.g. latency of a phase that completed no request) → null, so the file is strict JSON."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def simulate_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    profile = LatencyProfile.load(args.profile) if args.profile else synthetic_profile()
    pprof = LatencyProfile.load(args.policy_profile) if args.policy_profile else None
    kwargs = {"seed": args.seed}
    if args.phase_s is not None:
        kwargs["phase_s"] = args.phase_s
    workload = WORKLOADS[args.workload](**kwargs)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown:
        print(f"unknown policies: {', '.join(unknown)}; known: {', '.join(POLICY_NAMES)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    report = compare(
        workload,
        profile,
        policies=names,
        params=json.loads(args.params),
        policy_profile=pprof,
        max_batch=args.max_batch,
        max_gamma=args.max_gamma,
    )
    report["wall_s"] = round(time.perf_counter() - t0, 3)
    report["profile"] = profile.to_dict()
    print(
        f"workload {workload.name}: {len(workload.phases)} phases, {workload.duration_s:.0f} s simulated, "
        f"max batch {args.max_batch}, max γ {args.max_gamma}  ({report['wall_s']:.1f} s wall)"
    )
    print(format_table(report, detail=args.detail))
    if str(args.json) != "-":
        args.json.write_text(json.dumps(_finite(report), indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(simulate_main())

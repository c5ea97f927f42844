"""The pure half of `tide bench adapt`: from request records and poll samples to the JSON numbers.

No I/O, no clocks. Times are seconds since the mode's traffic started (t = 0 is the first request
of phase 0); a mode's traffic window is [0, end_s).

A request record is a dict: `t0`, `t1` (sent, answered; s), `phase` (index of the phase it was sent
in), `tokens` (usage.completion_tokens), `accept_length` (the response's `speculation.accept_length`:
tokens emitted per verify step, bonus included; 0 without speculation), `verify_steps`,
`draft_version`, `error` ("" when it succeeded).

Attribution: a request's tokens (and verify steps) are spread uniformly over [t0, t1], so a window
gets the share of each request that overlaps it; requests straddling a phase boundary or the end
count partly. Hence:
  tok_s          = Σ tokens · share / window seconds                      (client-side tokens/s)
  accept_length  = Σ accept_length · verify_steps · share / Σ verify_steps · share   (None: no
                   verify step in the window; the step-weighted mean the gateway itself uses)
  drafted_share  = Σ accept_length · verify_steps · share / Σ tokens · share: the share of tokens that
                   speculative steps emitted (the rest came from plain decoding: the γ policy's choice)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence


def share(t0: float, t1: float, a: float, b: float) -> float:
    """Fraction of [t0, t1] inside [a, b); an instantaneous request counts wholly where t1 falls."""
    if t1 <= t0:
        return 1.0 if a <= t1 < b else 0.0
    return max(0.0, min(t1, b) - max(t0, a)) / (t1 - t0)


def window(records: Iterable[dict], a: float, b: float) -> dict:
    """tok_s and accept_length over [a, b) (see the module doc), plus the raw sums."""
    tokens = steps = weighted = 0.0
    done = errors = 0
    for r in records:
        if a <= r["t1"] < b:
            done += not r["error"]
            errors += bool(r["error"])
        s = share(r["t0"], r["t1"], a, b)
        if s <= 0 or r["error"]:
            continue
        tokens += r["tokens"] * s
        steps += r["verify_steps"] * s
        weighted += r["accept_length"] * r["verify_steps"] * s
    seconds = b - a
    return {"tok_s": round(tokens / seconds, 3) if seconds > 0 else None,
            "accept_length": round(weighted / steps, 4) if steps > 0 else None,
            "drafted_share": round(min(1.0, weighted / tokens), 4) if tokens > 0 else None,
            "tokens": round(tokens, 1), "verify_steps": round(steps, 1), "seconds": round(seconds, 2),
            "completed": done, "errors": errors}


def phase_table(records: Sequence[dict], bounds: Sequence[tuple[str, float, float]]) -> dict:
    """{"phases": {name: window}, "overall": window over [first start, last end)}."""
    return {"phases": {name: window(records, a, b) for name, a, b in bounds},
            "overall": window(records, bounds[0][1], bounds[-1][2])}


def timeline(records: Sequence[dict], end_s: float, bin_s: float) -> list[list]:
    """[[bin middle s, tok_s, accept_length], ...] over [0, end_s) in bins of `bin_s` seconds."""
    n = max(1, math.ceil(end_s / bin_s - 1e-9))
    out = []
    for i in range(n):
        a, b = i * bin_s, min(end_s, (i + 1) * bin_s)
        w = window(records, a, b)
        out.append([round((a + b) / 2, 2), w["tok_s"], w["accept_length"]])
    return out


def _ratio(x, y):
    return round(x / y, 4) if x is not None and y not in (None, 0) else None


def ratios(static: dict, online: dict) -> dict:
    """online / static of tok_s and accept_length, per phase and overall (phase_table outputs)."""
    pair = lambda o, s: {k: _ratio(o[k], s[k]) for k in ("tok_s", "accept_length")}  # noqa: E731
    return {"phases": {ph: pair(online["phases"][ph], st) for ph, st in static["phases"].items()},
            "overall": pair(online["overall"], static["overall"])}


def intervals(samples: Sequence[dict], key: str, end_s: float) -> list[list[float]]:
    """[[start, end], ...] where samples[key] is truthy; a state holds from its sample to the next
    sample (the last one to end_s). Samples are {"t": s, key: value} in time order."""
    out: list[list[float]] = []
    for i, smp in enumerate(samples):
        if not smp.get(key) or smp["t"] >= end_s:
            continue
        stop = min(end_s, samples[i + 1]["t"] if i + 1 < len(samples) else end_s)
        if out and abs(out[-1][1] - smp["t"]) < 1e-9:
            out[-1][1] = round(stop, 2)
        else:
            out.append([round(max(0.0, smp["t"]), 2), round(stop, 2)])
    return out


def collection_overhead(windows: Sequence[dict], method: str) -> dict:
    """From A/B windows [{"collection": bool, "tokens": int, "seconds": float}, ...] (the same requests
    in every window): median tokens/s with collection off and on, on/off, and the cost in percent
    (positive = collection made serving slower)."""
    speed = lambda on: [w["tokens"] / w["seconds"] for w in windows if w["collection"] == on and w["seconds"] > 0]  # noqa: E731
    off, on = speed(False), speed(True)
    if not off or not on:
        return {"method": method, "off_tok_s": None, "on_tok_s": None, "on_over_off": None, "cost_pct": None,
                "windows": list(windows)}
    m_off, m_on = statistics.median(off), statistics.median(on)
    return {"method": method, "off_tok_s": round(m_off, 3), "on_tok_s": round(m_on, 3),
            "on_over_off": round(m_on / m_off, 4), "cost_pct": round(100.0 * (1.0 - m_on / m_off), 2),
            "windows": list(windows)}


def promotions(history: Iterable[dict], drafts: dict[str, dict], outcomes: dict[str, dict], t0_unix: float,
               first_version: str) -> list[dict]:
    """Promotions during the run, oldest first. `history`: registry pointer events {"action",
    "to_version", "time_unix_s", "actor"}; `drafts`: version -> eval_metrics; `outcomes`: candidate
    version -> trainer outcome (eval_accept_length_candidate/base, duration_s). The bench's own
    promotion of the starting draft (`first_version`), and anything before traffic, is left out."""
    out = []
    for ev in sorted(history, key=lambda e: e["time_unix_s"]):
        v = ev["to_version"]
        if ev["action"] != "promote" or v == first_version or ev["time_unix_s"] < t0_unix:
            continue  # the bench's own set-up (a starter draft the registry promotes at start, say)
        o, metrics = outcomes.get(v, {}), drafts.get(v, {})
        out.append({"t_s": round(ev["time_unix_s"] - t0_unix, 2), "version": v, "actor": ev.get("actor", ""),
                    "eval_accept_length": o.get("eval_accept_length_candidate", metrics.get("accept_length")),
                    "eval_accept_length_base": o.get("eval_accept_length_base"), "eval_metrics": metrics})
    return out


def training_cycles(outcomes: Iterable[dict], t0_unix: float) -> dict:
    """Trainer runs (deduplicated by run_id upstream), oldest first, and their mean duration."""
    runs = sorted(outcomes, key=lambda o: o.get("finished_unix_s", 0.0))
    cycles = [{**o, "t_s": round(o.get("finished_unix_s", t0_unix) - t0_unix, 2)} for o in runs]
    durations = [o["duration_s"] for o in runs if o.get("duration_s")]
    return {"cycles": cycles, "count": len(cycles),
            "mean_duration_s": round(statistics.mean(durations), 2) if durations else None,
            "total_duration_s": round(sum(durations), 2)}


def checks(static: dict, online: dict, bounds: Sequence[tuple[str, float, float]], min_ratio: float = 1.10) -> dict:
    """Issue 6's done-when on this run: in every phase's second half (after the shift has had time to
    be learnt) online's accept length exceeds static's; online's overall tok/s ≥ min_ratio × static's."""
    late = {}
    for name, a, b in bounds:
        mid = (a + b) / 2
        s, o = window(static["requests"], mid, b), window(online["requests"], mid, b)
        late[name] = {"static": s["accept_length"], "online": o["accept_length"],
                      "online_higher": None if None in (s["accept_length"], o["accept_length"])
                      else o["accept_length"] > s["accept_length"]}
    r = _ratio(online["overall"]["tok_s"], static["overall"]["tok_s"])
    return {"accept_length_second_half": late, "overall_tok_s_ratio": r,
            "meets": {"accept_above_static_after_each_shift": all(v["online_higher"] for n, v in late.items()
                                                                   if n != bounds[0][0]),
                      f"tok_s_x{min_ratio:.2f}": r is not None and r >= min_ratio}}

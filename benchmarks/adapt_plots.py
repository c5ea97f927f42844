"""Plots of `tide bench adapt` (matplotlib, PNG), from the result JSON only.

adapt.png  accept length (top) and client-side tokens/s (bottom) over time, static vs online on
           shared axes; dotted vertical lines at the phase boundaries (domain shifts), shaded spans
           where the online workers collected hidden states, dashed lines + markers at promotions.
loop.png   the online loop's plumbing over time: chunk MB written by the workers, tokens buffered
           at the trainer, tokens collected since collection was last enabled (controller); it runs
           on past the traffic window while in-flight requests finish (solid black line).
policy.png the workers' γ policy in both modes: its global acceptance estimate α̂ (top) and its
           draft-cost correction κ_d per batch bucket (bottom, log scale: measured / profiled draft
           ms; above ≈ 2 at batch 2 on the reference CPU drafting stops paying), so a policy that
           stopped speculating shows why (docs/results/adapt, run b4).
"""

from __future__ import annotations

from pathlib import Path

COLORS = {"static": "tab:blue", "online": "tab:orange"}


def _xy(timeline: list, col: int) -> tuple[list, list]:
    pts = [(row[0], row[col]) for row in timeline if row[col] is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _decorate(ax, res: dict, label: bool) -> None:
    for ph in res["phases"]:
        ax.axvline(ph["start_s"], color="grey", ls=":", lw=0.9)
        if label:
            ax.text(ph["start_s"] + 2, 1.0, ph["name"], transform=ax.get_xaxis_transform(), va="top", fontsize=8)
    for i, (a, b) in enumerate(res["online"].get("collection_intervals", [])):
        ax.axvspan(a, b, color="tab:green", alpha=0.12, lw=0, label="online: collecting" if i == 0 and label else None)
    for i, p in enumerate(res.get("promotions", [])):
        ax.axvline(p["t_s"], color="tab:red", ls="--", lw=0.9, label="promotion" if i == 0 and label else None)


def plot(res: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (top, bot) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    for mode in ("static", "online"):
        tl = res[mode]["timeline"]
        top.plot(*_xy(tl, 2), color=COLORS[mode], lw=1.6, label=mode)
        bot.plot(*_xy(tl, 1), color=COLORS[mode], lw=1.6, label=mode)
    for ax in (top, bot):
        _decorate(ax, res, ax is top)
    for p in res.get("promotions", []):
        y = p.get("eval_accept_length")
        if y:
            top.plot([p["t_s"]], [y], marker="v", color="tab:red", ms=7)
            top.annotate(p["version"].rsplit("/", 1)[-1], (p["t_s"], y), fontsize=7, xytext=(3, 3),
                         textcoords="offset points")
    end = res["phases"][-1]["end_s"]
    bot.set_xlim(0, end)  # promotions after the traffic ended are in loop.png
    top.set_ylabel("accept length (tokens / verify step)")
    bot.set_ylabel("completion tokens/s (client side)")
    bot.set_xlabel(f"seconds since traffic started ({res['bin_s']:g} s bins; concurrency {res['concurrency']})")
    top.legend(fontsize=8, loc="lower right")
    bot.legend(fontsize=8, loc="lower right")
    top.set_title("tide bench adapt: static draft vs the online loop, domain shifts at the dotted lines")
    fig.tight_layout()
    paths = [out_dir / "adapt.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    samples = res["online"].get("samples", [])
    fig, ax = plt.subplots(figsize=(13, 3.5))
    ts = [s["t"] for s in samples]
    for key, scale, name in (("chunk_bytes", 1e-6, "chunk MB written (workers)"),
                             ("buffered_tokens", 1e-3, "k tokens buffered (trainer)"),
                             ("tokens_collected", 1e-3, "k tokens collected (controller)")):
        pts = [(t, s[key] * scale) for t, s in zip(ts, samples, strict=True) if s.get(key) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.3, label=name)
    _decorate(ax, res, True)
    ax.axvline(end, color="k", lw=0.9, label="traffic ends (in-flight requests finish)")
    ax.set_xlabel("seconds since traffic started (online mode)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    paths.append(out_dir / "loop.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)

    paths.append(out_dir / "policy.png")
    _plot_policy(res, paths[2], end, plt)
    return [str(p) for p in paths]


def _plot_policy(res: dict, path: Path, end: float, plt) -> None:
    fig, (top, bot) = plt.subplots(2, 1, figsize=(11, 5.5), sharex=True)
    for mode in ("static", "online"):
        samples = [s for s in res[mode].get("samples", []) if s.get("policy")]
        ts = [s["t"] for s in samples]
        top.plot(ts, [s["policy"].get("alpha_global") for s in samples], color=COLORS[mode], lw=1.4, label=mode)
        buckets = sorted({k for s in samples for k in s["policy"] if k.startswith("kappa_draft[")})
        for i, key in enumerate(buckets):
            pts = [(s["t"], s["policy"][key]) for s in samples if key in s["policy"]]
            bot.plot([p[0] for p in pts], [p[1] for p in pts], color=COLORS[mode], lw=1.4, ls=("-", "--", ":")[i % 3],
                     label=f"{mode} {key.removeprefix('kappa_draft[').rstrip(']')}")
    for ax in (top, bot):
        _decorate(ax, res, ax is top)
    bot.set_yscale("log")
    bot.set_xlim(0, end)
    top.set_ylabel("α̂ (global acceptance estimate)")
    bot.set_ylabel("κ_d (draft ms / profiled)")
    bot.set_xlabel("seconds since traffic started")
    top.legend(fontsize=8, loc="lower right")
    bot.legend(fontsize=8, loc="upper right")
    top.set_title("the γ policy's estimates (worker metric tide_inference_policy_estimate)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_horizon(res: dict, out_dir: Path) -> list[str]:
    """horizon.png for `--scenario horizon`: live accept length with each third's held-out eval at
    γ = 3 (markers) and the offline reference (dashed), client-side tok/s, and the trainer's CPU share
    (CPU-seconds per second, from the poller's samples), static vs online; collection spans, promotions
    and the time to recover marked. Bins of 60 s (the JSON's timeline has `bin_s`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.adapt_horizon import cpu_share
    from benchmarks.adapt_stats import timeline

    out_dir.mkdir(parents=True, exist_ok=True)
    end = res["phases"][-1]["end_s"]
    fig, (acc, tok, cpu) = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    for mode in ("static", "online"):
        r = res[mode]
        tl = timeline(r["requests"], end, 60.0) if r.get("requests") else r["timeline"]
        acc.plot(*_xy(tl, 2), color=COLORS[mode], lw=1.5, label=f"{mode}: live accept length")
        tok.plot(*_xy(tl, 1), color=COLORS[mode], lw=1.5, label=mode)
        thirds = [t for t in r.get("thirds", []) if t.get("eval_accept_length_g3") is not None]
        acc.plot([t["end_s"] for t in thirds], [t["eval_accept_length_g3"] for t in thirds], ls="none", marker="o",
                 color=COLORS[mode], ms=7, mfc="white", label=f"{mode}: held-out eval, γ = 3")
        share = cpu_share(r.get("samples", []))
        cpu.plot([p[0] for p in share], [p[1] for p in share], color=COLORS[mode], lw=1.0, label=mode)
    off = (res.get("offline_reference") or {}).get("eval_accept_length_g3")
    if off:
        acc.axhline(off, color="k", ls="--", lw=1.0, label="offline reference, held-out eval γ = 3")
    ttr = res.get("time_to_recover_s")
    for ax in (acc, tok, cpu):
        for i, (a, b) in enumerate(res["online"].get("collection_intervals", [])):
            ax.axvspan(a, b, color="tab:green", alpha=0.10, lw=0, label="online: collecting" if i == 0 and ax is acc
                       else None)
        for i, p in enumerate(res.get("promotions", [])):
            ax.axvline(p["t_s"], color="tab:red", ls="--", lw=0.8, label="promotion" if i == 0 and ax is acc else None)
        for k in (1, 2):
            ax.axvline(end * k / 3, color="grey", ls=":", lw=0.9)
        if ttr is not None:
            ax.axvline(ttr, color="tab:purple", lw=1.2, label="time to recover" if ax is acc else None)
    cpu.set_xlim(0, end)
    acc.set_ylabel("accept length")
    tok.set_ylabel("completion tok/s")
    cpu.set_ylabel("trainer CPU s / s")
    cpu.set_xlabel(f"seconds since traffic started (60 s bins; concurrency {res['concurrency']}; thirds dotted)")
    acc.legend(fontsize=7, loc="upper left", ncol=2)
    tok.legend(fontsize=7, loc="lower right")
    cpu.legend(fontsize=7, loc="upper right")
    acc.set_title("tide bench adapt --scenario horizon: a chat draft serving GSM8K, static vs the online loop")
    fig.tight_layout()
    path = out_dir / "horizon.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]

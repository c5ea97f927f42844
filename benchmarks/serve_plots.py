"""Plots of `tide bench serve` (matplotlib, PNG), from the result JSON only.

For the closed-loop runs (x: concurrency) and, when there are any, the open-loop runs (x: request
rate, `inf` last), each x value one evenly spaced tick in the order run:
throughput[_rate].png  output tokens/s (left axis) and successful requests/s (right axis).
latency[_rate].png     TTFT p50/p90/p99 (top) and ITL p50/p90/p99 with TPOT p50 dashed (bottom), ms.
Several servers: one colour each (requests/s then left out); with several rounds, each point is the
run's median round by output tokens/s (a real round, so its percentiles belong together).
"""

from __future__ import annotations

from pathlib import Path

STYLES = {"p50": "-", "p90": "--", "p99": ":"}
COLOURS = ("tab:blue", "tab:red", "tab:green", "tab:purple", "tab:brown")


def median_rounds(rows: list[dict]) -> dict[str, list[dict]]:
    """Per server (in first-seen order): for each run, in the order run, its median round's row."""
    out: dict[str, list[dict]] = {}
    for label in dict.fromkeys(r.get("server", "") for r in rows):
        mine = [r for r in rows if r.get("server", "") == label]
        runs = dict.fromkeys((r["concurrency"], r["request_rate"]) for r in mine)
        out[label] = []
        for run in runs:
            same = sorted((r for r in mine if (r["concurrency"], r["request_rate"]) == run),
                          key=lambda r: r["output_tok_s"] or 0.0)
            out[label].append(same[(len(same) - 1) // 2])
    return out


def _series(rows: list[dict], metric: str, key: str) -> list:
    return [r[metric][key] if r[metric][key] is not None else float("nan") for r in rows]


def _axis(ax, labels: list[str], xlabel: str) -> None:
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)


def plot(res: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = res["config"]
    model = " vs ".join(s["label"] for s in cfg["servers"]) if len(cfg.get("servers") or []) > 1 else cfg["model"]
    sep = "\n" if len(cfg.get("servers") or []) > 1 else ", "  # several servers' names: the title's own line
    title = f"tide bench serve: {model}{sep}{cfg['num_prompts']} requests a run, max_tokens {cfg['max_tokens']}"
    shapes = (("", [r for r in res["results"] if r["request_rate"] is None], "concurrency", "concurrency"),
              ("_rate", [r for r in res["results"] if r["request_rate"] is not None], "request_rate",
               "request rate (requests/s, Poisson arrivals)"))
    paths = []
    for suffix, rows, key, xlabel in shapes:
        if not rows:
            continue
        fleet = median_rounds(rows)
        several = len(fleet) > 1
        first = next(iter(fleet.values()))
        labels = [f"{r[key]:g}" if isinstance(r[key], float) else str(r[key]) for r in first]
        xs = range(len(first))

        fig, ax = plt.subplots(figsize=(7, 4))
        for (server, srows), colour in zip(fleet.items(), COLOURS, strict=False):
            ax.plot(xs, [r["output_tok_s"] for r in srows], marker="o", color=colour,
                    label=f"{server}: output tokens/s" if several else "output tokens/s")
        ax.set_ylabel("output tokens/s", color="tab:blue" if not several else "black")
        ax.set_ylim(bottom=0)
        lines = ax.get_lines()
        if not several:
            right = ax.twinx()
            right.plot(xs, [r["request_throughput"] for r in first], marker="s", color="tab:orange", ls="--",
                       label="requests/s")
            right.set_ylabel("successful requests/s", color="tab:orange")
            right.set_ylim(bottom=0)
            lines = lines + right.get_lines()
        ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="upper left")
        _axis(ax, labels, xlabel)
        ax.set_title(title, fontsize=9)
        fig.tight_layout()
        paths.append(out_dir / f"throughput{suffix}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

        fig, (top, bot) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        for (server, srows), colour in zip(fleet.items(), COLOURS, strict=False):
            name = f"{server} " if several else ""
            for p, ls in STYLES.items():
                top.plot(xs, _series(srows, "ttft_ms", p), marker="o", ls=ls, color=colour, label=f"{name}TTFT {p}")
                bot.plot(xs, _series(srows, "itl_ms", p), marker="o", ls=ls,
                         color=colour if several else "tab:green", label=f"{name}ITL {p}")
            bot.plot(xs, _series(srows, "tpot_ms", "p50"), marker="x", ls="-.",
                     color=colour if several else "tab:red", label=f"{name}TPOT p50")
        top.set_ylabel("time to first token (ms)")
        bot.set_ylabel("inter-token latency (ms)")
        for ax in (top, bot):
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=7 if several else 8, loc="upper left")
            ax.grid(alpha=0.3)
        _axis(bot, labels, xlabel)
        top.set_title(title, fontsize=9)
        fig.tight_layout()
        paths.append(out_dir / f"latency{suffix}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return [str(p) for p in paths]

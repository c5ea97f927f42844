"""Plots of `tide bench serve` (matplotlib, PNG), from the result JSON only.

For the closed-loop runs (x: concurrency) and, when there are any, the open-loop runs (x: request
rate, `inf` last), each x value one evenly spaced tick in the order run:
throughput[_rate].png  output tokens/s (left axis) and successful requests/s (right axis).
latency[_rate].png     TTFT p50/p90/p99 (top) and ITL p50/p90/p99 with TPOT p50 dashed (bottom), ms.
"""

from __future__ import annotations

from pathlib import Path

STYLES = {"p50": "-", "p90": "--", "p99": ":"}


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
    title = f"tide bench serve: {cfg['model']}, {cfg['num_prompts']} requests a run, max_tokens {cfg['max_tokens']}"
    shapes = (("", [r for r in res["results"] if r["request_rate"] is None], "concurrency", "concurrency"),
              ("_rate", [r for r in res["results"] if r["request_rate"] is not None], "request_rate",
               "request rate (requests/s, Poisson arrivals)"))
    paths = []
    for suffix, rows, key, xlabel in shapes:
        if not rows:
            continue
        labels = [f"{r[key]:g}" if isinstance(r[key], float) else str(r[key]) for r in rows]
        xs = range(len(rows))

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(xs, [r["output_tok_s"] for r in rows], marker="o", color="tab:blue", label="output tokens/s")
        ax.set_ylabel("output tokens/s", color="tab:blue")
        ax.set_ylim(bottom=0)
        right = ax.twinx()
        right.plot(xs, [r["request_throughput"] for r in rows], marker="s", color="tab:orange", ls="--",
                   label="requests/s")
        right.set_ylabel("successful requests/s", color="tab:orange")
        right.set_ylim(bottom=0)
        lines = ax.get_lines() + right.get_lines()
        ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="upper left")
        _axis(ax, labels, xlabel)
        ax.set_title(title, fontsize=9)
        fig.tight_layout()
        paths.append(out_dir / f"throughput{suffix}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

        fig, (top, bot) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        for p, ls in STYLES.items():
            top.plot(xs, _series(rows, "ttft_ms", p), marker="o", ls=ls, color="tab:blue", label=f"TTFT {p}")
            bot.plot(xs, _series(rows, "itl_ms", p), marker="o", ls=ls, color="tab:green", label=f"ITL {p}")
        bot.plot(xs, _series(rows, "tpot_ms", "p50"), marker="x", ls="-.", color="tab:red", label="TPOT p50")
        top.set_ylabel("time to first token (ms)")
        bot.set_ylabel("inter-token latency (ms)")
        for ax in (top, bot):
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=8, loc="upper left")
            ax.grid(alpha=0.3)
        _axis(bot, labels, xlabel)
        top.set_title(title, fontsize=9)
        fig.tight_layout()
        paths.append(out_dir / f"latency{suffix}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return [str(p) for p in paths]

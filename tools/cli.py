"""The `tide` console script; subcommands are added as the project grows (one `add_*_parser`
function per subcommand, each setting `func`, the handler that returns the exit status)."""

import argparse
import sys
from pathlib import Path

from tide.precision import WEIGHTS_NAMES


def add_up_parser(subparsers) -> None:
    """`tide up`: the whole stack on loopback (see tools.launcher)."""
    p = subparsers.add_parser("up", help="start the whole stack locally (no Docker); Ctrl-C stops it",
                              description="Start Redis, S3 (SeaweedFS), registry, trainer, controller, inference "
                                          "worker(s) and the gateway on 127.0.0.1, health-gated in order.")
    p.add_argument("--port", type=int, default=8000, help="gateway HTTP port (0: any free port) [8000]")
    p.add_argument("--workers", type=int, default=1, help="inference workers [1]")
    p.add_argument("--target", default="ref", help="target model: 'ref', a HF directory or a .gguf file [ref]")
    p.add_argument("--weights", choices=WEIGHTS_NAMES, help="how the workers store the target's weights "
                   "(TIDE_WEIGHTS): int8 / int4 = weight-only quantized on CPU [the environment's, else auto]")
    p.add_argument("--drafter", default="eagle3", choices=("ngram", "none", "eagle3"),
                   help="drafter the workers start with; eagle3 = the registry's current draft, n-gram until "
                        "one is registered [eagle3]")
    p.add_argument("--data-dir", type=Path, default=Path("var"),
                   help="run logs (run-<time>/), S3 data and trainer outputs [var]")
    p.add_argument("--no-collection", action="store_true", help="do not collect hidden states for training")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds each service may take to start")
    p.add_argument("--background-priority", choices=("idle", "normal"), default="idle",
                   help="CPU priority of the trainer: idle (SCHED_IDLE) leaves every cycle serving wants to "
                        "the workers and the gateway [idle]")
    p.set_defaults(func=_up)


def _up(args) -> int:
    from tools.launcher import StackConfig, up

    if args.workers < 1 or not 0 <= args.port < 65536:
        print("tide up: --workers must be >= 1 and --port in [0, 65535]", file=sys.stderr)
        return 2
    return up(StackConfig(port=args.port, workers=args.workers, target=args.target, weights=args.weights or "",
                          drafter=args.drafter,
                          data_dir=args.data_dir, collection=not args.no_collection,
                          startup_timeout_s=args.startup_timeout,
                          background_idle=args.background_priority == "idle"))


def add_bench_parser(subparsers) -> None:
    """`tide bench engine|policies|sampling|adapt|serve|weights`: benchmarks that print a short table and
    write JSON (each benchmark module gives its arguments, `add_arguments`, and its handler, `run_cli`)."""
    from benchmarks import adapt, engine, policies, sampling, serve, weights

    bench = subparsers.add_parser("bench", help="benchmarks that print JSON and a short table")
    kinds = bench.add_subparsers(dest="bench", required=True)
    for name, module, help_text in (
            ("engine", engine, "latency table, speculative tokens/s, overheads"),
            ("policies", policies, "every γ policy on the real engine over a load trace"),
            ("sampling", sampling, "accept length of sampled requests: coupled against rejection sampling"),
            ("adapt", adapt, "static draft vs the online loop over domain shifts, via the gateway"),
            ("serve", serve, "TTFT, ITL, throughput of any OpenAI-compatible endpoint over a concurrency "
                             "sweep or request rates"),
            ("weights", weights, "quantized weights (int8, int4) against bf16: quality and speed")):
        p = kinds.add_parser(name, help=help_text)
        module.add_arguments(p)
        p.set_defaults(func=module.run_cli)


def add_chaos_parser(subparsers) -> None:
    """`tide chaos`: kill the stack's processes one at a time under load (see benchmarks.chaos)."""
    from benchmarks import chaos

    p = subparsers.add_parser("chaos", help="chaos suite: kill -9 / SIGSTOP each part of a stack under load, "
                                            "count failed requests and lost or duplicated chunks",
                              description=(chaos.__doc__ or "").split("\n")[0])
    chaos.add_arguments(p)
    p.set_defaults(func=chaos.run_cli)


def add_draft_parser(subparsers) -> None:
    """`tide draft bootstrap|eval|finetune` (see tools.draft.draft_cli)."""
    from tools.draft.draft_cli import add_draft_parser as add

    add(subparsers)


def build_parser() -> argparse.ArgumentParser:
    """The `tide` command line: each subcommand's arguments set `func`, its handler."""
    parser = argparse.ArgumentParser(prog="tide")
    subparsers = parser.add_subparsers(dest="command")
    add_up_parser(subparsers)
    add_bench_parser(subparsers)
    add_chaos_parser(subparsers)
    add_draft_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command in ("bench", "draft"):  # CPU tensor work in this process (see tide.allocator)
        from tide.allocator import keep_freed_memory

        keep_freed_memory()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

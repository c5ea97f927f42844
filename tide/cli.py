"""The `tide` console script: one entry point, subcommands registered by the parts that own them."""

from __future__ import annotations

import argparse
import sys


def _bench(args) -> int:
    if args.bench == "engine":
        from services.inference.bench_engine import run_cli

        return run_cli(args)
    raise SystemExit(f"unknown benchmark {args.bench!r}")


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks that print JSON and a short table")
    kinds = bench.add_subparsers(dest="bench", required=True)
    from services.inference.bench_engine import add_arguments as engine_args

    engine_args(kinds.add_parser("engine", help="latency table, speculative tokens/s, overheads"))
    bench.set_defaults(func=_bench)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tide", description="TIDE: self-improving speculative decoding")
    subparsers = parser.add_subparsers(dest="command")
    add_bench_parser(subparsers)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

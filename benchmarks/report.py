"""What every `tide bench` command does at its end and when run on its own (`python -m benchmarks.X`)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path


def write_json(res: dict, path: Path | None, indent: int = 1) -> None:
    """Write the results to `path` (its folder made as needed) and say so; nothing when None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=indent))
    print(f"wrote {path}")


def standalone_main(prog: str, doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None],
                    run_cli: Callable[[argparse.Namespace], int], argv: list[str] | None = None) -> int:
    """The benchmark as its own command line, with the same arguments as under `tide bench`."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


def cpu_name() -> str:
    """This machine's CPU as /proc/cpuinfo names it, with the bf16 instructions it has: results
    are only comparable between runs on the same kind of CPU."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "?"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    extras = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(extras) or 'no bf16 instructions'}; {os.cpu_count()} CPUs)"


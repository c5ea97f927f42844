"""What every `tide bench` command does at its end and when run on its own (`python -m benchmarks.X`)."""

from __future__ import annotations

import argparse
import json
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

"""Where a running `tide up` stack can be found: `<data dir>/current-stack.json`.

`tide up` picks free ports for its services, so an admin tool cannot guess the registry's address.
While a stack runs, its launcher keeps `<data dir>/current-stack.json` naming the run directory
(which holds `stack.json`, with every service's address, and the 0600 `admin-token`) and the
launcher's pid; it removes the file when it stops. A file left by a stack that was killed is
recognised by its dead pid and ignored.

`tidectl` reads it through `find_stack()`: with no `--registry` / `$TIDE_REGISTRY_ADDR`, it talks to
the stack started from the same directory (data dir `./var`, or `$TIDE_STACK_DIR`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

POINTER = "current-stack.json"
DATA_DIR_ENV = "TIDE_STACK_DIR"
DEFAULT_DATA_DIR = Path("var")


@dataclass(frozen=True)
class RunningStack:
    run_dir: Path
    endpoints: dict[str, object]  # service name -> address (see tools.launcher.Endpoints)
    admin_token: str | None  # None when the token file cannot be read (another user's stack)


def write_json_atomically(path: Path, obj: object) -> None:
    """Write `obj` as JSON so that a concurrent reader sees the old file or the new one, never half
    of one (the gateway's /v1/status and `tide admin` read stack files while the launcher rewrites them)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.replace(path)


def write_pointer(data_dir: Path, run_dir: Path) -> None:
    write_json_atomically(Path(data_dir) / POINTER, {"run_dir": str(Path(run_dir).resolve()), "pid": os.getpid()})


def remove_pointer(data_dir: Path, run_dir: Path) -> None:
    """Remove the pointer if it still names `run_dir` (a newer stack may have replaced it)."""
    path = Path(data_dir) / POINTER
    try:
        if json.loads(path.read_text()).get("run_dir") == str(Path(run_dir).resolve()):
            path.unlink()
    except (OSError, ValueError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def find_stack(data_dir: Path | None = None) -> RunningStack | None:
    """The stack running from `data_dir` (default $TIDE_STACK_DIR, else ./var), or None."""
    data_dir = Path(data_dir or os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR)
    try:
        pointer = json.loads((data_dir / POINTER).read_text())
        run_dir = Path(pointer["run_dir"])
        if not _alive(int(pointer["pid"])):
            return None
        state = json.loads((run_dir / "stack.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        token = (run_dir / "admin-token").read_text().strip() or None
    except OSError:
        token = None
    return RunningStack(run_dir, dict(state.get("endpoints") or {}), token)

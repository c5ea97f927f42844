"""Who used the CPUs while a command ran: every thread's time on a CPU and time runnable but waiting.

    .venv/bin/python benchmarks/experiments/thread_cpu.py SECONDS
    .venv/bin/python benchmarks/experiments/thread_cpu.py -- tide bench serve ...

Reads /proc/PID/task/TID/schedstat (ns on a CPU, ns waiting on a run queue, time slices) of every
thread before and after, and prints the threads that ran or waited more than 5 ms, with their
process's command line. A command's own threads that end before the second snapshot are missed:
to count a bench client, start it in the background and give SECONDS. Used for the serving-path
accounting in docs/results/engine-step (section 2e): CPU milliseconds and wake-ups (slices) per
served token for the gateway, the worker's gRPC threads, the controller, Redis and S3.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def snapshot() -> dict[tuple[str, str], tuple[str, str, int, int, int]]:
    """(pid, tid) -> (command line, thread name, ns on a CPU, ns waiting, slices)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:70]
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    comm = f.read().strip()
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    run, wait, slices = (int(x) for x in f.read().split())
                out[(pid, tid)] = (cmd, comm, run, wait, slices)
        except (OSError, ValueError):  # a process or thread that ended meanwhile
            continue
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    before, t0 = snapshot(), time.monotonic()
    if argv[0] == "--":
        subprocess.run(argv[1:], check=False)
    else:
        time.sleep(float(argv[0]))
    after, wall = snapshot(), time.monotonic() - t0
    rows = []
    for key, (cmd, comm, run, wait, slices) in after.items():
        _, _, run0, wait0, slices0 = before.get(key, ("", "", 0, 0, 0))
        run_ms, wait_ms = (run - run0) / 1e6, (wait - wait0) / 1e6
        if run_ms > 5 or wait_ms > 5:
            rows.append((run_ms, wait_ms, slices - slices0, f"{key[0]}/{key[1]}", comm, cmd))
    rows.sort(reverse=True)
    cpus = len(os.sched_getaffinity(0))
    print(f"{wall:.1f} s; {sum(r[0] for r in rows):.0f} CPU ms used of {cpus * wall * 1e3:.0f}")
    print(f"{'run ms':>9} {'wait ms':>8} {'slices':>7}  {'pid/tid':<15} {'thread':<16} command")
    for run_ms, wait_ms, slices, ids, comm, cmd in rows[:40]:
        print(f"{run_ms:9.0f} {wait_ms:8.0f} {slices:7d}  {ids:<15} {comm:<16} {cmd}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Where a service process may run: CPU affinity and priority, for services that share one machine.

On a machine that hosts both an inference worker and the trainer, "train on separate hardware"
means separate cores: the worker gets `TIDE_CPUS`, the trainer `TIDE_TRAINER_CPUS`, and neither
steals the other's time. `pin_process` applies a CPU set (and a nice increment) to every thread of
the calling process, so call it before the model is loaded; torch's intra-op pool is sized to the
set, because OpenMP threads that outnumber their cores spin against each other (two processes of
2 threads each on 2 cores generated at 29 tok/s instead of 169 alone: docs/results/bootstrap, History).

A worker's CPUs are its alone: `tide up` starts every other process (Redis, S3, registry, controller,
gateway, a trainer without CPUs of its own) on `cpus_left(worker CPUs)` through `started_on`. Left
to the kernel, a process woken by the worker (the gateway reading its token stream, say) may be run
on the worker's core whenever the other cores are busy, as they are while a trainer trains.
`run_and_wait_s` reads how long a process ran and waited for a CPU (schedstat), to check that.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

log = logging.getLogger(__name__)


def parse_cpus(spec: str) -> frozenset[int]:
    """CPU ids of "1", "2-3", "0,2-3" (empty: none, meaning all); ValueError when malformed."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or int(hi if sep else lo) < int(lo):
            raise ValueError(f"expected CPU ids or ranges like 1 or 2-3, got {part!r}")
        cpus.update(range(int(lo), int(hi if sep else lo) + 1))
    return frozenset(cpus)


def cpus_left(reserved: frozenset[int]) -> frozenset[int] | None:
    """The CPUs this process may use that are not `reserved` (where everything else goes when the
    workers have `reserved`); None when nothing is reserved or nothing would be left."""
    rest = frozenset(os.sched_getaffinity(0)) - reserved
    return rest if reserved and rest else None


@contextlib.contextmanager
def started_on(cpus: frozenset[int] | None):
    """Threads and processes the calling thread starts inside the block run on `cpus` (a new thread or
    child process inherits its creator's CPU set); None: unchanged. The caller's own set is restored."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)  # pid 0: the calling thread
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def run_and_wait_s(pid: int) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) of process `pid`, summed over its
    threads (/proc/PID/task/*/schedstat, in ns); None where the kernel does not keep schedstat."""
    run = wait = seen = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                on_cpu, waiting, _ = f.read().split()
        except (OSError, ValueError):  # a thread that ended meanwhile, or no schedstat
            continue
        run, wait, seen = run + int(on_cpu), wait + int(waiting), seen + 1
    return (run / 1e9, wait / 1e9) if seen else None


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) process `pid` has used so far, its ended threads included (which
    `run_and_wait_s` misses: a trainer runs each training in a thread of its own); None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the command name (field 2) may hold spaces and parentheses: split after its last ")"
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def _threads() -> list[int]:
    """Thread ids of this process (imports may already have started some); [0] = the caller where
    /proc is missing."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def pin_process(cpus: frozenset[int], nice: int = 0, variable: str = "CPUs") -> None:
    """Run every thread of this process (and those it starts later) on `cpus` (empty: leave as is)
    at a priority lowered by `nice`; torch threads = len(cpus). ValueError naming `variable` when a
    CPU is not available to this process."""
    if cpus:
        available = os.sched_getaffinity(0)
        if not cpus <= available:
            raise ValueError(f"{variable}: CPUs {sorted(cpus - available)} are not available to this process "
                             f"(available: {sorted(available)})")
    if nice:
        level = min(os.getpriority(os.PRIO_PROCESS, 0) + nice, 19)
        for tid in _threads():
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.setpriority(os.PRIO_PROCESS, tid, level)
    if cpus:
        for tid in _threads():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, cpus)
        import torch

        torch.set_num_threads(len(cpus))
    log.info("process placement: nice %d, CPUs %s", os.getpriority(os.PRIO_PROCESS, 0),
             sorted(os.sched_getaffinity(0)))


_one_thread_lock = threading.Lock()
_one_thread_users = 0  # threads inside one_torch_thread (guarded by the lock)
_one_thread_restore = 0  # the process's torch thread count, read at the first use; restored by the last to leave


@contextlib.contextmanager
def one_torch_thread():
    """Run the torch work inside on this thread alone, without starting an OpenMP pool for it.

    For a process's helper threads (loading a draft, building a chunk) beside the thread that runs
    the model. libgomp gives every thread that starts a parallel region a pool of its own, and a
    live pool's threads count against the cores: with more of them than cores it throttles every
    pool's spin-waits, so the model's thread hands work to its OpenMP threads by sleeping and
    waking them. On 2 cores one helper that had once copied a large tensor, and lived on, made a
    batch-1 decode step 42 ms instead of 26 (the same step in the same process once it ended).
    `torch.set_num_threads` sets the calling thread's OpenMP setting (threads already running torch
    keep theirs) and the default of threads that start torch later: the last helper to leave
    restores the count found at the first use, so overlapping helpers cannot leave it at 1."""
    import torch

    global _one_thread_users, _one_thread_restore
    with _one_thread_lock:
        if not _one_thread_restore:  # the first use ever: nobody has lowered anything yet
            _one_thread_restore = torch.get_num_threads()
        _one_thread_users += 1
        torch.set_num_threads(1)
    try:
        yield
    finally:
        with _one_thread_lock:
            _one_thread_users -= 1
            if _one_thread_users == 0:
                torch.set_num_threads(_one_thread_restore)

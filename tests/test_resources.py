"""tide.resources: a service process pinned to its CPUs, every thread of it, with torch sized to them;
what a launcher starts kept off CPUs reserved for workers; a process's CPU and wait time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from services.inference.settings import InferenceSettings
from tide.resources import cpus_left, parse_cpus, pin_process, run_and_wait_s, started_on

# Runs in a child: pinning the test process itself would constrain every later test.
CHILD = """
import json, os, threading, torch
from tide.resources import pin_process
started = threading.Event(); release = threading.Event()
def before():  # a thread that exists before pinning (grpc, OpenMP and imports start some)
    started.set(); release.wait()
t = threading.Thread(target=before); t.start(); started.wait()
nice0 = os.getpriority(os.PRIO_PROCESS, 0)
pin_process(frozenset({THE_CPU}), 3, "TIDE_CPUS")
after = {}
t2 = threading.Thread(target=lambda: after.setdefault("cpus", sorted(os.sched_getaffinity(0)))); t2.start(); t2.join()
tids = [int(x) for x in os.listdir("/proc/self/task")]
print(json.dumps({"threads": {str(tid): sorted(os.sched_getaffinity(tid)) for tid in tids},
                  "later_thread": after["cpus"], "torch_threads": torch.get_num_threads(),
                  "nice_raised_by": os.getpriority(os.PRIO_PROCESS, t.native_id) - nice0}))
release.set(); t.join()
"""


def test_a_pinned_process_runs_every_thread_on_its_cpus_with_as_many_torch_threads():
    cpu = max(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", CHILD.replace("THE_CPU", str(cpu))], capture_output=True, text=True,
                         timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(got["threads"]) >= 2 and all(c == [cpu] for c in got["threads"].values()), got["threads"]
    assert got["later_thread"] == [cpu]
    assert got["torch_threads"] == 1
    assert got["nice_raised_by"] == 3  # the thread started before pinning is lowered too


def test_a_cpu_the_process_may_not_use_is_refused_naming_the_variable():
    missing = max(os.sched_getaffinity(0)) + 1000
    with pytest.raises(ValueError, match=rf"TIDE_CPUS='{missing}'.*\[{missing}\]"):
        pin_process(frozenset({missing}), 0, f"TIDE_CPUS='{missing}'")
    assert parse_cpus("0,2-3") == {0, 2, 3} and parse_cpus(" ") == frozenset()
    for bad in ("3-1", "a", "1-", "-1"):
        with pytest.raises(ValueError, match="CPU ids"):
            parse_cpus(bad)


def test_the_worker_reads_its_cpus_from_the_environment():
    assert InferenceSettings.from_env({"TIDE_CPUS": "0-1"}).cpu_set == {0, 1}
    assert InferenceSettings.from_env({}).cpu_set == frozenset()
    with pytest.raises(ValueError, match="CPU ids"):
        InferenceSettings.from_env({"TIDE_CPUS": "1-0"})


def test_what_is_started_inside_started_on_runs_on_those_cpus_and_the_caller_gets_its_own_back():
    mine = frozenset(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs two CPUs: one to keep free and one to start on")
    worker = frozenset({min(mine)})
    rest = cpus_left(worker)
    assert rest == mine - worker and cpus_left(frozenset()) is None and cpus_left(mine) is None
    seen = {}
    with started_on(rest):
        child = subprocess.Popen([sys.executable, "-c", "import os, time; print(sorted(os.sched_getaffinity(0)))"],
                                 stdout=subprocess.PIPE, text=True)
        t = threading.Thread(target=lambda: seen.setdefault("thread", frozenset(os.sched_getaffinity(0))))
        t.start()
        t.join()
    assert child.communicate(timeout=60)[0].strip() == str(sorted(rest))
    assert seen["thread"] == rest
    assert frozenset(os.sched_getaffinity(0)) == mine
    with started_on(None):  # nothing reserved: nothing changes
        assert frozenset(os.sched_getaffinity(0)) == mine


SPIN = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
print("pinned", flush=True)
t = time.time()
while time.time() - t < 2.5:
    pass
"""


def test_two_busy_processes_on_one_cpu_each_wait_for_it_about_half_the_time():
    cpu = str(min(os.sched_getaffinity(0)))
    procs = [subprocess.Popen([sys.executable, "-c", SPIN, cpu], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        assert p.stdout.readline().strip() == "pinned"
    before = [run_and_wait_s(p.pid) for p in procs]
    time.sleep(1.0)  # both spinning on the one CPU
    after = [run_and_wait_s(p.pid) for p in procs]
    for p in procs:
        p.wait(30)
    for (run0, wait0), (run1, wait1) in zip(before, after, strict=True):
        # neither can have the CPU much more than half the time; the rest it waited for it
        assert 0.3 < (wait1 - wait0) / (run1 - run0 + wait1 - wait0) < 0.8, (before, after)
        assert 0.8 < run1 - run0 + wait1 - wait0 < 2.0  # ≈ the second it was alive and runnable
    assert run_and_wait_s(procs[0].pid) is None  # gone


def test_one_torch_thread_runs_helpers_single_threaded_and_restores_the_default():
    """Overlapping helpers each run torch on one thread; the model's thread keeps its count, and
    once the last helper leaves, threads that start torch later get the process's count again."""
    import threading

    import torch

    from tide.resources import one_torch_thread

    before = torch.get_num_threads()
    seen: dict[str, int] = {}
    a_inside, b_inside, a_again = threading.Event(), threading.Event(), threading.Event()

    def helper_a() -> None:
        with one_torch_thread():
            seen["a"] = torch.get_num_threads()
            a_inside.set()
            b_inside.wait(10)
        a_again.wait(10)
        with one_torch_thread():  # entered again after leaving while b was still inside
            seen["a again"] = torch.get_num_threads()

    def helper_b() -> None:
        a_inside.wait(10)
        with one_torch_thread():
            seen["b"] = torch.get_num_threads()
            b_inside.set()
        a_again.set()

    threads = [threading.Thread(target=helper_a), threading.Thread(target=helper_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    later: list[int] = []
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join(30)
    assert (seen["a"], seen["b"], seen["a again"]) == (1, 1, 1)
    assert torch.get_num_threads() == before and later == [before]


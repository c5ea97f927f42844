"""tide.allocator: after keep_freed_memory(), a step that frees and re-allocates the same large
tensors reuses mapped pages instead of page-faulting them in again (the trainer's kernel time)."""

import subprocess
import sys

SCRIPT = """
import resource, sys, torch
if sys.argv[1] == "tuned":
    from tide.allocator import keep_freed_memory
    assert keep_freed_memory()
def step():
    x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB: above glibc's largest mmap threshold
    return int(x[::4096].sum())
for _ in range(5):  # warm-up: the heap grows to its working size
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def minor_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_freed_tensors_are_reused_without_page_faults():
    pages = 10 * (64 << 20) // 4096  # what ten fresh 64 MiB allocations fault in
    default, tuned = minor_faults("default"), minor_faults("tuned")
    assert default > pages // 2  # glibc's default: mmap + munmap every time
    assert tuned < pages // 4  # steady state is 0; a heap regrowth can re-fault one block now and then

"""tide.allocator: after keep_freed_memory(), a step that frees and re-allocates the same large
tensors reuses mapped pages instead of page-faulting them in again (the trainer's kernel time)."""

import json
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


def test_free_heap_pages_go_back_to_the_kernel():
    """Blocks freed between live ones leave the heap's pages in RSS until release_free_memory (as the
    trainer's freed batches did: 13.7 GB, 3.3 GB after one trim). In a process of its own, so that
    this one's heap does not matter."""
    code = """
import json
from tide.allocator import release_free_memory
def rss_mb():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 // 2**20
blocks = [bytearray(64 * 1024) for _ in range(8000)]  # 512 MB from the heap, below the mmap threshold
pins = blocks[::50]  # every 50th stays: the heap cannot shrink from its top
del blocks
before = rss_mb()
print(json.dumps({"before": before, "released": release_free_memory(), "after": rss_mb()}))
"""
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                    timeout=120).stdout)
    assert out["released"] and out["before"] > 400
    assert out["after"] < out["before"] / 4

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


KV_SCRIPT = """
import json, torch
from tide.engine.llama import KVCache, LlamaConfig
def rss():
    return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) << 10
cfg = LlamaConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
                           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
                           "vocab_size": 128, "max_position_embeddings": 4096})
before = rss()
cache = KVCache(cfg, 16, 4096, torch.float32, "cpu")  # 16 slots x 4096 tokens x 4 layers: 512 MiB
allocated = rss() - before
for t in cache.k + cache.v:
    t[3, :, :1000] = 1.0  # one request of 1000 tokens in slot 3
used = rss() - before
from tide.memory import resident_tensor_bytes
resident = resident_tensor_bytes(cache.k + cache.v)
zeros = all(float(t.abs().sum()) == 4 * 64 * 1000 for t in cache.k + cache.v)  # the rest reads as zeros
print(json.dumps({"nbytes": cache.nbytes(), "allocated": allocated, "used": used, "zeros": zeros,
                  "resident": resident}))
"""


def test_the_kv_cache_holds_memory_for_the_tokens_cached_not_its_size():
    """A cache sized for every slot's full context holds (RSS) only what was written: one request of
    1000 tokens in a 16 x 4096 cache takes about its own 1000 rows, and unwritten rows read as zeros;
    the worker's status reports that resident part (tide.memory.resident_tensor_bytes)."""
    out = subprocess.run([sys.executable, "-c", KV_SCRIPT], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.splitlines()[-1])
    one_request = got["nbytes"] / 16 * 1000 / 4096
    assert got["zeros"]
    assert got["allocated"] < 0.02 * got["nbytes"], got
    assert 0.8 * one_request < got["used"] < 1.5 * one_request + (8 << 20), got
    written = 8 * 4 * 1000 * 64 * 4  # K and V of 4 layers, 4 heads x 1000 rows x 64 float32 each
    assert written <= got["resident"] <= written + 8 * 4 * 4096, got  # a partly written page per head

"""glibc malloc settings for processes that churn through large CPU tensors (engine, trainer).

By default glibc serves every allocation above its mmap threshold (128 KiB, raised dynamically up
to 32 MiB) with a fresh mmap and returns it with munmap on free, and trims the heap top above
128 KiB. A CPU forward or training step allocates and frees the same large activations (a 4096 x
8192 fp32 logits block is 128 MiB) every step, so every step page-faults and zero-fills them
again: measured on the 2-core CI-sized VM, a third of the trainer's CPU time was kernel time and
the bootstrap's generation ran 1.4x slower (174 s vs 126 s for the same 17k tokens; sys time
147 s vs 23 s). Serving all allocations from the heap and keeping up to `trim_threshold` bytes of
freed memory there lets the next step reuse pages that are already mapped.

Cost: freed memory stays mapped to the process. `trim_threshold` bounds only the heap's top: free
pages between live blocks stay too, and a long-running trainer grew from 6.6 to 13.7 GB in one
training run (3.3 GB after one `malloc_trim`). A process that frees much over a long time calls
`release_free_memory` now and then (the trainer: every 10 s of training and after each run).
`TIDE_MALLOC_TUNING=0` leaves glibc's defaults. A no-op where libc is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os

log = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4

_applied = False


def keep_freed_memory(trim_threshold: int = 1 << 30, top_pad: int = 256 << 20) -> bool:
    """Serve large allocations from the heap and keep freed memory mapped (see the module doc).
    Idempotent; returns whether the settings are in effect."""
    global _applied
    if _applied:
        return True
    if os.environ.get("TIDE_MALLOC_TUNING", "1") == "0":
        return False
    mallopt = libc_function("mallopt")
    if mallopt is None:  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(p, v) == 1 for p, v in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, trim_threshold),
                                              (M_TOP_PAD, top_pad)))
    if not ok:
        log.warning("mallopt refused a setting; glibc's allocator defaults stay partly in effect")
    _applied = ok
    return ok


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's `malloc_trim(0)`, about 35 ms per
    500 MB released); False where the C library has no such call. See the module doc."""
    trim = libc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def libc_function(name: str):
    """`name` from the C library, or None where it has no such function (or cannot be loaded)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


# Below this a tensor is allocated as usual: a mapping per small tensor is not worth its syscall.
ON_DEMAND_MIN_BYTES = 1 << 20


def zeros_on_demand(shape: tuple[int, ...], dtype, device=None):
    """torch.zeros(shape) whose memory the process holds only as it is written: on CPU, a private
    anonymous mapping, whose pages the kernel zero-fills at their first write (reads of a page never
    written map the shared zero page and hold nothing). For caches sized for the worst case (the KV
    cache's every slot at its full context, the EAGLE-3 feature rows): the worker's RSS follows the
    tokens actually cached, up to the same total as torch.zeros at full occupancy. Pages once
    written stay held until the tensor is freed. Elsewhere (CUDA, small tensors): torch.zeros."""
    import mmap

    import torch

    device = torch.device(device or "cpu")
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < ON_DEMAND_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # torch.frombuffer keeps `region` alive as long as the tensor (or a view of it) is
    return torch.frombuffer(region, dtype=dtype).view(shape)

"""The engine's CPU kernels, built once per machine: cpu_ops.cpp (the small per-token ops: norms,
silu*up, RoPE with the cache writes, decode attention), gemm.cpp (row-invariant bf16-weight GEMMs
and int8-weight GEMMs for the projections and the lm_head on AVX512_BF16 or AVX2 + FMA, on AMX
tiles where the CPU has AMX-BF16: gemm_amx.h), layer.cpp (a decode layer in one call) and argmax.cpp
(greedy decoding's argmax over the vocabulary).

`ops()` returns the compiled module, or None where it cannot be had; callers then run the same
math with torch ops. Built at first use with the system C++ compiler through torch's extension
loader (~45-60 s on 2 cores, `-O3 -march=native`) into `$TIDE_CACHE_DIR/kernels/<key>`, where the
key hashes the sources, torch's version and install path, and this CPU's model and flags, so a cache
shared between machines never hands one CPU another's build. Later processes load the built module
in well under a second. `make setup` builds it, so neither a service's start nor a test pays the compile.

`TIDE_AMX=0` keeps the GEMMs on AVX-512 tiles where AMX exists (other bits; `has_amx`, `amx_enabled()`).
`TIDE_CPU_KERNELS=0` turns them off (the torch-op path everywhere); `TIDE_KERNEL_POOL=0` keeps them
but runs them on OpenMP's threads instead of their own pool (pool.h, `own_threads`). No compiler, or a failed build:
one warning in the log naming the compiler's output (`build-error.log`, which also stops later
processes from trying again), and the torch-op path. The decode-attention kernel needs AVX-512
or AVX2 + FMA; without either attention alone takes the torch path (`has_decode_attention`); the
bf16 GEMM needs AVX512_BF16 or AVX2 + FMA, without either the projections take oneDNN's or torch's
(`has_bf16_gemm`); the int8 GEMM needs the same (`has_int8_gemm`), else tide.quant takes torch's.
Each AVX2 kernel computes what its AVX-512 twin computes, in other lanes: other bits, and a machine
runs one of the two.

The kernels give each row the same bits whatever the number of rows (see cpu_ops.cpp), as the
torch ops they replace do, so batched verification still equals plain decoding. They are not
bit-equal to the torch ops: an engine uses one path for every forward, never a mix.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(n) for n in ("cpu_ops.cpp", "gemm.cpp", "layer.cpp", "argmax.cpp")]
HEADERS = [Path(__file__).with_name(n) for n in ("pool.h", "gemm_amx.h")]  # included by the sources
# No -ffast-math (reductions keep the order written) and no FMA contraction (a vectorised body
# and its scalar tail would otherwise round the same expression differently). -fopenmp: without it
# ATen's at::parallel_for compiles to a plain loop (one thread); the module then uses the libgomp
# torch has already loaded (same soname), so its threads are torch's.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
ENV = "TIDE_CPU_KERNELS"
POOL_ENV = "TIDE_KERNEL_POOL"  # 0: the kernels' threads are OpenMP's (a static split), not pool.h's

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops": the module or None once tried


_off = threading.local()  # set by `disabled()`, per thread


def pool_wanted() -> bool:
    """Whether the kernels run on their own pool (pool.h): yes unless TIDE_KERNEL_POOL=0."""
    return os.environ.get(POOL_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@contextlib.contextmanager
def disabled():
    """The torch-op path on this thread for the duration (benchmarks compare the two side by side
    in one process; an engine must not switch paths between forwards that have to agree)."""
    before = getattr(_off, "on", False)
    _off.on = True
    try:
        yield
    finally:
        _off.on = before


def _cpu_fingerprint() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    keep = [line for line in info.splitlines() if line.startswith(("vendor_id", "cpu family", "model\t", "flags"))]
    return "\n".join(sorted(set(keep)))


def build_dir() -> Path:
    # torch's install path too: the build compiles against its headers by path, so two virtual
    # environments sharing one cache would otherwise rebuild for each other
    parts = [*(s.read_bytes() for s in SOURCES + HEADERS), torch.__version__.encode(), torch.__file__.encode(),
             " ".join(FLAGS).encode(), _cpu_fingerprint().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    root = Path(os.environ.get("TIDE_CACHE_DIR", Path.home() / ".cache" / "tide"))
    return root / "kernels" / key


def ops():
    """The compiled kernels, or None (disabled, or they could not be built here: logged once)."""
    if getattr(_off, "on", False):
        return None
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _load() if enabled() else None
    return _state["ops"]


def _load():
    from torch.utils import cpp_extension

    path = build_dir()
    failed = path / "build-error.log"
    if failed.exists():  # this source already failed to build here: say so, do not pay the compile again
        log.warning("fused CPU kernels unavailable (an earlier build failed: %s; delete it to build again); "
                    "using torch ops", failed)
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
        # The loader looks for ninja on PATH; the venv's copy sits beside this interpreter.
        venv_bin = str(Path(sys.executable).parent)
        if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
        # Built from a copy inside the keyed directory: the loader rebuilds whenever the source's
        # path changes, and two checkouts of one version would otherwise rebuild for each other.
        sources = []
        for original in SOURCES + HEADERS:
            source = path / original.name
            if not source.exists() or source.read_bytes() != original.read_bytes():
                source.write_bytes(original.read_bytes())
            if original in SOURCES:
                sources.append(str(source))
        module = cpp_extension.load(name="tide_cpu_ops", sources=sources, extra_cflags=FLAGS,
                                    extra_ldflags=["-fopenmp"], build_directory=str(path), verbose=False)
        module.set_pool(pool_wanted())
        return module
    except Exception as e:  # noqa: BLE001 - any build failure means: run the torch ops instead
        with contextlib.suppress(OSError):
            failed.write_text(f"{type(e).__name__}: {e}\n")
        log.warning("fused CPU kernels unavailable (%s: %s); using torch ops. Compiler output: %s",
                    type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "", failed)
        return None


def path_name() -> str:
    """Which CPU path forwards on this thread take: the kernels' build key (with "-amx" where the
    GEMMs take AMX tiles), or "torch-ops". Latency profiles are keyed by it (the step costs differ by
    ~20 % at batch 1, and a verification of 16 rows by 2.4x with AMX or without)."""
    module = ops()
    if module is None:
        return "torch-ops"
    return build_dir().name + ("-amx" if module.amx_enabled() else "")


def use_for(*tensors: torch.Tensor):
    """The kernels when they apply to `tensors`: CPU tensors, no autograd graph to build (the
    kernels have no backward: a draft being trained takes the torch ops). Else None."""
    if tensors[0].device.type != "cpu" or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return None
    return ops()


@contextlib.contextmanager
def own_threads():
    """Run the block's kernels on tide_pool (pool.h) with this thread's torch thread count, and its
    torch ops on this thread alone. For an engine's decode steps: the kernels' pool does not wait
    for a thread the OS has lent to another process, OpenMP's static split does; and every torch op
    that went parallel (a step's logits conversion and argmax did) left OpenMP's helper spinning
    for milliseconds beside the pool's. Measured (docs/results/engine-step 2b): through the gateway
    2-4 % more tokens at one stream and a lower p99 inter-token latency; the engine alone within
    ~1 % of OpenMP, quiet or beside a busy process. A no-op without the kernels, on one thread, or
    with the pool off."""
    module = ops()
    threads = torch.get_num_threads()
    if module is None or threads <= 1 or not module.pool_enabled():
        yield
        return
    module.set_pool_threads(threads)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        module.set_pool_threads(0)


def main() -> int:
    """`python -m tide.kernels`: build (or load) the kernels and say which path the engine takes."""
    import time

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    t0 = time.perf_counter()
    module = ops()
    if module is None:
        print("fused CPU kernels: off" + ("" if enabled() else f" ({ENV}=0)") + "; the engine uses torch ops")
    else:
        print(f"fused CPU kernels: ready in {time.perf_counter() - t0:.1f} s ({build_dir()})")
    return 0

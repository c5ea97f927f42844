"""What memory a process holds (Linux /proc) and what a model's tensors take.

- `rss_bytes(pid)`: resident set size, the number `ps` and `top` show (pages in RAM, shared
  library pages included).
- `tree_rss_bytes(pid)`: the same for a process and all its descendants.
- `listening_pids(port)`: the local processes with a TCP socket listening on `port` (for a bench
  that knows a server only by its URL); `listening_socket_inodes(port)` those sockets.
- `tensor_bytes(*roots)`: the bytes of the distinct tensor storages reachable from `roots`
  (attributes, lists, dicts): what a model's weights or a cache hold, shared storage counted once.
- `resident_tensor_bytes(tensors)`: how much of those CPU tensors' memory is in RAM now (a cache
  allocated with tide.allocator.zeros_on_demand holds only the pages written).

Elsewhere than Linux the /proc readers answer None or nothing.
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterable

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(pid: int | str = "self") -> int | None:
    """Resident bytes of process `pid` ("self": this one); None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE_BYTES  # field 2: resident pages
    except (OSError, ValueError, IndexError):
        return None


def resident_tensor_bytes(tensors: Iterable) -> int | None:
    """Bytes of the CPU tensors' pages that are in RAM (Linux `mincore`; a page shared by two
    tensors counts for each); None where it cannot be asked. A never-written page of an anonymous
    mapping that was read counts too (it maps the kernel's shared zero page, which RSS does not
    count): an upper bound of what the tensors hold."""
    import ctypes

    from tide.allocator import libc_function

    mincore = libc_function("mincore")
    if mincore is None:
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    total = 0
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        start = t.data_ptr() // PAGE_BYTES * PAGE_BYTES
        length = t.data_ptr() + t.numel() * t.element_size() - start
        pages = -(-length // PAGE_BYTES)
        vec = ctypes.create_string_buffer(pages)
        if mincore(start, length, vec) != 0:
            return None
        total += (pages - vec.raw[:pages].count(0)) * PAGE_BYTES  # a byte per page, bit 0: resident
    return total


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process now."""
    out: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # the command name (field 2) may hold spaces and parentheses: split after its last ")"
                out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, parents before children."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(sorted(children.get(p, ())))
    return out


def tree_rss_bytes(pid: int) -> dict[int, int]:
    """Resident bytes of `pid` and each of its descendants that is still there."""
    sizes = {p: rss_bytes(p) for p in descendants(pid)}
    return {p: b for p, b in sizes.items() if b is not None}


def listening_socket_inodes(port: int) -> set[str]:
    """The sockets listening on TCP `port` on this machine, as a process's fd links name them
    ("socket:[INODE]"); empty where /proc/net is missing."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)  # the header
                for line in f:
                    cols = line.split()
                    # local address "HEX_IP:HEX_PORT", state 0A = LISTEN, inode in column 10
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f"socket:[{cols[9]}]")
        except (OSError, StopIteration, ValueError, IndexError):
            continue
    return inodes


def listening_pids(port: int) -> list[int]:
    """The processes holding a socket that listens on TCP `port` on this machine (those this user
    may inspect), lowest pid first."""
    inodes = listening_socket_inodes(port)
    found = []
    for entry in os.listdir("/proc") if inodes else ():
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") in inodes:
                    found.append(int(entry))
                    break
            except OSError:
                continue
    return sorted(found)


def tensor_bytes(*roots: object, seen: set[int] | None = None) -> int:
    """Bytes of the distinct tensor storages reachable from `roots` through attributes (objects'
    `__dict__` and `__slots__`), lists, tuples, sets and dict values. Storages already in `seen`
    (data pointers, updated) are not counted again: pass one set to several calls to count what
    the second root holds beyond the first (a draft beside its target). Objects whose class says
    `holds_tensors = False` are not walked: the speculation memory's indexes are millions of ints
    (a 30-minute run's 490k tokens made a walk of seconds, every status call:
    docs/results/speculation-memory)."""
    import torch  # here: the /proc readers serve processes that never load torch (the gateway)

    seen = set() if seen is None else seen
    visited: set[int] = set()
    total = 0
    todo: list[object] = list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in visited or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
            continue
        visited.add(id(obj))
        if getattr(type(obj), "holds_tensors", True) is False:
            continue
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            except (NotImplementedError, RuntimeError):  # opaque (oneDNN's pre-packed weights): no storage
                key, size = id(obj), obj.numel() * obj.element_size()
            if key and key not in seen:
                seen.add(key)
                total += size
            continue
        if isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        else:
            todo.extend(_attributes(obj))
    return total


_OPAQUE = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           types.BuiltinMethodType)


def _attributes(obj: object) -> Iterable[object]:
    """An object's attribute values (none for modules and functions: what they reach is not what
    the object holds)."""
    if isinstance(obj, _OPAQUE):
        return ()
    values = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    for slot in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, slot):
            values.append(getattr(obj, slot))
    return values


def available_bytes(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """(bytes this process may still take, where that came from): the kernel's MemAvailable (free
    plus reclaimable page cache), and less where this process's cgroup (v2) has a memory limit: its
    `memory.max` minus its `memory.current`. None where neither can be read."""
    found: list[tuple[int, str]] = []
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable"))  # the value is in kB
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(os.path.join(cgroup, "memory.max")) as f:
            limit = f.read().strip()
        if limit != "max":
            with open(os.path.join(cgroup, "memory.current")) as f:
                used = int(f.read().strip())
            found.append((max(0, int(limit) - used), "cgroup memory.max - memory.current"))
    except (OSError, ValueError):
        pass
    return min(found) if found else None

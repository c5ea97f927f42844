"""A server's resident memory, all of its processes, as `tide bench serve` reports it after its runs.

Two ways, the first that answers:
  status    a TIDE stack under `tide up`: its gateway's GET /v1/status gives each process's
            resident set (`services.*.rss_bytes`) and each worker's `memory` (its RSS beside the
            bytes of the target's weights, KV cache and draft);
  listener  any other server on this machine (llama-server, vLLM, ...): the processes listening
            on the URL's port, and every process below them.
A server on another machine, or one whose processes this user may not read, gives None.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

import httpx

from tide.memory import listening_pids, tree_rss_bytes

MB = 1 << 20


def _status_url(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1") + "/v1/status"


def _is_local(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def from_status(base_url: str, timeout_s: float = 10.0) -> dict | None:
    try:
        doc = httpx.get(_status_url(base_url), timeout=timeout_s).json()
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(doc, dict) or not doc.get("rss_bytes"):
        return None
    processes = {name: e["rss_bytes"] for name, e in (doc.get("services") or {}).items() if e.get("rss_bytes")}
    out: dict = {"source": "status", "rss_bytes": doc["rss_bytes"], "processes": processes}
    workers = [w for w in doc.get("workers") or [] if w.get("memory")]
    if workers:
        m = workers[0]["memory"]
        held = m["weights_bytes"] + m["kv_cache_bytes"]
        out["worker"] = {**m, "rss_vs_weights_and_kv": round(m["rss_bytes"] / held, 3) if held and m["rss_bytes"]
                         else None}
    return out


def from_listener(base_url: str) -> dict | None:
    parts = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
    if not parts.hostname or not _is_local(parts.hostname):
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    processes: dict[str, int] = {}
    for pid in listening_pids(port):
        for p, size in tree_rss_bytes(pid).items():
            processes[f"{_comm(p)}[{p}]"] = size
    return {"source": "listener", "rss_bytes": sum(processes.values()), "processes": processes} if processes else None


def server_memory(base_url: str) -> dict | None:
    """The server's resident memory now (see the module docstring), or None where it cannot be read."""
    return from_status(base_url) or from_listener(base_url)


def print_memory(memory: dict[str, dict | None]) -> None:
    print("\nresident memory after the runs, MB (all of a server's processes; worker = the inference worker)")
    print(f"{'server':>16} {'total':>8} {'processes':>9} {'worker':>8} {'weights':>8} {'KV cache':>9} {'draft':>7} "
          f"{'worker/(weights+KV)':>20}")
    for label, m in memory.items():
        if m is None:
            print(f"{label:>16} {'-':>8}  (not on this machine, or not readable)")
            continue
        w = m.get("worker") or {}

        def mb(key: str, d: dict = w) -> str:
            return f"{d[key] / MB:.0f}" if d.get(key) else "-"

        ratio = w.get("rss_vs_weights_and_kv")
        print(f"{label:>16} {m['rss_bytes'] / MB:8.0f} {len(m['processes']):>9} {mb('rss_bytes'):>8} "
              f"{mb('weights_bytes'):>8} {mb('kv_cache_bytes'):>9} {mb('draft_bytes'):>7} "
              f"{'-' if ratio is None else f'{ratio:.2f}x':>20}")

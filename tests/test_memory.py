"""tide.memory: resident memory from /proc, and the bytes a model's tensors hold."""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from tide.memory import descendants, listening_pids, rss_bytes, tensor_bytes, tree_rss_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux /proc")
MB = 2**20


class _Layer:
    def __init__(self, w: torch.Tensor) -> None:
        self.weight, self.view, self.bias = w, w[:2], None


class _Model:
    def __init__(self) -> None:
        shared = torch.zeros(1024, 256)  # 1 MB, reached three times
        self.layers = [_Layer(shared), _Layer(torch.zeros(512, 256))]
        self.tied = {"head": shared}
        self.table = (torch.zeros(256, dtype=torch.bfloat16),)
        self.act = torch.nn.functional.silu  # a function: not walked


def test_tensor_bytes_counts_each_storage_once():
    m = _Model()
    assert tensor_bytes(m) == 1024 * 256 * 4 + 512 * 256 * 4 + 256 * 2
    seen: set[int] = set()
    assert tensor_bytes(m.layers[0], seen=seen) == 1024 * 256 * 4
    assert tensor_bytes(m, seen=seen) == 512 * 256 * 4 + 256 * 2  # beyond what the first call counted


def test_tensor_bytes_counts_oneDNN_packed_weights():
    w = torch.randn(64, 32)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 1) if torch.backends.mkldnn.is_available() else None
    if packed is None:
        pytest.skip("no oneDNN in this torch")
    assert tensor_bytes([packed]) == packed.numel() * packed.element_size() > 0


def test_rss_grows_with_touched_memory():
    # A fresh anonymous mapping, not a tensor: after a long test session the allocator may hand a
    # tensor pages that are already resident (freed, not returned to the OS), and RSS would not move.
    before = rss_bytes()
    block = mmap.mmap(-1, 64 * MB)
    for offset in range(0, 64 * MB, mmap.PAGESIZE):  # write one byte per page so every page is resident
        block[offset] = 1
    after = rss_bytes()
    block.close()
    assert after - before > 48 * MB
    assert rss_bytes(99_999_999) is None  # no such process


def test_listening_pids_and_a_process_tree():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert os.getpid() in listening_pids(s.getsockname()[1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while child.pid not in descendants(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = tree_rss_bytes(os.getpid())
        assert child.pid in tree and tree[child.pid] > 1 * MB
        assert tree[os.getpid()] == pytest.approx(rss_bytes(), rel=0.2)
    finally:
        child.kill()
        child.wait()


def test_the_speculation_memory_is_not_walked():
    """Its indexes are millions of ints in a long run: walking them every status call cost the worker
    its CPU (docs/results/speculation-memory). A class saying `holds_tensors = False` is skipped."""
    from tide.engine.drafters.memory import SpeculationMemory

    memory = SpeculationMemory(1 << 20)
    memory.add("", list(range(300)), list(range(300, 400)))
    memory.planted = torch.zeros(1000)  # were it walked, these 4000 bytes would count

    class Drafter:
        def __init__(self):
            self.memory, self.weights = memory, torch.zeros(10)

    assert tensor_bytes(Drafter()) == 40

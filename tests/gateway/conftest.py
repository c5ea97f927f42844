"""Gateway test fixtures: real inference workers (`python -m services.inference` processes serving a
real engine over gRPC) and real gateways (uvicorn on free loopback ports).

- `chat_target` (session): a tiny random Llama with the reference model's vocabulary, tokenizer and
  chat template (SmolLM2's), so prompts go through the real template and tokenizer while each
  engine step takes milliseconds. Greedy output is deterministic, so tests can compare runs.
- `worker` (session): the inference service serving `chat_target`; `spawn_worker()` starts more
  (e.g. one to kill), each a `harness.WorkerProcess` with `.address` and `.kill()`.
- `short_worker` (session): another one whose context is only SHORT_CONTEXT tokens, for the gateway's
  learning of the workers' real limit and for fuzzing (no generation can run long on it).
- `gateway` (session): the gateway app routed to `worker`; `harness.serve_gateway(...)` starts
  other configurations (API keys, no worker, two workers).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.engine import save_tiny_target

from gateway.harness import MAX_MODEL_LEN, SHORT_CONTEXT, WorkerProcess, serve_gateway, start_worker
from services.gateway.tokenizer import TargetTokenizer
from tide.target import resolve_target


@pytest.fixture(scope="session")
def chat_target(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat-target")
    save_tiny_target(path, vocab=49152, layers=2, max_position_embeddings=MAX_MODEL_LEN)
    ref = resolve_target("ref").path
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ref / name, path / name)
    return path


@pytest.fixture(scope="session")
def spawn_worker(chat_target, tmp_path_factory) -> Iterator:
    started: list[WorkerProcess] = []
    logs = tmp_path_factory.mktemp("worker-logs")

    def spawn(port: int = 0, **options) -> WorkerProcess:
        started.append(start_worker(chat_target, logs, port, **options))
        return started[-1]

    yield spawn
    for w in started:
        w.kill()


@pytest.fixture(scope="session")
def worker(spawn_worker) -> WorkerProcess:
    return spawn_worker()


@pytest.fixture(scope="session")
def short_worker(spawn_worker) -> WorkerProcess:
    return spawn_worker(max_seq_len=SHORT_CONTEXT)


@pytest.fixture(scope="session")
def tokenizer(chat_target) -> TargetTokenizer:
    return TargetTokenizer.load(str(chat_target))


@pytest.fixture(scope="session")
def gateway(tokenizer, worker) -> Iterator[str]:
    with serve_gateway(tokenizer, (worker.address,)) as url:
        yield url


@pytest.fixture
def client(gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=60) as c:
        yield c

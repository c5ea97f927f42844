"""Concurrent pin / unpin / promote / rollback from many clients leave one coherent, serial history."""

from __future__ import annotations

import random
import threading

import grpc
from registry.harness import TARGET

from services.registry import model as m
from services.registry.server import pointer_to_pb
from tide.registry_client import upload_checkpoint

THREADS, OPS = 8, 12  # 96 attempted changes: under HISTORY_LIMIT, so the whole history is kept


def test_concurrent_pointer_changes_are_serializable(registry, drafts):
    with registry.client() as c:
        versions = [
            c.register(TARGET, upload_checkpoint(registry.s3, registry.bucket, drafts(i), TARGET)).version
            for i in range(4)
        ]
        c.promote(versions[0], reason="seed")
    applied: list[tuple[str, int]] = []  # (reason, generation) of every call that changed the pointer
    refused: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        rng = random.Random(i)
        with registry.client(actor=f"worker-{i}") as c:
            for j in range(OPS):
                reason, op = f"w{i}-{j}", rng.choice(["promote", "promote", "pin", "unpin", "rollback"])
                try:
                    if op == "promote":
                        state = c.promote(rng.choice(versions), reason=reason)
                    elif op == "pin":
                        state = c.pin(rng.choice(versions), reason=reason)
                    elif op == "unpin":
                        state = c.unpin(TARGET, reason)
                    else:
                        state = c.rollback(TARGET, reason)
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                        errors.append(e)
                    with lock:
                        refused.append(reason)
                    continue
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)
                    continue
                if state.history and state.history[0].reason == reason:  # else: a no-op, nothing written
                    with lock:
                        applied.append((reason, state.generation))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]

    final = registry.store.pointer(TARGET)
    events = list(reversed(final.history))  # oldest first
    # Generation grows by exactly one per change, and every change is in the history exactly once.
    assert [e.generation for e in events] == list(range(1, final.generation + 1))
    assert final.generation == 1 + len(applied) and len(applied) > THREADS  # contention did happen
    assert sorted(applied) == sorted((e.reason, e.generation) for e in events[1:])
    assert not set(refused) & {e.reason for e in events}  # refused calls left no trace
    # Each call saw the state its own change produced; replaying the log serially gives the final state.
    assert m.replay(TARGET, events) == final
    assert final.current not in final.previous and len(set(final.previous)) == len(final.previous)
    with registry.client() as c:
        assert c.pointer(TARGET) == pointer_to_pb(final)

"""Helpers shared by the service tests (import as `support.services`)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], timeout_s: float = 10.0, what: str = "condition", every_s=0.05):
    """`predicate()`'s first truthy value, polled every `every_s`; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)

"""Change notification for pointer states: what `WatchTarget` streams wait on.

Polling alone is enough and always on: while a target has watchers, one background thread reads
its pointer object every `poll_s` seconds and wakes the watchers when the generation grew, so a
change made through any registry replica (or written by any tool) reaches every stream within
about one poll interval. Changes made through this process are published at once (the store's
listener hook), without waiting for the next poll. One reader per target, however many streams.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from prometheus_client import Counter

from services.registry.model import PointerState
from services.registry.store import RegistryStore

log = logging.getLogger("tide.registry.watch")

POLL_ERRORS = Counter("tide_registry_watch_poll_errors", "Failed pointer polls (object storage unreachable?)")


class WatchHub:
    """Latest known pointer state per watched target; `wait` blocks until it changes."""

    def __init__(self, store: RegistryStore, poll_s: float = 1.0):
        self.store, self.poll_s = store, poll_s
        self._cond = threading.Condition()
        self._states: dict[str, PointerState] = {}
        self._watchers: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        store.add_listener(self.publish)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def start(self) -> WatchHub:
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll_loop, name="registry-watch-poll", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling and wake every waiter (their streams end; clients reconnect elsewhere)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def publish(self, state: PointerState) -> None:
        """Record `state` if it is newer than what we know, and wake the target's waiters."""
        with self._cond:
            known = self._states.get(state.target_model)
            if known is None or state.generation > known.generation:
                self._states[state.target_model] = state
                self._cond.notify_all()

    @contextlib.contextmanager
    def subscribe(self, target: str) -> Iterator[PointerState]:
        """Count a watcher of `target` while inside; yields its state, freshly read from storage."""
        with self._cond:
            self._watchers[target] = self._watchers.get(target, 0) + 1
        try:
            self.publish(self.store.pointer(target))
            with self._cond:
                state = self._states[target]
            yield state
        finally:
            with self._cond:
                self._watchers[target] -= 1
                if not self._watchers[target]:
                    del self._watchers[target]
                    self._states.pop(target, None)

    def wait(self, target: str, after_generation: int, timeout_s: float) -> PointerState | None:
        """The target's state once its generation exceeds `after_generation`; None on timeout or stop."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._stop.is_set() or self._states[target].generation > after_generation, timeout_s
            )
            state = self._states[target]
        return state if state.generation > after_generation else None

    def watcher_count(self) -> int:
        with self._cond:
            return sum(self._watchers.values())

    def _poll_loop(self) -> None:
        failing = False
        while not self._stop.wait(self.poll_s):
            with self._cond:
                targets = list(self._watchers)
            for target in targets:
                try:
                    self.publish(self.store.pointer(target))
                    if failing:
                        log.info("pointer polling recovered")
                    failing = False
                except Exception as e:  # keep streams alive on the last known state; retry next tick
                    POLL_ERRORS.inc()
                    if not failing:
                        log.warning("cannot poll pointer of %s: %s", target, e)
                    failing = True

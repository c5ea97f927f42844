"""Restart what dies, with exponential backoff, and say what state each part of the stack is in.

`tide up` hands every process it started to one `Supervisor`: Redis, S3 and each service. The
supervisor's `tick()` (the launcher calls it about twice a second) notices a process that exited,
restarts it after a delay that doubles with each consecutive failure (1 s, 2 s, 4 s, ... capped at
30 s) and returns to 1 s once the restarted process has stayed up for a minute. Everything else
keeps running meanwhile: a trainer, controller or registry crash never touches serving; a worker
crash fails only its in-flight requests, and the gateway routes to it again once it answers its
health check on the same address.

States: `starting` (spawned, not yet healthy), `ready`, `restarting` (exited; a restart is due at
`due`), `failed` (a restart attempt itself failed; it is retried at the next delay). `snapshot()`
is what stack.json and the status endpoint show.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0
STABLE_AFTER_S = 60.0  # up this long: the next failure starts again from FIRST_DELAY_S


@dataclass
class Unit:
    """One supervised process, seen through four callables (so servers and services look alike):
    `alive()` whether it runs, `exit_status()` its exit code once dead, `restart()` start it again
    (may block until healthy, as the Redis and S3 servers do), `healthy()` whether it serves."""

    name: str
    alive: Callable[[], bool]
    exit_status: Callable[[], int | None]
    restart: Callable[[], None]
    healthy: Callable[[], bool]
    pid: Callable[[], int | None]
    state: str = "ready"
    restarts: int = 0
    last_exit: int | None = None
    delay_s: float = FIRST_DELAY_S
    due: float | None = None  # monotonic time of the pending restart
    up_since: float = field(default_factory=time.monotonic)


class Supervisor:
    def __init__(self, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.units: list[Unit] = []
        self.say, self.clock = say, clock

    def add(self, unit: Unit) -> Unit:
        unit.up_since = self.clock()
        self.units.append(unit)
        return unit

    def tick(self) -> bool:
        """One pass over every unit; True when any state changed (the caller rewrites stack.json)."""
        changed = False
        for u in self.units:
            changed |= self._tick(u, self.clock())
        return changed

    def _tick(self, u: Unit, now: float) -> bool:
        if u.state in ("ready", "starting") and not u.alive():
            u.last_exit, u.state, u.due = u.exit_status(), "restarting", now + u.delay_s
            self.say(f"{u.name} exited with status {u.last_exit}; restarting in {u.delay_s:.0f} s "
                     f"(restart {u.restarts + 1})")
            u.delay_s = min(2 * u.delay_s, MAX_DELAY_S)
            return True
        if u.state in ("restarting", "failed") and now >= (u.due or now):
            u.restarts += 1
            try:
                u.restart()
            except Exception as e:  # e.g. its port still taken; try again after the next delay
                u.state, u.due = "failed", now + u.delay_s
                self.say(f"{u.name} restart {u.restarts} failed ({e}); next try in {u.delay_s:.0f} s")
                u.delay_s = min(2 * u.delay_s, MAX_DELAY_S)
                return True
            u.state, u.due, u.up_since = "starting", None, now
            self.say(f"{u.name} restarted (pid {u.pid()}, restart {u.restarts})")
            return True
        if u.state == "starting" and u.healthy():
            u.state, u.up_since = "ready", now
            self.say(f"{u.name} ready again after restart {u.restarts}")
            return True
        if u.state == "ready" and u.delay_s > FIRST_DELAY_S and now - u.up_since >= STABLE_AFTER_S:
            u.delay_s = FIRST_DELAY_S
        return False

    @property
    def degraded(self) -> list[str]:
        """The units not ready now."""
        return [u.name for u in self.units if u.state != "ready"]

    def snapshot(self) -> dict[str, dict]:
        return {u.name: {"state": u.state, "restarts": u.restarts, "last_exit": u.last_exit, "pid": u.pid()}
                for u in self.units}

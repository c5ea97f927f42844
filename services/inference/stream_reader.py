"""Following a Redis stream from a worker thread: XREAD, blocking, entry by entry, through outages.

The fleet's speculation memory (fleet_memory.py) and the forget notices (memory_forget.py) read
their streams this way: where to start is asked once (`start`, which may raise RedisError and is
asked again), each entry goes to `handle` in order, and a Redis error is logged, counted
(`on_error`) and waited out with a doubling back-off; serving never waits on it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from tide import streams

log = logging.getLogger(__name__)

BACKOFF_S = (0.5, 5.0)  # after a Redis error: the first wait, doubled up to the second


def follow(client: redis.Redis, stream: str, *, start: Callable[[], str], handle: Callable[[str, dict], object],
           stop: threading.Event, count: int, block_ms: int, what: str, on_error: Callable[[], None]) -> None:
    """Read `stream` from the id `start()` returns until `stop` is set (see the module doc)."""
    last: str | None = None
    wait = BACKOFF_S[0]
    while not stop.is_set():
        try:
            if last is None:
                last = start()
            got = client.xread({stream: last}, count=count, block=block_ms)
            wait = BACKOFF_S[0]
        except redis.RedisError as err:
            on_error()
            log.warning("%s: cannot read %s (%s); retrying in %.1f s", what, stream, err, wait)
            stop.wait(wait)
            wait = min(2 * wait, BACKOFF_S[1])
            continue
        for _, entries in got or []:
            for entry_id, fields in entries:
                last = streams._text(entry_id)
                handle(last, fields)

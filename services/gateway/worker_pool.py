"""The gateway's view of its inference workers: health and load from periodic GetStatus polls.

Routing is least-loaded: a worker's score is its queue depth from the last poll plus the requests
this gateway sent it since, over its batch capacity, so a burst between two polls spreads out
instead of piling onto the worker that looked idle. Ties go to the worker with fewer open streams
from this gateway, then round-robin.

Health: a worker is healthy after a successful poll. A connection failure (UNAVAILABLE) marks it
down at once (so does a failed Generate that never started); other poll failures (a busy CPU
worker answering late) only after `failure_threshold` in a row. A worker that is down and whose
channel sits in TRANSIENT_FAILURE gets a fresh channel, so a restarted worker is found at the next
poll instead of after gRPC's reconnect backoff (up to two minutes).

Context: each worker reports its limit (WorkerStatus.max_model_len, prompt + completion tokens);
`max_model_len()` is the smallest of the healthy workers' (of any worker heard from when none is
healthy; None before any has answered or when none reports one), which the gateway serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass

import grpc

from tide.grpcutil import aio_channel
from tide.proto.tide.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)


WAIT_POLL_S = 0.25  # how often a request waiting for a healthy worker polls the pool

@dataclass(frozen=True)
class WorkerInfo:
    """A snapshot of one worker, for /ready, metrics and logs."""

    address: str
    healthy: bool
    model_id: str
    load: float
    running: int
    waiting: int
    max_batch: int
    inflight: int
    draft_version: str
    drafter: str
    last_error: str
    max_model_len: int  # the worker's context (0 = not reported yet)


class Worker:
    """One inference worker: its channel, stub, last status and this gateway's open streams."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel: grpc.aio.Channel | None = None
        self.stub: inference_pb2_grpc.InferenceServiceStub | None = None
        self.status: inference_pb2.WorkerStatus | None = None
        self.healthy = False
        self.failures = 0
        self.assigned_since_poll = 0
        self.inflight = 0
        self.last_error = ""
        self.last_ok_s = 0.0

    def connect(self) -> grpc.aio.Channel | None:
        """(Re)open the channel; returns the old one for the caller to close."""
        old = self.channel
        self.channel = aio_channel(self.address)
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)
        return old

    def score(self) -> float:
        st = self.status
        queued = (st.running_requests + st.waiting_requests) if st else 0
        capacity = st.max_batch_size if st and st.max_batch_size else 1
        return (queued + self.assigned_since_poll) / capacity

    def info(self) -> WorkerInfo:
        st = self.status or inference_pb2.WorkerStatus()
        return WorkerInfo(
            self.address,
            self.healthy,
            st.model_id,
            self.score(),
            st.running_requests,
            st.waiting_requests,
            st.max_batch_size,
            self.inflight,
            st.draft_version,
            st.drafter,
            self.last_error,
            st.max_model_len,
        )


class WorkerPool:
    """Polls workers in the background and picks the least-loaded healthy one per request."""

    def __init__(
        self,
        addresses: tuple[str, ...],
        poll_interval_s: float = 1.0,
        status_timeout_s: float = 5.0,
        failure_threshold: int = 2,
        wait_for_worker_s: float = 0.0,
    ) -> None:
        self.workers = [Worker(a) for a in dict.fromkeys(addresses)]
        self.wait_for_worker_s = wait_for_worker_s
        self.poll_interval_s = poll_interval_s
        self.status_timeout_s = status_timeout_s
        self.failure_threshold = failure_threshold
        self._rr = itertools.count()
        self._task: asyncio.Task | None = None
        self._poll_lock: asyncio.Lock | None = None
        self._last_poll_s = 0.0
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Open channels (inside the running loop) and start polling; never waits for workers."""
        self._poll_lock = asyncio.Lock()
        for w in self.workers:
            w.connect()
        self._task = asyncio.create_task(self._poll_forever(), name="tide-gateway-worker-poll")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._background):
            task.cancel()
        for w in self.workers:
            if w.channel is not None:
                await w.channel.close(grace=None)

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:  # a poll must never kill the loop
                log.exception("worker poll failed")
            await asyncio.sleep(self.poll_interval_s)

    async def poll(self, max_age_s: float = 0.0) -> None:
        """Ask every worker for its status (concurrently), unless a poll finished within `max_age_s`
        (checked under the lock, so a crowd of callers causes one poll, not one each)."""
        assert self._poll_lock is not None, "start() first"
        async with self._poll_lock:
            if max_age_s and time.monotonic() - self._last_poll_s <= max_age_s:
                return
            await asyncio.gather(*(self._poll_one(w) for w in self.workers))
            self._last_poll_s = time.monotonic()

    async def refresh(self, max_age_s: float = 0.25) -> None:
        """Poll now unless a poll finished within `max_age_s` (used when no worker looks healthy)."""
        await self.poll(max_age_s)

    async def _poll_one(self, w: Worker) -> None:
        try:
            status = await w.stub.GetStatus(inference_pb2.GetWorkerStatusRequest(), timeout=self.status_timeout_s)
        except grpc.aio.AioRpcError as err:
            self._failed(w, err.code(), err.details() or err.code().name)
            return
        if not w.healthy:
            log.info("worker up", extra={"worker": w.address, "model_id": status.model_id})
        w.status, w.healthy, w.failures, w.assigned_since_poll = status, True, 0, 0
        w.last_error, w.last_ok_s = "", time.monotonic()

    def _failed(self, w: Worker, code: grpc.StatusCode, detail: str) -> None:
        w.failures += 1
        w.last_error = f"{code.name}: {detail}"[:300]
        if w.healthy and (code == grpc.StatusCode.UNAVAILABLE or w.failures >= self.failure_threshold):
            self.mark_down(w, w.last_error)
        if not w.healthy and w.channel is not None:
            state = w.channel.get_state(try_to_connect=False)
            if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                old = w.connect()
                if old is not None:
                    self._spawn(old.close(grace=1.0))

    def mark_down(self, w: Worker, reason: str) -> None:
        """Take a worker out of routing until its next successful poll."""
        if w.healthy:
            log.warning("worker down", extra={"worker": w.address, "reason": reason})
        w.healthy = False
        w.last_error = reason[:300]

    async def pick_or_wait(self, exclude: set[str] = frozenset()) -> Worker | None:
        """`pick()`; when no worker is healthy at all (one restarting after a crash, or still
        loading), poll every WAIT_POLL_S until one is, for at most `wait_for_worker_s`, so that new
        requests wait for it instead of failing. None when the wait ends without one, or when the
        healthy workers are all in `exclude` (waiting would not help)."""
        deadline = time.monotonic() + self.wait_for_worker_s
        await self.refresh()
        while (w := self.pick(exclude)) is None:
            if any(x.healthy for x in self.workers) or time.monotonic() >= deadline:
                return None
            await asyncio.sleep(WAIT_POLL_S)
            await self.refresh(max_age_s=WAIT_POLL_S)
        return w

    def pick(self, exclude: set[str] = frozenset()) -> Worker | None:
        """The least-loaded healthy worker not in `exclude`, or None."""
        candidates = [w for w in self.workers if w.healthy and w.address not in exclude]
        if not candidates:
            return None
        turn = next(self._rr)
        n = len(self.workers)
        best = min(candidates, key=lambda w: (w.score(), w.inflight, (self.workers.index(w) - turn) % n))
        best.assigned_since_poll += 1
        return best

    def ready(self) -> bool:
        return any(w.healthy for w in self.workers)

    def max_model_len(self) -> int | None:
        """The smallest context the healthy workers report (see the module docstring)."""
        heard = [w for w in self.workers if w.status is not None and w.status.max_model_len]
        limits = [w.status.max_model_len for w in heard if w.healthy] or [w.status.max_model_len for w in heard]
        return min(limits, default=None)

    def infos(self) -> list[WorkerInfo]:
        return [w.info() for w in self.workers]

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def spawn(self, coro) -> None:
        """Run a fire-and-forget coroutine (e.g. an upstream Cancel) that close() can stop."""
        self._spawn(coro)

"""The live status page: `GET /dashboard` (static HTML + JS + CSS, no CDN) and the history it charts.

While the app runs, a background task samples the status document (services.gateway.status) every
`SAMPLE_INTERVAL_S` seconds into a ring buffer of the last `HISTORY_S` seconds (720 samples at 5 s:
one hour). Each sample is small: the fleet's tokens/s, queue, acceptance and γ over the interval
(from the differences of the workers' running totals between two samples), and the chunk backlog.
`GET /v1/status/history[?since=<unix s>]` returns them oldest first. The page polls /v1/status and
the history every few seconds and draws inline SVG charts. Read-only; nothing here needs a key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from services.gateway.status import stack_status

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 5.0
HISTORY_S = 3600.0
STATIC = Path(__file__).resolve().parent / "static"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


@dataclass
class StatusHistory:
    """A ring buffer of status samples; `add(doc)` turns a status document into one."""

    interval_s: float = SAMPLE_INTERVAL_S
    window_s: float = HISTORY_S
    samples: deque = field(default_factory=deque)
    _last: dict | None = None  # the previous document's running totals, per worker

    def __post_init__(self) -> None:
        self.samples = deque(maxlen=max(1, int(self.window_s / self.interval_s)))

    def add(self, doc: dict) -> dict:
        totals = {}
        for w in doc.get("workers") or []:
            if w.get("available"):
                acc = w.get("acceptance") or []
                gam = w.get("gamma") or []
                totals[w.get("worker_id") or w["name"]] = (
                    sum(a["verify_rows"] for a in acc), sum(a["draft_tokens"] for a in acc),
                    sum(a["accepted_tokens"] for a in acc), sum(g["gamma_sum"] for g in gam),
                    sum(g["speculative_rows"] for g in gam))
        rows = drafted = accepted = gamma_sum = gamma_rows = 0
        for worker, now in totals.items():
            before = (self._last or {}).get(worker)
            if before is None or any(n < b for n, b in zip(now, before, strict=True)):  # new or restarted
                continue
            d = [n - b for n, b in zip(now, before, strict=True)]
            rows, drafted, accepted = rows + d[0], drafted + d[1], accepted + d[2]
            gamma_sum, gamma_rows = gamma_sum + d[3], gamma_rows + d[4]
        self._last = totals
        fleet, backlog = doc.get("fleet") or {}, doc.get("backlog") or {}
        sample = {
            "time_unix_s": round(doc.get("time_unix_s") or time.time(), 3),
            "status": doc.get("status"),
            "tokens_per_s": fleet.get("tokens_per_s"),
            "workers_tokens_per_s": {w["name"]: w.get("tokens_per_s") for w in doc.get("workers") or []
                                     if w.get("available")},
            "running": fleet.get("running"), "waiting": fleet.get("waiting"),
            "accept_length": round((accepted + rows) / rows, 4) if rows else None,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "mean_gamma": round(gamma_sum / gamma_rows, 3) if gamma_rows else None,
            "buffered_chunks": backlog.get("buffered_chunks"), "buffered_tokens": backlog.get("buffered_tokens"),
            "dead_letters": backlog.get("dead_letters"),
        }
        self.samples.append(sample)
        return sample

    def since(self, t: float | None = None) -> list[dict]:
        return [s for s in self.samples if t is None or s["time_unix_s"] > t]


async def sample_forever(app: FastAPI, history: StatusHistory) -> None:
    state = app.state.gateway
    while True:
        started = time.monotonic()
        try:
            history.add(await stack_status(state.status, state.engine))
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a failed sample is skipped, the next one is taken on time
            log.exception("status sample failed")
        await asyncio.sleep(max(0.0, history.interval_s - (time.monotonic() - started)))


@asynccontextmanager
async def lifespan(app: FastAPI):
    history = StatusHistory(SAMPLE_INTERVAL_S, HISTORY_S)
    app.state.status_history = history
    task = asyncio.create_task(sample_forever(app, history), name="status-history")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


router = APIRouter(lifespan=lifespan)  # app.include_router merges this lifespan into the app's


@router.get("/v1/status/history", include_in_schema=False)  # not part of the OpenAI API (test_fuzz)
async def status_history(request: Request, since: float | None = None) -> Response:
    """The sampled status of the last hour, oldest first (`since`: only samples after this unix time)."""
    history: StatusHistory = request.app.state.status_history
    return JSONResponse({"interval_s": history.interval_s, "window_s": history.window_s,
                         "samples": history.since(since)})


@router.get("/dashboard", include_in_schema=False)
async def dashboard() -> Response:
    return FileResponse(STATIC / "dashboard.html", media_type="text/html", headers={"Cache-Control": "no-cache"})


@router.get("/dashboard/{name}", include_in_schema=False)
async def dashboard_asset(name: str) -> Response:
    if name not in ASSETS:
        raise HTTPException(status_code=404)
    return FileResponse(STATIC / name, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})

"""Prometheus metrics of the gateway, and the ASGI middleware that records every request.

Each app gets its own registry (several apps in one test process never collide). Metric names:
- tide_gateway_requests_total{endpoint,status} and tide_gateway_request_duration_seconds{endpoint}
  (whole response, streams included), tide_gateway_inflight_requests;
- tide_gateway_errors_total{endpoint,status,type}: error responses *and* errors sent as SSE events
  after a stream started (status = what it would have been);
- tide_gateway_time_to_first_token_seconds{endpoint}, tide_gateway_{prompt,completion}_tokens_total,
  tide_gateway_speculation_{draft,accepted}_tokens_total;
- tide_gateway_workers_healthy, tide_gateway_worker_load{worker} (refreshed at scrape time).
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.gateway.errors import OpenAIError, internal_error

log = logging.getLogger("tide.gateway.access")
KNOWN_ENDPOINTS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
    "/v1/models", "/tokenize", "/detokenize", "/version", "/health", "/ready", "/metrics",
})
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def endpoint_label(path: str) -> str:
    if path in KNOWN_ENDPOINTS:
        return path
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}/input_items" if path.endswith("/input_items") else "/v1/responses/{id}"
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tide_gateway_requests_total", "HTTP requests", ["endpoint", "status"], registry=r)
        self.duration = Histogram(
            "tide_gateway_request_duration_seconds",
            "Time to the end of the response",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge("tide_gateway_inflight_requests", "Requests being served", registry=r)
        self.errors = Counter(
            "tide_gateway_errors_total",
            "Errors returned (responses and SSE error events)",
            ["endpoint", "status", "type"],
            registry=r,
        )
        self.ttft = Histogram(
            "tide_gateway_time_to_first_token_seconds",
            "Request arrival to first token",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("tide_gateway_prompt_tokens_total", "Prompt tokens", ["endpoint"], registry=r)
        self.completion_tokens = Counter(
            "tide_gateway_completion_tokens_total", "Completion tokens", ["endpoint"], registry=r
        )
        self.draft_tokens = Counter("tide_gateway_speculation_draft_tokens_total", "Draft tokens verified", registry=r)
        self.accepted_tokens = Counter(
            "tide_gateway_speculation_accepted_tokens_total", "Draft tokens accepted", registry=r
        )
        self.workers_healthy = Gauge("tide_gateway_workers_healthy", "Workers that answered the last poll", registry=r)
        self.worker_load = Gauge("tide_gateway_worker_load", "Routing score of each worker", ["worker"], registry=r)

    def error(self, endpoint: str, err: OpenAIError) -> None:
        self.errors.labels(endpoint, str(err.status), err.type).inc()

    def render(self, workers) -> bytes:
        """The exposition text, after refreshing the worker gauges from `workers` (WorkerInfo list)."""
        self.workers_healthy.set(sum(1 for w in workers if w.healthy))
        for w in workers:
            self.worker_load.labels(w.address).set(w.load)
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Pure ASGI (streams are timed to their last byte): counts, times and logs every HTTP request,
    gives it a request id (`x-request-id`, taken from the client when it sends one), and turns any
    exception that escaped the app into a logged traceback plus a bare OpenAI 500 body."""

    def __init__(self, app, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        endpoint = endpoint_label(scope.get("path", ""))
        headers = dict(scope.get("headers") or ())
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        status = {"code": 0}

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))],
                }
            await send(message)

        self.metrics.inflight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as err:  # the last line of defence: log it, answer a bare OpenAI 500
            log.error("unhandled error", exc_info=err, extra={"path": scope.get("path"), "request_id": request_id})
            error = internal_error()
            self.metrics.error(endpoint, error)
            if not status["code"]:  # else a stream already started: all we can do is end it
                await send_wrapper(
                    {
                        "type": "http.response.start",
                        "status": error.status,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                await send_wrapper({"type": "http.response.body", "body": json.dumps(error.body()).encode()})
        finally:
            elapsed = time.perf_counter() - start
            self.metrics.inflight.dec()
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
            self.metrics.duration.labels(endpoint).observe(elapsed)
            log.info(
                "request",
                extra={
                    "method": scope.get("method"),
                    "path": scope.get("path"),
                    "status": status["code"],
                    "duration_ms": round(elapsed * 1e3, 2),
                    "request_id": request_id,
                    "client": (scope.get("client") or ("", 0))[0],
                },
            )

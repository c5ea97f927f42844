"""Health probes: whether a gRPC server reports SERVING, whether an HTTP URL answers 200.

`python -m tide.probe grpc HOST:PORT | http URL` exits 0 when healthy, 1 when not, 2 on bad usage;
the compose file's healthchecks run it inside the service images.
"""

from __future__ import annotations

import sys
import urllib.request


def grpc_serving(address: str, timeout_s: float = 2.0) -> bool:
    """Whether the gRPC health check of `address` ("" = the whole server) says SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tide.grpcutil import channel

    ch = channel(address)
    try:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except Exception:
        return False
    finally:
        ch.close()


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether GET `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status == 200
    except Exception:
        return False


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] in ("grpc", "http"):
        return 0 if (grpc_serving if argv[0] == "grpc" else http_ok)(argv[1]) else 1
    print("usage: python -m tide.probe grpc HOST:PORT | http URL", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

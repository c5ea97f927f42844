"""Structured logs for every service: one JSON object per line on stderr.

Shape: `{"ts": ISO-8601 UTC, "level", "logger", "msg", "thread", ...extra, "exc_type", "exc"}`,
where a log call's `extra={...}` fields are inlined and the exception keys appear only with one.
"""

from __future__ import annotations

import json
import logging
import sys
import time

# LogRecord's own attributes are not `extra` fields; uvicorn's color_message duplicates msg.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName",
                                                                         "color_message"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "thread": record.threadName,
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info and record.exc_info[0] is not None:
            out["exc_type"] = record.exc_info[0].__name__
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(level: str = "INFO", reroute: tuple[str, ...] = ()) -> None:
    """Send every logger to stderr as JSON lines; `reroute` names loggers with handlers of their
    own (e.g. uvicorn's) that should propagate to ours instead."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in reroute:
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True

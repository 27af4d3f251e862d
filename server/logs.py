"""Logs as JSON lines on stderr: one object per record, with the record's ``fields`` extra merged in."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and the record's ``fields`` extra."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str = "INFO", stream: Any = None) -> None:
    """JSON-lines logs on stderr for the ``nmt`` loggers."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("nmt")
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False

"""structlog configured once per process: JSON lines (orjson) off a terminal, readable on one."""

from __future__ import annotations

import logging
import sys

import orjson
import structlog


def setup(level: str = "INFO") -> None:
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if sys.stderr.isatty():
        processors.append(structlog.dev.ConsoleRenderer())
        factory = structlog.PrintLoggerFactory(file=sys.stderr)
    else:
        processors += [structlog.processors.format_exc_info,
                       structlog.processors.JSONRenderer(serializer=orjson.dumps)]
        factory = structlog.BytesLoggerFactory(file=sys.stderr.buffer)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )

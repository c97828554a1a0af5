"""structlog configured once per process: JSON lines (orjson) off a terminal, readable on one.
Logging never stops a service: once stderr is a dead pipe (`genq consume | tee` after Ctrl-C)
writes are swallowed and the descriptor pointed at /dev/null, so later writes fail neither."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import IO, Any

import orjson

from genq.common.errors import mask_secrets, mask_tree


class SafeLogger:
    """Writes one line per call to a text or binary stream; a failed write is dropped."""

    def __init__(self, stream: IO[Any]) -> None:
        self.stream = stream
        self.lock = threading.Lock()
        self.broken = False

    def msg(self, message: str | bytes) -> None:
        if self.broken:
            return
        line = message + b"\n" if isinstance(message, bytes) else message + "\n"
        with self.lock:
            try:
                self.stream.write(line)
                self.stream.flush()
            except (OSError, ValueError):  # EPIPE, EIO, a closed file
                self.broken = True
                silence(self.stream)

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


def silence(stream: IO[Any]) -> None:
    """Point the stream's descriptor at /dev/null and drop its buffer, so later writes succeed
    into nothing."""
    with contextlib.suppress(OSError, ValueError):
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
        stream.flush()  # the bytes stuck in the buffer now go to /dev/null


def _mask(_logger: Any, _name: str, event: dict[str, Any]) -> Any:
    """No log line carries a password: URLs with credentials are masked wherever they appear."""
    return mask_tree(event)


def setup() -> None:
    import structlog  # here, not above: commands that do not log (`genq status`) start faster

    processors: list = [structlog.contextvars.merge_contextvars,
                        structlog.processors.add_log_level,
                        structlog.processors.TimeStamper(fmt="iso", utc=True)]
    if sys.stderr.isatty():
        processors += [_mask, structlog.dev.ConsoleRenderer()]
        logger = SafeLogger(sys.stderr)
    else:
        processors += [structlog.processors.format_exc_info, _mask,
                       structlog.processors.JSONRenderer(serializer=orjson.dumps)]
        logger = SafeLogger(sys.stderr.buffer)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=lambda *_args: logger,
        cache_logger_on_first_use=True,
    )


def say(text: str) -> None:
    """Print one line for the user on stderr (masked); a closed stderr is not an error."""
    try:
        print(mask_secrets(text), file=sys.stderr, flush=True)
    except (OSError, ValueError):
        silence(sys.stderr)


def _logger() -> Any:
    """genq's structlog logger, imported here for the same reason as in setup()."""
    import structlog

    return structlog.get_logger("genq")


class Outage:
    """An outage logged once when it starts, then at a slowing pace (10 s, 20 s... at most every
    10 min), and once when it ends; `events` names those three. Thread-safe."""

    FIRST_REMINDER_S, MAX_REMINDER_S = 10.0, 600.0

    def __init__(self, what: str, events: tuple[str, str, str] | None = None) -> None:
        self.events = events or (f"{what}_unavailable", f"{what}_still_unavailable",
                                 f"{what}_back")
        self.since: float | None = None
        self.failures = 0
        self.remind_at = self.gap = 0.0
        self.lock = threading.Lock()

    def seen(self, error: BaseException, **fields: Any) -> None:
        error_text = str(error) or type(error).__name__
        with self.lock:
            now = time.monotonic()
            self.failures += 1
            if self.since is None:
                self.since, self.failures = now, 1
                self.gap, self.remind_at = self.FIRST_REMINDER_S, now + self.FIRST_REMINDER_S
                event = self.events[0]
            elif now >= self.remind_at:
                self.gap = min(self.gap * 2, self.MAX_REMINDER_S)
                self.remind_at = now + self.gap
                event = self.events[1]
            else:
                return
            for_s = round(now - self.since, 1)
        _logger().warning(event, error=error_text, for_s=for_s, failures=self.failures,
                          **fields)

    def over(self, **fields: Any) -> None:
        if self.since is None:  # the common case, without the lock
            return
        with self.lock:
            if self.since is None:
                return
            lasted, failures, self.since = time.monotonic() - self.since, self.failures, None
        _logger().info(self.events[2], lasted_s=round(lasted, 1), failures=failures,
                       **fields)


# One per process: every Redis call that rides out an outage reports to it.
REDIS_OUTAGE = Outage("redis")

"""One verdict per failure (common/errors.py classify): Redis's connection trouble is waited
out, while an OSError that is not Redis's spends an attempt, so a task that keeps hitting it
ends failed with its reason instead of being retried forever."""

from __future__ import annotations

import errno

import pytest
import redis
import structlog

from genq.common import log
from genq.common.errors import (
    REDIS_TROUBLE,
    BadTask,
    OutputUnavailable,
    Retryable,
    TryAgain,
    classify,
)


@pytest.mark.parametrize("error", [
    redis.ConnectionError("Connection refused"),
    redis.TimeoutError("Timeout reading from socket"),
    redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"),
    ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    TimeoutError(),
])
def test_redis_connection_trouble_is_waited_out(error):
    assert isinstance(error, REDIS_TROUBLE)
    assert classify(error) is Retryable


@pytest.mark.parametrize("error", [
    OSError(errno.EIO, "Input/output error"),
    PermissionError(errno.EACCES, "Permission denied"),
    FileNotFoundError(errno.ENOENT, "No such file or directory"),
])
def test_an_oserror_that_is_not_redis_spends_an_attempt(error):
    assert not isinstance(error, REDIS_TROUBLE)
    assert classify(error) is TryAgain


def test_understood_failures_keep_their_verdicts():
    assert classify(BadTask(3, "row 3: has neither 'messages' nor 'prompt'")) is BadTask
    assert classify(OutputUnavailable("output directory /out: No space left")) is Retryable
    assert classify(ValueError("a bug")) is None


def test_an_outage_is_logged_once_then_at_a_slowing_pace_then_once_when_over(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(log.time, "monotonic", lambda: clock[0])
    outage = log.Outage("redis")
    with structlog.testing.capture_logs() as lines:
        for _ in range(6000):  # ten minutes of failures, ten a second
            outage.seen(redis.ConnectionError("Connection refused"))
            clock[0] += 0.1
        outage.over()
        outage.over()  # nothing more to say
    events = [line["event"] for line in lines]
    # Reminders after 10, 30, 70, 150, 310 s (and the next would be at 630 s).
    assert events == ["redis_unavailable", *["redis_still_unavailable"] * 5, "redis_back"]
    assert lines[-1]["failures"] == 6000 and lines[-1]["lasted_s"] == 600.0

"""One verdict per failure (common/errors.py classify): Redis's connection trouble is waited
out, while an OSError that is not Redis's spends an attempt, so a task that keeps hitting it
ends failed with its reason instead of being retried forever."""

from __future__ import annotations

import errno

import pytest
import redis

from common.errors import (
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

"""The exceptions genq raises on purpose, one small tree shared by every service.

    GenqError                      # base; str(e) is one clear line for the user
    ├── UsageError                 # bad flag / bad --set value / unknown run (CLI exits 2)
    ├── DatasetError               # missing/unreadable data set, fingerprint mismatch
    ├── BadTask                    # this task can never succeed: malformed row, HTTP 400
    └── Retryable                  # infrastructure trouble: release without spending an attempt
        ├── ServerUnavailable      # 5xx, connect refused/reset, timeouts
        ├── OutputUnavailable      # disk full / output dir unwritable
        └── StoreUnavailable       # S3 unreachable, refusing, or storing other bytes than sent

Classify once, where the failure is first understood; callers then only ask "BadTask or
Retryable?" (``classify``) to decide between failing the task and giving it back. Redis trouble
(``REDIS_TROUBLE``: unreachable, timed out, loading after a restart, read-only replica, or at
maxmemory with noeviction) is infrastructure trouble too: wait and retry, never fail a task.
"""

from __future__ import annotations

import redis


class GenqError(Exception):
    """Base of every error genq raises deliberately; ``str(e)`` is one line for the user."""


class UsageError(GenqError):
    """The user asked for something that cannot be done as asked (the CLI exits 2)."""


class DatasetError(GenqError):
    """The data set is missing, unreadable, or not the one the run was registered with."""


class BadTask(GenqError):
    """This task can never succeed, however often it is retried."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index
        self.reason = reason

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # Exceptions with extra __init__ arguments do not pickle by default; to_thread and
        # process pools may need to carry this one across.
        return (type(self), (self.index, self.reason))


class Retryable(GenqError):
    """Infrastructure trouble: give the task back without spending an attempt."""


class ServerUnavailable(Retryable):
    """The LLM server answered 5xx, refused or reset the connection, or timed out."""


class OutputUnavailable(Retryable):
    """The output shard cannot be written (disk full, quota, read-only or missing directory)."""


class StoreUnavailable(Retryable):
    """S3 cannot take or give a shard now; the shard stays on disk and is shipped later."""


# Redis trouble that passes on its own or once an operator acts; never a reason to fail a task.
# BusyLoadingError (Redis replaying its AOF after a restart) is a ConnectionError.
REDIS_TROUBLE: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    OSError,
)


def classify(exc: BaseException) -> type[BadTask] | type[Retryable] | None:
    """The one verdict on a failed task: BadTask (fail it now, with its message), Retryable
    (give it back without spending an attempt and back off), or None (a bug: let it crash)."""
    if isinstance(exc, BadTask):
        return BadTask
    if isinstance(exc, (GenqError, *REDIS_TROUBLE)):
        return Retryable
    return None

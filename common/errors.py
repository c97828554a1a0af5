"""The exceptions genq raises on purpose, one small tree shared by every service, and
``classify``: callers only ask it whether to fail a task, run it again, or give it back."""

from __future__ import annotations

import re

import redis


class GenqError(Exception):
    """Base of every error genq raises deliberately; ``str(e)`` is one line for the user."""


class UsageError(GenqError):
    """A bad flag, --set value or run name: cannot be done as asked (the CLI exits 2)."""


class DatasetError(GenqError):
    """The data set is missing, unreadable, or not the one the run was registered with."""


class RunStateLost(GenqError):
    """Redis forgot the run, or holds another of its name: services wait for `genq recover`."""


class BadTask(GenqError):
    """This task can never succeed, however often it is retried (malformed row, HTTP 400)."""

    row_id: str | int | None = None  # a malformed row's valid `id`, for its failed record

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index, self.reason = index, reason

    def __reduce__(self) -> tuple[type[BadTask], tuple[int, str]]:
        # Exceptions with extra __init__ arguments do not pickle by default; to_thread and
        # process pools may need to carry this one across.
        return (type(self), (self.index, self.reason))


class AnswerInvalid(BadTask):
    """No answer of the attempt matched the run's JSON Schema, each asked with another seed;
    `answer`: the last one (content, finish reason, the violation), kept for inspection."""

    def __init__(self, index: int, reason: str, answer: dict | None = None) -> None:
        super().__init__(index, reason)
        self.answer = answer or {}

    def __reduce__(self) -> tuple[type[AnswerInvalid], tuple[int, str, dict]]:  # type: ignore[override]
        return (type(self), (self.index, self.reason, self.answer))


class SchemaUnusable(GenqError):
    """The version's JSON Schema cannot check an answer (a `$ref` that resolves nowhere, in a
    schema no produce or requeue checked): every answer of the version would fail alike."""


class TryAgain(GenqError):
    """No finished result, or a prompt too long for this server's context: not proof of a bad
    prompt, so the task runs again, spending an attempt."""


class Retryable(GenqError):
    """Infrastructure trouble: give the task back without spending an attempt."""


class ServerUnavailable(Retryable):
    """The server answered 5xx, refused, reset or timed out; `retry_after`: its Retry-After."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ServerUnreachable(ServerUnavailable):
    """The connection was refused or never made: the server never saw the request, so no
    prompt can be why (its claim does not count towards --max-claims either)."""

    unsent = True


class ServerAborted(ServerUnavailable):
    """The server aborted the generation itself (finish_reason "abort"): not the task's fault."""


class ServerStalled(ServerUnavailable):
    """A hung server: no progress for --stall-timeout, or no answer within --request-timeout or
    the socket's timeout; its task goes back (never resent by its slot like a refusal)."""


class OutputUnavailable(Retryable):
    """The output shard cannot be written (disk full, quota, read-only or missing directory)."""


class StoreUnavailable(Retryable):
    """S3 cannot take or give a shard now; the shard stays on disk and is shipped later."""


# Redis trouble that passes on its own or once an operator acts (unreachable, loading its AOF,
# at maxmemory, a read-only replica), and the socket's own errors; `classify` judges other OSErrors.
REDIS_TROUBLE: tuple[type[Exception], ...] = (
    redis.ConnectionError, redis.TimeoutError, redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError, ConnectionError, TimeoutError)


def classify(exc: BaseException) -> type[BadTask] | type[TryAgain] | type[Retryable] | None:
    """The one verdict on a failed task: BadTask (fail it), TryAgain (retry, spending an attempt;
    also any other OSError), Retryable (retry without spending one) or None (a bug)."""
    if isinstance(exc, (BadTask, SchemaUnusable)):
        return BadTask
    if isinstance(exc, TryAgain):
        return TryAgain
    if isinstance(exc, (GenqError, *REDIS_TROUBLE)):
        return Retryable
    if isinstance(exc, OSError):
        return TryAgain
    return None


# scheme://user:password@host: the password (everything up to the last "@" of the authority).
_CREDENTIALS = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)([^\s:/@]*):[^\s/]*@")


def mask_secrets(text: str) -> str:
    """`redis://:secret@host` -> `redis://:***@host` wherever a URL appears: every message goes
    through this."""
    return _CREDENTIALS.sub(r"\1\2:***@", text)


def mask_tree(value: object) -> object:
    """mask_secrets over every string (and key) of a JSON-like value, such as the status."""
    if isinstance(value, str):
        return mask_secrets(value) if "@" in value else value
    if isinstance(value, dict):
        return {mask_tree(k): mask_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_tree(v) for v in value]
    return value


# A URL up to its trailing punctuation; a number standing alone, but an HTTP status (a cause).
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]*[^\s\"'<>:.,;)\]]")
_NUMBER = re.compile(r"(?<!HTTP )(?<![\w.])\d+(?:\.\d+)*\b")
_POSITION = re.compile(r"line \d+ column \d+ \(char \d+\)|\(char \d+\)")


def reason_kind(reason: str) -> str:
    """A failure reason without its per-prompt parts (URLs, numbers but HTTP statuses, JSON
    error positions): one cause, one kind, however many rows, token counts or servers."""
    kind = _NUMBER.sub("N", _POSITION.sub("…", _URL.sub("<url>", reason)))
    return kind.strip()[:300] or "(no reason given)"

"""Group commit for a durable append log written from several threads: while one thread is in
fdatasync the others' lines queue up, and the next of them writes and syncs them all at once.
An fdatasync takes milliseconds on ordinary disks, so one per record would cap a consumer at a
few hundred records per second however fast its server is."""

from __future__ import annotations

import threading
from collections.abc import Callable


class _Pending:
    """Lines of one caller waiting for a flush, and how their write ended."""

    __slots__ = ("lines", "event", "error", "lead")

    def __init__(self, lines: list[bytes]) -> None:
        self.lines = lines
        self.event = threading.Event()
        self.error: Exception | None = None
        self.lead = False  # set with event: this thread flushes the queue next


class GroupCommit:
    """``submit(line)`` returns once ``flush`` has made the line durable, or raises what
    ``flush`` reported for it; ``submit_all(lines)`` does so for several lines of one caller
    (all durable, or an error). ``flush(lines)`` returns (how many of the lines, from the
    start, are durable, the error for all the others or None); it runs in one thread at a
    time, in the order the lines were submitted."""

    def __init__(self, flush: Callable[[list[bytes]], tuple[int, Exception | None]]) -> None:
        self.flush = flush
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._flushing = False

    def submit(self, data: bytes) -> None:
        self.submit_all([data])

    def submit_all(self, lines: list[bytes]) -> None:
        item = _Pending(lines)
        with self._lock:
            self._pending.append(item)
            lead = not self._flushing
            self._flushing = True
        if not lead:
            item.event.wait()
            if not item.lead:  # another thread wrote (or failed to write) this line
                if item.error is not None:
                    raise item.error
                return
        with self._lock:
            batch, self._pending = self._pending, []
        done = 0
        try:
            done, error = self.flush([line for i in batch for line in i.lines])
        except BaseException as e:  # a bug in flush: every line of the batch hears of it
            done, error = 0, e if isinstance(e, Exception) else RuntimeError(repr(e))
            raise
        finally:
            for other in batch:  # a caller whose lines are not all durable hears the error
                if done < len(other.lines):
                    other.error = error
                done -= len(other.lines)
            with self._lock:
                if self._pending:  # hand over, so no thread flushes for others forever
                    self._pending[0].lead = True
                    self._pending[0].event.set()
                else:
                    self._flushing = False
            for other in batch:
                if other is not item:
                    other.event.set()
        if item.error is not None:
            raise item.error

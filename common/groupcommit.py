"""Group commit for a durable append log written from several threads: while one thread is in
fdatasync the others' lines queue up, and the next of them writes and syncs them all at once.
An fdatasync takes milliseconds on ordinary disks, so one per record would cap a consumer at a
few hundred records per second however fast its server is."""

from __future__ import annotations

import threading
from collections.abc import Callable


class _Pending:
    """One line waiting for a flush, and how its write ended."""

    __slots__ = ("data", "event", "error", "lead")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.event = threading.Event()
        self.error: Exception | None = None
        self.lead = False  # set with event: this thread flushes the queue next


class GroupCommit:
    """``submit(line)`` returns once ``flush`` has made the line durable, or raises what
    ``flush`` reported for it. ``flush(lines)`` returns (how many of the lines, from the
    start, are durable, the error for all the others or None); it runs in one thread at a
    time, in the order the lines were submitted."""

    def __init__(self, flush: Callable[[list[bytes]], tuple[int, Exception | None]]) -> None:
        self.flush = flush
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._flushing = False

    def submit(self, data: bytes) -> None:
        item = _Pending(data)
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
        try:
            done, error = self.flush([i.data for i in batch])
        except BaseException as e:  # a bug in flush: every line of the batch hears of it
            done, error = 0, e if isinstance(e, Exception) else RuntimeError(repr(e))
            raise
        finally:
            for other in batch[done:]:
                other.error = error
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

"""Test-only crash injection, so the fault suite can kill a consumer at the two instants no
signal sent from outside can hit reliably. Production never sets GENQ_FAULT.

    GENQ_FAULT=torn_write:N        the Nth record is written half-way, then the process SIGKILLs
                                   itself (a torn last line, as a power cut leaves it)
    GENQ_FAULT=kill_after_write:N  the Nth record is written and fdatasynced, then the process
                                   SIGKILLs itself before acknowledging it
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import orjson

MODES = ("torn_write", "kill_after_write")


def wrap(sink: Any, spec: str | None) -> Any:
    """The sink itself, or a wrapper that crashes as ``spec`` says."""
    if not spec:
        return sink
    mode, _, n = spec.partition(":")
    if mode not in MODES or not n.isdigit() or int(n) < 1:
        raise ValueError(f"GENQ_FAULT={spec!r}: use torn_write:N or kill_after_write:N")
    return _Crashing(sink, mode, int(n))


class _Crashing:
    def __init__(self, sink: Any, mode: str, n: int) -> None:
        self.sink, self.mode, self.n = sink, mode, n
        self.count = 0
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sink, name)

    def write(self, record: dict[str, Any]) -> None:
        with self.lock:
            self.count += 1
            if self.count == self.n and self.mode == "torn_write":
                line = orjson.dumps(record) + b"\n"
                fd = os.open(self.sink.path, os.O_WRONLY | os.O_APPEND)
                os.write(fd, line[: len(line) // 2])
                os.fdatasync(fd)
                os.kill(os.getpid(), signal.SIGKILL)
            self.sink.write(record)
            if self.count == self.n and self.mode == "kill_after_write":
                os.kill(os.getpid(), signal.SIGKILL)

    def write_many(self, records: list[dict[str, Any]]) -> None:
        for record in records:  # one by one, so the Nth record is the one that crashes
            self.write(record)

"""`genq consume` that kills itself at one of the two instants no signal sent from outside can
hit reliably, for the fault suite (tests/faultkit.py runs it when GENQ_FAULT is set):

    GENQ_FAULT=torn_write:N        the Nth result is written half-way, then SIGKILL (a torn last
                                   line, as a power cut leaves it)
    GENQ_FAULT=kill_after_write:N  the Nth result is written and fdatasynced, then SIGKILL
                                   before it is acknowledged
    GENQ_FAULT=kill_before_write:N SIGKILL as the Nth result is about to be written: what
                                   Redis holds then was recorded before the result was written
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import orjson

from genq.cli import main
from genq.common.data.shards import ShardWriter


def crash_at(spec: str) -> None:
    mode, _, n = spec.partition(":")
    if mode not in ("torn_write", "kill_after_write", "kill_before_write") or not n.isdigit() \
            or int(n) < 1:
        raise SystemExit(f"GENQ_FAULT={spec!r}: use torn_write:N, kill_after_write:N or "
                         "kill_before_write:N")
    nth, count, lock = int(n), [0], threading.Lock()
    write_many = ShardWriter.write_many  # the real one: write() goes through it too

    def crashing_write(self: ShardWriter, record: dict[str, Any]) -> None:
        with lock:
            count[0] += 1
            if count[0] == nth and mode == "kill_before_write":
                os.kill(os.getpid(), signal.SIGKILL)
            if count[0] == nth and mode == "torn_write":
                line = orjson.dumps(record) + b"\n"
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
                os.write(fd, line[: len(line) // 2])
                os.fdatasync(fd)
                os.kill(os.getpid(), signal.SIGKILL)
            write_many(self, [record])
            if count[0] == nth and mode == "kill_after_write":
                os.kill(os.getpid(), signal.SIGKILL)

    def one_by_one(self: ShardWriter, records: list[dict[str, Any]]) -> None:
        for record in records:  # so that the Nth record is the one that crashes
            if record.get("status") == "failed":  # a failed task's line: the fault is a result's
                write_many(self, [record])
            else:
                crashing_write(self, record)

    ShardWriter.write = crashing_write  # type: ignore[method-assign]
    ShardWriter.write_many = one_by_one  # type: ignore[method-assign]


if __name__ == "__main__":
    crash_at(os.environ["GENQ_FAULT"])
    sys.exit(main(sys.argv[1:]))

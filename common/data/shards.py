"""Output shards ``{run}.{name}.{start}-{pid}.{seq:06d}.jsonl``, flock-ed by their writer while
open; ``seq`` never repeats per name and directory (``.{run}.{name}.seq``)."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from genq.common.data.records import is_failure, parse_line, unheld_shards
from genq.common.errors import OutputUnavailable
from genq.common.files import fsync_dir
from genq.common.task import task_of

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def safe_name(name: str) -> str:
    """A consumer's --name as its shard names (and S3 keys) carry it."""
    return _UNSAFE.sub("_", name) or "consumer"


def _out_error(out_dir: Path, e: OSError) -> OutputUnavailable:
    reason = e.strerror or errno.errorcode.get(e.errno or 0, str(e))
    return OutputUnavailable(f"output directory {out_dir}: {reason}")


class ShardWriter:
    """Appends records to the current shard durably, whole lines only, thread-safe; a shard
    closes after ``rotate_every`` records or by age and goes to ``on_close``."""

    def __init__(self, out_dir: str | os.PathLike[str], run: str, name: str,
                 rotate_every: int | None = None,
                 on_close: Callable[[Path], None] | None = None) -> None:
        self.out_dir, self.run, self.name = Path(out_dir), run, safe_name(name)
        self.rotate_every, self.on_close = rotate_every, on_close
        self._lock = threading.Lock()
        self.path: Path | None = None  # the shard being written now (None after a rotation)
        self._fd, self._size, self._count, self._opened, self._closed = -1, 0, 0, 0.0, False
        self._open()  # at once, so an unwritable --out fails at start, not at the first result

    def _open(self) -> None:
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            while True:
                now = time.time_ns()
                # UTC to the nanosecond: names sort by start time and rarely collide.
                ts = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now // 10**9))
                stem = f"{self.run}.{self.name}.{ts}{now % 10**9:09d}Z-{os.getpid()}"
                path = self.out_dir / f"{stem}.{self._next_seq():06d}.jsonl"
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
                    break
                except FileExistsError:
                    continue  # same nanosecond as a shard just closed; take the next name
        except OSError as e:
            raise _out_error(self.out_dir, e) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            fsync_dir(self.out_dir)  # fdatasync on the file does not cover its name
        except OSError as e:
            os.close(fd)
            raise _out_error(self.out_dir, e) from e
        self._fd, self.path, self._size, self._count = fd, path, 0, 0
        self._opened = time.monotonic()

    def _next_seq(self) -> int:
        """The next shard number of this name here, kept durably so it never repeats."""
        fd = os.open(self.out_dir / f".{self.run}.{self.name}.seq", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # two processes given the same --name and --out
            raw = os.pread(fd, 32, 0).strip()
            seq = int(raw) + 1 if raw.isdigit() else 1
            os.pwrite(fd, f"{seq:012d}\n".encode(), 0)  # fixed width: one sector, never torn
            os.fdatasync(fd)
            return seq
        finally:
            os.close(fd)

    def write_many(self, records: list[dict[str, Any]]) -> None:
        """Append records, one fdatasync per shard they span; all durable, or an error."""
        lines = [orjson.dumps(record) + b"\n" for record in records]
        done = 0  # lines durable so far
        while done < len(lines):
            with self._lock:
                if self._fd < 0:
                    if self._closed:
                        raise ValueError("ShardWriter is closed")
                    self._open()
                room = len(lines) - done  # up to the next rotation, if any
                room = min(room, self.rotate_every - self._count) if self.rotate_every else room
                data = b"".join(lines[done:done + room])
                try:
                    view = memoryview(data)
                    while view:  # a write can be partial when the disk or a quota fills mid-line
                        view = view[os.write(self._fd, view) :]
                    os.fdatasync(self._fd)
                except OSError as e:
                    # Cut the lines so no reader sees a torn record; unacked, the tasks run again.
                    try:
                        os.ftruncate(self._fd, self._size)
                    except OSError:  # else the next line would be glued to the torn one
                        self._close_current()  # repair_shards cuts it; the next write opens anew
                    raise _out_error(self.out_dir, e) from e
                self._size += len(data)
                self._count += room
                if self.rotate_every and self._count >= self.rotate_every:
                    self._close_current()
            done += room

    @property
    def open_records(self) -> int:
        """Records in the shard being written, not closed (so not shipped) yet."""
        return self._count

    def rotate_if_older(self, max_age_s: float) -> None:
        """Close the current shard if it holds records and was opened max_age_s ago or more."""
        with self._lock:
            if self._count and time.monotonic() - self._opened >= max_age_s:
                self._close_current()

    def _close_current(self) -> None:
        fd, path, count = self._fd, self.path, self._count
        self._fd, self.path, self._count = -1, None, 0  # a closed shard is not open_records
        if fd < 0 or path is None:
            return
        if count == 0:
            path.unlink(missing_ok=True)  # nothing to ship; unlink while still holding the lock
        os.close(fd)  # releases the flock: the shard is now complete for repair and shipping
        if count and self.on_close is not None:
            self.on_close(path)

    def close(self) -> None:
        with self._lock:
            self._close_current()
            self._closed = True


def closed_shards(out_dir: str | os.PathLike[str], run: str) -> list[Path]:
    """Every non-empty shard of ``run`` in ``out_dir`` that no live writer holds."""
    return [path for path, fd in unheld_shards(out_dir, run, os.O_RDONLY, fcntl.LOCK_SH)
            if os.fstat(fd).st_size]


def shard_parts(path: Path) -> tuple[str, str, str, str]:
    """(run, consumer name, the writing process's ``{start}-{pid}``, zero-padded sequence
    number) from a shard's file name."""
    parts = path.name.removesuffix(".jsonl").split(".")
    return parts[0], parts[1], parts[2], parts[3]


NONE, NEWEST, ACCEPTED = 0, 1, 2  # Picks.state: no line yet; the newest so far; the accepted


class Picks:
    """Per index < total, where the line export keeps is (flat arrays, 54 bytes an index): the
    accepted (version, attempt) of the newest generation, else the newest line; two different
    accepted lines of one generation are `ambiguous`."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.state = bytearray(total)  # NONE, NEWEST or ACCEPTED
        self.version = array("q", bytes(8 * total))
        self.attempt = array("q", bytes(8 * total))
        self.gen = array("q", bytes(8 * total))
        self.digest = array("q", bytes(8 * total))  # the kept line's hash
        self.ambiguous: set[int] = set()
        self.file = array("i", bytes(4 * total))
        self.offset = array("q", bytes(8 * total))
        self.length = array("q", bytes(8 * total))
        self.torn = 0  # lines pick_lines skipped as torn or unparsable (not counting blank ones)

    def offer(self, index: int, version: int, attempt: int, gen: int, digest: int,
              wanted: tuple[int, int] | None, file_no: int, offset: int, length: int) -> None:
        """A line of ``index`` at (file_no, offset, length); ``wanted``: its accepted pair."""
        state, kept = self.state[index], (self.version[index], self.gen[index],
                                           self.attempt[index])
        if (version, attempt) == wanted:
            if state == ACCEPTED and gen <= kept[1]:
                if gen == kept[1] and digest != self.digest[index]:
                    self.ambiguous.add(index)
                return
            self.ambiguous.discard(index)
        elif state == ACCEPTED or (state == NEWEST and (version, gen, attempt) < kept):
            return
        self.state[index] = ACCEPTED if (version, attempt) == wanted else NEWEST
        self.version[index], self.attempt[index] = version, attempt
        self.gen[index], self.digest[index] = gen, digest
        self.file[index], self.offset[index], self.length[index] = file_no, offset, length

    def drop_keys(self) -> None:
        """Free the (version, gen, attempt) arrays once every line has been offered."""
        self.version = self.attempt = self.gen = self.digest = array("q")


def pick_lines(paths: Sequence[Path], total: int,
               accepted: Callable[[int], tuple[int, int] | None],
               wanted: Callable[[int], bool] = lambda index: True,
               failed: Callable[[int], bool] = lambda index: False, samples: int = 1) -> Picks:
    """Export's first pass: every result line of a ``wanted`` task < total (task.task_of
    with the run's ``samples``), and every failed task's line of a ``failed`` one, offered to
    ``Picks``, one shard open at a time; torn lines count in ``Picks.torn``, non-64-bit keys are
    skipped."""
    picks = Picks(total)
    low, high = -(1 << 63), (1 << 63) - 1
    for file_no, start, line in shard_lines(paths):
        record = parse_line(line)
        if record is None or "index" not in record:
            picks.torn += bool(line.strip())
            continue
        index = task_of(record, samples)
        if index is None or index >= total \
                or not (failed if is_failure(record) else wanted)(index):
            continue
        version, attempt = record.get("params_version", 0), record.get("attempt", 0)
        gen = record.get("gen", 0)
        if any(type(v) is not int or not low <= v <= high for v in (version, attempt, gen)):
            continue
        picks.offer(index, version, attempt, gen, hash(line.rstrip(b"\n")),
                    accepted(index), file_no, start, len(line))
    return picks


def shard_lines(paths: Sequence[Path]) -> Iterator[tuple[int, int, bytes]]:
    """(file number, offset, line) of every line of these shards, one shard open at a time;
    one shipped and removed since its directory was listed is skipped."""
    for file_no, path in enumerate(paths):
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            continue
        with f:
            offset = 0
            for line in f:
                yield file_no, offset, line
                offset += len(line)

"""Torn-tail repair: cut a shard back to its last complete, valid line after a crash."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from genq.common.data.records import parse_line, unheld_shards

_TAIL_BLOCK = 64 << 10


def _line_start(fd: int, end: int) -> int:
    """Offset where the line holding byte ``end - 1`` starts (after the previous newline)."""
    pos = end - 1  # the byte at end-1 is the line's own newline (or its last byte); skip it
    while pos > 0:
        lo = max(0, pos - _TAIL_BLOCK)
        nl = os.pread(fd, pos - lo, lo).rfind(b"\n")
        if nl >= 0:
            return lo + nl + 1
        pos = lo
    return 0


def _good_end(fd: int, size: int) -> int:
    """End of the last complete line that is a valid JSON object (0 when there is none)."""
    end = size
    while end > 0:
        start = _line_start(fd, end)
        line = os.pread(fd, end - start, start)
        if parse_line(line) is not None:
            return end
        end = start  # torn (no newline) or garbage: drop it and look at the line before
    return 0


def repair_shards(out_dir: str | os.PathLike[str], run: str) -> list[tuple[Path, int]]:
    """Cut torn tails off every shard of ``run`` that no live writer holds; report the cuts."""
    cuts: list[tuple[Path, int]] = []
    for path, fd in unheld_shards(out_dir, run, os.O_RDWR, fcntl.LOCK_EX):
        size = os.fstat(fd).st_size
        end = _good_end(fd, size)
        if end < size:
            os.ftruncate(fd, end)
            os.fsync(fd)
            cuts.append((path, size - end))
    return cuts

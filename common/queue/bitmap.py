"""The per-index bitmaps (done, failed, pending, truncated, kept) as Python reads and writes them
whole: bit i is index i, and Redis's bit 0 is the high bit of byte 0 (as SETBIT and GETBIT)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

_ANY_SET = re.compile(rb"[^\x00]")
_ANY_CLEAR = re.compile(rb"[^\xff]")


def is_set(raw: bytes | None, index: int) -> bool:
    """Whether index's bit is 1 (past the end of the string, Redis reads 0)."""
    byte = index >> 3
    return raw is not None and byte < len(raw) and bool(raw[byte] & (0x80 >> (index & 7)))


def _scan(raw: bytes, pattern: re.Pattern[bytes], want: bool, stop: int | None) -> Iterator[int]:
    # Find the bytes worth looking at in C, then look at their bits.
    for match in pattern.finditer(raw):
        byte_no = match.start()
        value = raw[byte_no]
        for bit in range(8):
            index = byte_no * 8 + bit
            if stop is not None and index >= stop:
                return
            if bool(value & (0x80 >> bit)) == want:
                yield index


def set_indices(raw: bytes | None, below: int | None = None) -> Iterator[int]:
    """The indices whose bit is 1, in order (only those under `below`, given one)."""
    return _scan(raw or b"", _ANY_SET, True, below)


def clear_indices(raw: bytes | None, total: int) -> Iterator[int]:
    """The indices under `total` whose bit is 0, in order."""
    size = (total + 7) // 8
    return _scan((raw or b"")[:size].ljust(size, b"\0"), _ANY_CLEAR, False, total)


def union(raws: Iterable[bytes | None], total: int) -> bytes:
    """The bitwise OR of bitmaps, as long as `total` bits need."""
    size = (total + 7) // 8
    merged = 0
    for raw in raws:
        merged |= int.from_bytes((raw or b"")[:size].ljust(size, b"\0"), "big")
    return merged.to_bytes(size, "big")


def encode(indices: Iterable[int], total: int) -> bytes:
    """A bitmap of `total` bits with these indices set, as Redis would hold it."""
    out = bytearray((total + 7) // 8)
    for i in indices:
        out[i >> 3] |= 0x80 >> (i & 7)
    return bytes(out)


def full_groups(raw: bytes | None, groups: int, size: int) -> int:
    """How many of the first ``groups`` runs of ``size`` bits (run g: bits g*size ..
    g*size+size-1) are all 1: in big-int arithmetic, not a Python step a run."""
    nbytes = (groups * size + 7) // 8
    x = int.from_bytes((raw or b"")[:nbytes].ljust(nbytes, b"\0"), "big")
    pad = 8 * nbytes - groups * size  # low bits past the last run
    every = x
    for shift in range(1, size):  # bit q stays 1 where bits q .. q+size-1 all are
        every &= x >> shift
    # A 1 at each run's lowest bit (its last index): (2^(size*groups) - 1) / (2^size - 1).
    starts = ((1 << (size * groups)) - 1) // ((1 << size) - 1) << pad
    return (every & starts).bit_count()

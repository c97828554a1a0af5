"""The export's rules as the tests' reference model: every record read into memory and one
chosen per index (choose_records), which the export's line-location passes (Picks,
pick_lines in common/data/shards.py) must agree with."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from genq.common.data.records import parse_line, shard_files
from genq.common.queue import bitmap
from genq.common.queue.keys import RunKeys
from genq.common.queue.replies import blob
from genq.common.queue.run import failure_reasons


@dataclass
class ReadStats:
    """What ``read_records`` saw: shards opened, records yielded, lines skipped as torn."""

    shards: int = 0
    records: int = 0
    skipped: int = 0


def read_records(dirs: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], run: str,
                 stats: ReadStats | None = None) -> Iterator[dict[str, Any]]:
    """Every record in every shard of ``run`` in ``dirs``; unparsable and torn lines (see
    parse_line) are counted in ``stats`` and skipped."""
    stats = stats if stats is not None else ReadStats()
    if isinstance(dirs, str | os.PathLike):
        dirs = [dirs]
    for directory in dirs:
        for path in shard_files(directory, run):
            yield from _read_shard(path, stats)


def _read_shard(path: Path, stats: ReadStats) -> Iterator[dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            stats.shards += 1
            for line in f:
                record = parse_line(line)
                if record is not None:
                    stats.records += 1
                    yield record
                elif line.strip():
                    stats.skipped += 1
    except FileNotFoundError:
        return  # shipped and removed since the directory was listed


def choose_records(records: Iterable[dict[str, Any]],
                   accepted: Callable[[int], tuple[int, int] | None],
                   ambiguous: set[int] | None = None) -> dict[int, dict[str, Any]]:
    """One record per index: the accepted (params_version, attempt) if present, of the newest
    generation holding it, the first read (a different record of that generation under it
    makes the index ``ambiguous``: records carry their line's ``digest``); else the newest
    (by version, generation, attempt, then last seen); ``accepted`` is called once per index.

    The rules of every reader; ``Picks`` applies the same ones to line locations in arrays."""
    chosen: dict[int, dict[str, Any]] = {}
    keys: dict[int, tuple[int, int, int]] = {}
    wanted: dict[int, tuple[int, ...] | None] = {}  # tuple(): a list would never equal a key
    matched: set[int] = set()
    ambiguous = set() if ambiguous is None else ambiguous
    for record in records:
        index, gen = record["index"], record.get("gen", 0)
        version, attempt = record.get("params_version", 0), record.get("attempt", 0)
        if index not in wanted:
            pair = accepted(index)
            wanted[index] = tuple(pair) if pair is not None else None
        if (version, attempt) == wanted[index]:
            if index in matched and gen <= keys[index][1]:
                if gen == keys[index][1] and record.get("digest") != chosen[index].get("digest"):
                    ambiguous.add(index)
                continue
            matched.add(index)
            ambiguous.discard(index)
        elif index in matched or (index in keys and (version, gen, attempt) < keys[index]):
            continue
        chosen[index], keys[index] = record, (version, gen, attempt)
    return chosen



def failed_reasons(r: redis.Redis, k: RunKeys, total: int) -> dict[int, str]:
    """index -> last error text of every failed index ("" where none was kept)."""
    failed = list(bitmap.set_indices(blob(r.get(k.failed)), below=total))
    if not failed:
        return {}
    return dict(zip(failed, failure_reasons(r, k, failed), strict=True))

"""`genq export`: one record per done index from every shard, the accepted attempt first.

Two passes keep memory small: the first keeps only each line's index, version, attempt and
location; the second copies the chosen lines in index order. Where the (version, attempt) Redis
accepted is missing from the shards, the newest line is written instead and reported
(`not_accepted`). With include_failed, each failed index gets a record too:
{"index", "run", "status": "failed", "error"}.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import redis

from common.data.records import parse_line, shard_files
from common.data.shards import choose_records
from common.queue import bitmap
from common.queue.keys import RunKeys
from common.queue.replies import blob, text


@dataclass(frozen=True, kw_only=True)
class ExportResult:
    written: int
    done: int
    missing: list[int]
    torn_lines: int
    shards: int
    not_accepted: list[int]  # done indices written from a line that is not the accepted one
    not_accepted_count: int
    failed_written: int


def _u16(raw: bytes | None, index: int) -> int:
    """Index's value in a BITFIELD of u16 (0 past the end, as Redis reads it)."""
    return int.from_bytes((raw or b"")[2 * index:2 * index + 2].ljust(2, b"\0"), "big")


def accepted_lookup(r: redis.Redis, k: RunKeys):
    """(accepted, is_done): index -> (params_version, attempt) of its accepted result, or None
    if not done; index -> whether it is done."""
    pipe = r.pipeline(transaction=True)
    for key in (k.done, k.acc_version, k.acc_attempt):
        pipe.get(key)
    done, versions, attempts = pipe.execute()

    def is_done(index: int) -> bool:
        return bitmap.is_set(done, index)

    def accepted(index: int) -> tuple[int, int] | None:
        return (_u16(versions, index), _u16(attempts, index)) if is_done(index) else None

    return accepted, is_done


def failed_reasons(r: redis.Redis, k: RunKeys, total: int) -> dict[int, str]:
    """index -> last error text of every failed index ("" where none was kept)."""
    failed = list(bitmap.set_indices(blob(r.get(k.failed)), below=total))
    if not failed:
        return {}
    texts = r.hmget(k.errors, [str(i) for i in failed])
    return {i: text(t or b"", errors="replace") for i, t in zip(failed, texts, strict=True)}


def _failed_line(run: str, index: int, reason: str) -> bytes:
    return orjson.dumps({"index": index, "run": run, "status": "failed", "error": reason}) + b"\n"


def kept_lookup(r: redis.Redis, k: RunKeys):
    """index -> whether its result is one a redo set aside that stands again because the
    new attempt failed for good (only asked of done indices)."""
    raw = blob(r.get(k.kept))
    return lambda i: bitmap.is_set(raw, i)


def mark_kept(line: bytes) -> bytes:
    """Say so in the record: it is the previous result, kept when its redo failed."""
    return orjson.dumps({**orjson.loads(line), "kept": True}) + b"\n"


def shard_paths(dirs: list[str], run: str) -> list[Path]:
    return [path for directory in dirs for path in shard_files(directory, run)]


def locate(paths: list[Path], counter: list[int]) -> Iterator[dict[str, Any]]:
    """Light records (index, version, attempt, location) of every complete line."""
    for file_no, path in enumerate(paths):
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            continue
        with f:
            offset = 0
            for line in f:
                start, offset = offset, offset + len(line)
                record = parse_line(line)
                if record is None or "index" not in record:
                    counter[0] += bool(line.strip())
                    continue
                yield {"index": record["index"],
                       "params_version": record.get("params_version", 0),
                       "attempt": record.get("attempt", 0),
                       "loc": (file_no, start, len(line))}


def export(r: redis.Redis, k: RunKeys, total: int, dirs: list[str], out: str,
           progress: Any = None, *, include_failed: bool = False) -> ExportResult:
    accepted, is_done = accepted_lookup(r, k)
    paths = shard_paths(dirs, k.run)
    torn = [0]
    chosen = choose_records(locate(paths, torn), accepted)
    done_indices = [i for i in range(total) if is_done(i)]
    kept = kept_lookup(r, k)
    wanted = [i for i in done_indices if i in chosen]
    missing = [i for i in done_indices if i not in chosen]
    fallback = [i for i in wanted
                if (chosen[i]["params_version"], chosen[i]["attempt"]) != accepted(i)]
    failed = failed_reasons(r, k, total) if include_failed else {}
    order = sorted(set(wanted) | set(failed))
    tmp = f"{out}.tmp-{os.getpid()}"
    handles: dict[int, Any] = {}
    try:
        with open(tmp, "wb") as dst:
            for n, index in enumerate(order):
                if index in failed:
                    dst.write(_failed_line(k.run, index, failed[index]))
                    continue
                file_no, start, length = chosen[index]["loc"]
                if file_no not in handles:
                    handles[file_no] = open(paths[file_no], "rb")
                src = handles[file_no]
                src.seek(start)
                dst.write(mark_kept(src.read(length)) if kept(index) else src.read(length))
                if progress is not None and n % 1000 == 0:
                    progress(n, len(order))
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, out)
    finally:
        for handle in handles.values():
            handle.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
    return ExportResult(written=len(wanted), done=len(done_indices), missing=missing[:20],
                        torn_lines=torn[0], shards=len(paths), not_accepted=fallback[:20],
                        not_accepted_count=len(fallback), failed_written=len(failed))

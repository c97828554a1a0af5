"""`genq export`: one record per done index, the accepted attempt (else the newest, reported), in
a few dozen bytes an index: where each line is, then copies in index order."""

from __future__ import annotations

import contextlib
import os
import tempfile
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import orjson
import redis

from genq.common.data.records import failed_record, shard_files
from genq.common.data.shards import ACCEPTED, NEWEST, NONE, Picks, pick_lines
from genq.common.errors import GenqError, reason_kind
from genq.common.queue import bitmap
from genq.common.queue import run as runs
from genq.common.queue.keys import RunKeys
from genq.common.queue.replies import blob
from genq.common.schema import is_violation


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
    # Failed on the schema, written from Redis without a shard line, and Redis kept no copy of
    # the answer (past its bound, consumer/structured.py): their records lack `answer`.
    answers_unkept: int = 0
    # A --turns all run: the conversations with a generation in no shard read (`missing` lists
    # the first; done - written counts nothing there, a conversation writing several lines).
    conversations_missing: int | None = None


def accepted_state(r: redis.Redis, k: RunKeys):
    """(accepted, is_done, done): index -> (params_version, attempt) of its accepted result, or
    None if not done; index -> whether it is done; the done bitmap they were read with."""
    done_raw, versions, attempts = r.mget(k.done, k.acc_version, k.acc_attempt)  # one snapshot
    done = blob(done_raw)
    # Padded once (2 bytes a u16 BITFIELD field) so each lookup is two byte reads: a done index
    # is below 8 * len(done), and past a BITFIELD's end Redis reads 0, as the padding does.
    size = 16 * len(done)
    vs, ats = (blob(raw)[:size].ljust(size, b"\0") for raw in (versions, attempts))

    def is_done(index: int) -> bool:
        return bitmap.is_set(done, index)

    def accepted(index: int) -> tuple[int, int] | None:  # of an index >= 0
        if not is_done(index):
            return None
        j = 2 * index
        return vs[j] << 8 | vs[j + 1], ats[j] << 8 | ats[j + 1]

    return accepted, is_done, done


def _failed_record(run: str, task: int, reason: str, invalid: bytes = b"",
                   samples: int = 1) -> dict:
    """A failed task's record from Redis; a prompt failed on the schema also carries its last
    answer, where Redis kept a copy."""
    answer = orjson.loads(invalid) if invalid else None
    # Kept by an earlier failure on the schema, the index may fail for another reason now.
    if not (answer and reason.startswith(reason_kind(answer.get("violation") or ""))):
        answer = None
    return failed_record(run=run, task=task, samples=samples, error=reason, answer=answer)


def _failed_line(run: str, task: int, reason: str, invalid: bytes = b"",
                 samples: int = 1) -> bytes:
    return orjson.dumps(_failed_record(run, task, reason, invalid, samples)) + b"\n"


def kept_lookup(r: redis.Redis, k: RunKeys):
    """index -> whether its result is a redo's set-aside one, standing again."""
    raw = blob(r.get(k.kept))
    return lambda i: bitmap.is_set(raw, i)


def mark_kept(line: bytes) -> bytes:
    """Say so in the record: it is the previous result, kept when its redo failed."""
    return orjson.dumps({**orjson.loads(line), "kept": True}) + b"\n"


def shard_paths(dirs: list[str], run: str) -> list[Path]:
    return [path for directory in dirs for path in shard_files(directory, run)]


_FAILED_BATCH = 5_000  # failure reasons read at a time


def _spill_failed(r: redis.Redis, k: RunKeys, indices: array,
                  spill: IO[bytes]) -> tuple[array, array, int]:
    """Write a record for each of these failed indices (ascending) to ``spill``, its reason's
    kind as Redis keeps it, then rewind it; the indices, lengths, and how many failed on the
    schema without the answer's copy."""
    lengths, samples, unkept = array("q"), runs.samples_of(r, k), 0
    for lo in range(0, len(indices), _FAILED_BATCH):
        batch = indices[lo:lo + _FAILED_BATCH]
        reasons = runs.failure_reasons(r, k, batch)
        kept = [blob(raw) for raw in r.hmget(k.invalid, [str(i) for i in batch])]
        for index, reason, invalid in zip(batch, reasons, kept, strict=True):
            record = _failed_record(k.run, index, reason, invalid, samples)
            unkept += "answer" not in record and is_violation(reason)
            line = orjson.dumps(record) + b"\n"
            spill.write(line)
            lengths.append(len(line))
    spill.seek(0)
    return indices, lengths, unkept


def _read_at(fd: int, length: int, offset: int, path: Path) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length or not data.endswith(b"\n"):
        raise GenqError(f"shard {path} changed while it was exported (a line read in the first "
                        "pass is not there now); export again")
    return data


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


@contextlib.contextmanager
def _open_shard(path: Path) -> Iterator[int]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise GenqError(f"shard {path} was removed while it was exported (a consumer with "
                        "--delete-shipped?); export again, or --from-s3") from None
    try:
        yield fd
    finally:
        os.close(fd)


def _layout(picks: Picks, failed: array, failed_lengths: array, paths: list[Path],
            kept: Callable[[int], bool]) -> tuple[array, int, set[int]]:
    """Where each written index starts in the output, its size, and the indices whose line gets
    the kept mark."""
    starts = array("q", bytes(8 * picks.total))
    state, lengths = picks.state, picks.length
    marked: set[int] = set()  # a redo's result kept when the redo failed: few
    pos, f, n_failed = 0, 0, len(failed)
    next_failed = failed[0] if n_failed else -1
    for index in range(picks.total):
        if index == next_failed:
            starts[index] = pos
            pos += failed_lengths[f]
            f += 1
            next_failed = failed[f] if f < n_failed else -1
        elif state[index] != NONE:
            starts[index] = pos
            length = lengths[index]
            if kept(index):
                path = paths[picks.file[index]]
                with _open_shard(path) as fd:
                    length = len(mark_kept(_read_at(fd, length, picks.offset[index], path)))
                marked.add(index)
            pos += length
    return starts, pos, marked


def _by_shard(picks: Picks, n_files: int) -> tuple[array, array]:
    """The indices to copy grouped by shard (counting sort), and each group's start."""
    state, files = picks.state, picks.file
    bounds = array("q", bytes(8 * (n_files + 1)))
    for index in range(picks.total):
        if state[index] != NONE:
            bounds[files[index] + 1] += 1
    for f in range(n_files):
        bounds[f + 1] += bounds[f]
    fill = array("q", bounds)
    grouped = array("q", bytes(8 * bounds[n_files]))
    for index in range(picks.total):
        if state[index] != NONE:
            f = files[index]
            grouped[fill[f]] = index
            fill[f] += 1
    return grouped, bounds


def _copy(picks: Picks, paths: list[Path], starts: array, marked: set[int], dst: int) -> None:
    """Copy each chosen line to its place in the output, one shard open at a time, in file order."""
    grouped, bounds = _by_shard(picks, len(paths))
    offsets, lengths = picks.offset, picks.length
    for file_no, path in enumerate(paths):
        group = sorted(grouped[bounds[file_no]:bounds[file_no + 1]], key=offsets.__getitem__)
        if not group:
            continue
        with _open_shard(path) as src:
            for index in group:
                line = _read_at(src, lengths[index], offsets[index], path)
                _pwrite_all(dst, mark_kept(line) if index in marked else line, starts[index])


def standing(r: redis.Redis, k: RunKeys, total: int, dirs: list[str],
             wanted: Callable[[int], bool]) -> Iterator[dict]:
    """The accepted record of each done, ``wanted`` index found in the shards, one at a time
    as read (a requeue may want a hundred thousand whole answers)."""
    accepted, is_done, _ = accepted_state(r, k)
    paths = shard_paths(dirs, k.run)
    picks = pick_lines(paths, total, accepted, lambda i: is_done(i) and wanted(i),
                       samples=runs.samples_of(r, k))
    by_file: dict[int, list[int]] = {}
    for i in range(total):
        if picks.state[i] == ACCEPTED:
            by_file.setdefault(picks.file[i], []).append(i)
    for file_no, chosen in by_file.items():
        with _open_shard(paths[file_no]) as fd:
            for i in chosen:
                yield orjson.loads(_read_at(fd, picks.length[i], picks.offset[i], paths[file_no]))


def not_held(r: redis.Redis, k: RunKeys, total: int, dirs: list[str]) -> list[int]:
    """The done tasks whose accepted line is in none of ``dirs``' shards: what an export of
    them would miss, or write from a line Redis did not accept."""
    accepted, is_done, done = accepted_state(r, k)
    picks = pick_lines(shard_paths(dirs, k.run), total, accepted, is_done,
                       samples=runs.samples_of(r, k))
    return [i for i in bitmap.set_indices(done, below=total) if picks.state[i] != ACCEPTED]


def export(r: redis.Redis, k: RunKeys, total: int, dirs: list[str], out: str,
           *, include_failed: bool = False, allow_ambiguous: bool = False) -> ExportResult:
    accepted, is_done, done_raw = accepted_state(r, k)
    failed_raw = blob(r.get(k.failed)) if include_failed else b""
    paths = shard_paths(dirs, k.run)
    # Done tasks' results, and failed ones' newest failed line (its whole reason), if asked.
    picks = pick_lines(paths, total, accepted, is_done,
                       lambda i: bitmap.is_set(failed_raw, i), samples=runs.samples_of(r, k))
    picks.drop_keys()
    if picks.ambiguous and not allow_ambiguous:
        raise GenqError(
            f"{len(picks.ambiguous)} done prompts have two different lines under the key Redis "
            f"accepted (indices {sorted(picks.ambiguous)[:10]}): genq cannot tell which was "
            "accepted, so nothing was written; --allow-ambiguous keeps the first line read")
    kept = kept_lookup(r, k)
    done = written = fallback_count = 0
    missing: list[int] = []
    fallback: list[int] = []
    for index in bitmap.set_indices(done_raw, below=total):
        done += 1
        state = picks.state[index]
        written += state != NONE
        if state == NONE and len(missing) < 20:
            missing.append(index)
        elif state == NEWEST:  # the accepted line is not in the shards
            fallback_count += 1
            if len(fallback) < 20:
                fallback.append(index)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            with contextlib.ExitStack() as stack:
                failed = array("q", bitmap.set_indices(failed_raw, below=total))
                failed_count = len(failed)
                for index in failed:  # a failed record stands for the index, not a result line
                    if is_done(index):
                        picks.state[index] = NONE
                # Those with a failed line in the shards (their whole reason) are copied.
                failed = array("q", (i for i in failed if picks.state[i] == NONE))
                failed_lengths, unkept = array("q"), 0
                if failed:
                    spill = stack.enter_context(
                        tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(out))))
                    failed, failed_lengths, unkept = _spill_failed(r, k, failed, spill)
                starts, size, marked = _layout(picks, failed, failed_lengths, paths, kept)
                _copy(picks, paths, starts, marked, dst)
                for index, length in zip(failed, failed_lengths, strict=True):
                    _pwrite_all(dst, spill.read(length), starts[index])
            if os.fstat(dst).st_size != size:  # every line has its place: no holes
                raise GenqError(f"export to {out}: wrote {os.fstat(dst).st_size} of {size} "
                                "bytes")
            os.fsync(dst)
        finally:
            os.close(dst)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return ExportResult(written=written, done=done, missing=missing, torn_lines=picks.torn,
                        shards=len(paths), not_accepted=fallback,
                        not_accepted_count=fallback_count, failed_written=failed_count,
                        answers_unkept=unkept)

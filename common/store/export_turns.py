"""`--turns all` in `genq export` and `genq status`: every accepted generation of every
conversation, found in the shards by the key Redis accepted it under (turns/state.py: the made
turns' entries, and the last turn's acc_version and acc_attempt once the conversation is done),
written one line a generation or one row a conversation; and the figures status shows, read from
the same state, so status counts what export writes.
"""

from __future__ import annotations

import os
import sys
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterator
from itertools import accumulate
from pathlib import Path
from typing import Any

import orjson
import redis

from genq.common.data.dataset import open_dataset
from genq.common.data.records import failed_record, is_failure, parse_line
from genq.common.data.shards import shard_lines
from genq.common.queue import bitmap
from genq.common.queue import run as runs
from genq.common.queue.keys import RunKeys
from genq.common.queue.replies import blob
from genq.common.store import export as results
from genq.common.task import TaskId
from genq.common.turns import conversations as shape
from genq.common.turns import splice
from genq.common.turns.state import ATTEMPT, END_NAMES, TURN_BITS, VERSION, Standing

NOT_FOUND, NOT_WANTED = -1, -2  # Accepted.file_no of a generation whose line is not read


class Accepted:
    """Every accepted generation's key and, once `_pick` found it, where its line is: in flat
    arrays, one slot a generation, by task then turn (a task's slots begin at start[task] and
    end at start[task + 1]), so that a run of millions of generations holds 36 bytes each and
    8 a task, not a tuple each."""

    def __init__(self, start: array, versions: array, attempts: array) -> None:
        self.start, self.versions, self.attempts = start, versions, attempts
        self.file_no = array("i", [NOT_FOUND]) * len(versions)
        self.offset = array("q", bytes(8 * len(versions)))
        self.length = array("q", bytes(8 * len(versions)))

    def tasks(self) -> Iterator[tuple[int, int, int]]:
        """(task, its first slot, its end) of each task with a generation, in order."""
        start = self.start
        for task in range(len(start) - 1):
            if start[task] < start[task + 1]:
                yield task, start[task], start[task + 1]

    def missing(self) -> list[int]:
        """The tasks with a generation whose line was not found, in order."""
        file_no = self.file_no
        return [task for task, first, end in self.tasks()
                if NOT_FOUND in file_no[first:end]]


def accepted_keys(r: redis.Redis, k: RunKeys, *, cut: bool = False) -> tuple[Accepted, bytes]:
    """(the key of each accepted generation: the made turns' entries of every conversation
    begun, then a done one's acc_version and acc_attempt; the done bitmap). `cut`: only the
    done conversations that ended truncated, and of them only the last turn is wanted."""
    accepted, _, done_raw = results.accepted_state(r, k)
    # The conversations as HSCAN returns them, flat: their tasks, counts, keys, cut turns.
    tasks, counts, versions, attempts, lasts = (array("q") for _ in range(5))
    for field, raw in r.hscan_iter(k.conv, count=1000):
        task, standing = int(field), Standing.decode(raw)
        if cut and not (standing.end == splice.TRUNCATED and bitmap.is_set(done_raw, task)):
            continue
        tasks.append(task)
        counts.append(len(standing.made))
        versions.extend(e[VERSION] for e in standing.made)
        attempts.extend(e[ATTEMPT] for e in standing.made)
        lasts.append(standing.last)
    size = max(max(tasks, default=-1) + 1, 0 if cut else 8 * len(done_raw))
    start, seen, twice = array("q", bytes(8 * (size + 1))), bytearray(size), bytearray(len(tasks))
    for i, task in enumerate(tasks):  # counts first: start[task + 1] = how many task has
        if seen[task]:
            twice[i] = 1  # HSCAN may return a field twice
        seen[task], start[task + 1] = 1, counts[i]
    def done() -> Iterator[tuple[int, tuple[int, int]]]:  # each done task's last key
        for task in bitmap.set_indices(done_raw, below=size):
            if (not cut or seen[task]) and (last := accepted(task)) is not None:
                yield task, last

    for task, _ in done():
        start[task + 1] += 1
    start = array("q", accumulate(start))
    by_task = array("q", bytes(8 * start[-1])), array("q", bytes(8 * start[-1]))
    at = 0
    for i, task in enumerate(tasks):
        n, first = counts[i], start[task]
        if not twice[i]:
            by_task[0][first:first + n] = versions[at:at + n]
            by_task[1][first:first + n] = attempts[at:at + n]
        at += n
    del versions, attempts  # before the picks' arrays are made: 36 B a generation at most
    for task, (version, attempt) in done():
        by_task[0][start[task + 1] - 1], by_task[1][start[task + 1] - 1] = version, attempt
    out = Accepted(start, *by_task)
    if cut:
        out.file_no = array("i", [NOT_WANTED]) * len(out.file_no)
        for task, last in zip(tasks, lasts, strict=True):
            if 0 < last <= start[task + 1] - start[task]:
                out.file_no[start[task] + last - 1] = NOT_FOUND
    return out, done_raw


def _pick(paths: list[Path], keys: Accepted, samples: int) -> int:
    """Where each wanted generation's accepted line is (its first in the shards), into `keys`;
    how many lines were torn."""
    start, versions, attempts, file_no = keys.start, keys.versions, keys.attempts, keys.file_no
    size = len(start) - 1
    torn = 0
    for no, offset, line in shard_lines(paths):
        rec = parse_line(line)
        if rec is None or "index" not in rec:
            torn += bool(line.strip())
            continue
        tid = TaskId.read(rec)
        if is_failure(rec) or tid is None or tid.sample >= samples:
            continue
        task, turn = tid.task(samples), tid.turn
        if task >= size:
            continue
        at = start[task] + turn - 1
        if at >= start[task + 1] or file_no[at] != NOT_FOUND:
            continue
        if versions[at] == rec.get("params_version") and attempts[at] == rec.get("attempt"):
            file_no[at], keys.offset[at], keys.length[at] = no, offset, len(line)
    return torn


OPEN_AT_ONCE = 16  # shards held open while lines are copied in task order: a run has thousands


def _lines(paths: list[Path], keys: Accepted) -> Iterator[tuple[int, int, bytes]]:
    """(task, turn, line) of each line found, by task then turn, with at most OPEN_AT_ONCE
    shards open (the least recently read is closed first). A task's lines stop at its first
    wanted turn not found: no turn goes out without the turns before it."""
    fds: OrderedDict[int, int] = OrderedDict()
    try:
        for task, first, end in keys.tasks():
            for at in range(first, end):
                if (file_no := keys.file_no[at]) == NOT_FOUND:
                    break
                if file_no < 0:
                    continue
                if file_no in fds:
                    fds.move_to_end(file_no)
                else:
                    if len(fds) >= OPEN_AT_ONCE:
                        os.close(fds.popitem(last=False)[1])
                    fds[file_no] = os.open(paths[file_no], os.O_RDONLY)
                yield task, at - first + 1, os.pread(fds[file_no], keys.length[at],
                                                     keys.offset[at])
    finally:
        for fd in fds.values():
            os.close(fd)


def truncated(r: redis.Redis, k: RunKeys, dirs: list[str]) -> Iterator[dict[str, Any]]:
    """The last generation of each done conversation that ended cut at max_tokens, read from
    the shards as the export finds it: what `requeue --continue` continues."""
    keys, _ = accepted_keys(r, k, cut=True)
    paths = results.shard_paths(dirs, k.run)
    _pick(paths, keys, runs.samples_of(r, k))
    for _task, _turn, line in _lines(paths, keys):
        yield orjson.loads(line)


def export(r: redis.Redis, k: RunKeys, total: int, dirs: list[str], out: str, *,
           conversations: bool = False, per_turn: bool = False, include_failed: bool = False,
           allow_ambiguous: bool = False) -> results.ExportResult:
    """One line per accepted generation (by task, then turn), or with `conversations` one row
    per done conversation (turns/conversations.py), or with `per_turn` too one per generation;
    with `include_failed`, each failed conversation after its made turns: its reason and how
    many turns it made. Written beside `out`, then renamed into place."""
    info = runs.load(r, k)
    keys, done_raw = accepted_keys(r, k)
    paths = results.shard_paths(dirs, k.run)
    torn = _pick(paths, keys, info.samples)
    missing = keys.missing()
    failed = _failed(r, k, total, info.samples) if include_failed else {}
    write = _Writer(info, done_raw, set(missing), failed,
                    "jsonl" if not conversations else "per_turn" if per_turn else "whole")
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as w:
            for task, lines in _by_task(_lines(paths, keys), failed):
                w.write(write(task, lines))
            w.flush()
            os.fsync(w.fileno())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return results.ExportResult(written=write.written, done=int(r.bitcount(k.done)),
                                missing=missing[:20], torn_lines=torn, shards=len(paths),
                                not_accepted=[], not_accepted_count=0,
                                failed_written=write.failed_written,
                                conversations_missing=len(missing))


def _failed(r: redis.Redis, k: RunKeys, total: int, samples: int) -> dict[int, dict[str, Any]]:
    """Each failed task's record (records.failed_record): its reason's kind, as Redis keeps
    it."""
    tasks = list(bitmap.set_indices(blob(r.get(k.failed)), below=total))
    return {task: failed_record(run=k.run, task=task, samples=samples, error=reason)
            for task, reason in zip(tasks, runs.failure_reasons(r, k, tasks), strict=True)}


def _by_task(lines: Iterator[tuple[int, int, bytes]], failed: dict[int, Any]
             ) -> Iterator[tuple[int, list[bytes]]]:
    """(task, its lines in turn order) of each task with a line or a failure, in order."""
    pending = iter(sorted(failed))
    nxt = next(pending, None)
    task, group = -1, list[bytes]()
    for now, _turn, line in lines:
        if now != task:
            if task >= 0:
                yield task, group
            while nxt is not None and nxt < now:
                if nxt != task:
                    yield nxt, []
                nxt = next(pending, None)
            task, group = now, list[bytes]()
        group.append(line)
    if task >= 0:
        yield task, group
    while nxt is not None:
        if nxt != task:
            yield nxt, []
        nxt = next(pending, None)


class _Writer:
    """What the export writes of one task's lines, in its `shape`: "jsonl" (the lines, as
    they are), "whole" or "per_turn" (turns/conversations.py); a failed task's reason after
    them. Counts the rows and failed tasks written."""

    def __init__(self, info: runs.RunInfo, done_raw: bytes, missing: set[int],
                 failed: dict[int, dict[str, Any]], shape: str) -> None:
        self.info, self.done_raw, self.missing, self.failed = info, done_raw, missing, failed
        self.shape = shape
        self.dataset = open_dataset(info.dataset, info.dataset_version) \
            if shape != "jsonl" else None
        self.written = self.failed_written = 0

    def __call__(self, task: int, lines: list[bytes]) -> bytes:
        reason = self.failed.get(task)
        self.failed_written += reason is not None
        if self.shape == "jsonl":
            self.written += len(lines)
            tail = [orjson.dumps({**reason, "turns": len(lines)}) + b"\n"] if reason else []
            return b"".join(lines + tail)
        if task in self.missing:  # a generation's line was not found: no row can be whole
            return b""
        prompt = self.dataset.prompt(task // self.info.samples)  # type: ignore[union-attr]
        records = [orjson.loads(line) for line in lines]
        samples, done = self.info.samples, bitmap.is_set(self.done_raw, task)
        rows = []
        if self.shape == "per_turn":
            rows = shape.per_turn(prompt, task, samples, records, done)
        elif done and records:
            rows = [shape.whole(prompt, task, samples, records)]
        self.written += len(rows)
        if reason:
            fields = {key: reason[key] for key in ("status", "error", "error_kind")}
            rows.append(shape.failed(prompt, task, samples, records, fields))
        return b"".join(orjson.dumps(row) + b"\n" for row in rows)


def figures(r: redis.Redis, k: RunKeys, total: int) -> dict[str, Any]:
    """What status shows of a `--turns all` run: conversations done of total, being redone
    (a redo set their result aside and they have not settled again) and failed; generations accepted
    (what export writes), turns per done conversation, how the done ones ended (each `ended`
    value conv_end records), at which turn the truncated ones were cut, and the turns whose
    prompt ids did not extend the turn before's (boundary unstable) of those checked. Read from
    per-index bitfields turn.lua keeps, in a few GETs: no conversation's JSON is read."""
    pipe = r.pipeline(transaction=True)
    for key in (k.done, k.conv_made, k.conv_end, k.failed, k.kept):
        pipe.get(key)
    pipe.hmget(k.counters, ["boundary_unstable", "boundary_checked"])
    done_raw, made_raw, end_raw, failed_raw, kept_raw, counters = pipe.execute()
    made, ends, done_raw = _u16(made_raw), _u16(end_raw), blob(done_raw)
    ended: Counter[str] = Counter()
    cut: Counter[int] = Counter()
    done = turns = 0
    for task in bitmap.set_indices(done_raw, below=total):
        code = ends[task] if task < len(ends) else 0
        end, last = END_NAMES.get(code >> TURN_BITS, "complete"), code & ((1 << TURN_BITS) - 1)
        done += 1
        turns += last or (made[task] if task < len(made) else 0) + 1
        ended[end] += 1
        if end == splice.TRUNCATED:
            cut[last] += 1
    failed, redoing = _redoing(done_raw, blob(failed_raw), blob(kept_raw))
    return {"done": done, "redoing": redoing, "failed": failed, "total": total,
            "generations": sum(made) + done,
            "turns_per_conversation": round(turns / done, 2) if done else None,
            "stopped": dict(ended),
            "truncated_by_turn": {str(t): n for t, n in sorted(cut.items())},
            "boundary_unstable": int(counters[0] or 0), "boundary_checked": int(counters[1] or 0)}


def _redoing(done: bytes, failed: bytes, kept: bytes) -> tuple[int, int]:
    """(failed, being redone): a redo set its result aside (kept, redo.lua) and its new attempt
    has not settled, neither done nor failed. As whole numbers, so a million bits cost little."""
    size = max(len(done), len(failed), len(kept))
    d, f, k = (int.from_bytes(raw.ljust(size, b"\0"), "big") for raw in (done, failed, kept))
    return f.bit_count(), (k & ~(d | f)).bit_count()


def _u16(raw: bytes | None) -> array:
    """A BITFIELD of u16 values (big-endian, as Redis keeps them) as an array."""
    raw = blob(raw)
    values = array("H", raw[:len(raw) // 2 * 2])
    if sys.byteorder == "little":
        values.byteswap()
    return values

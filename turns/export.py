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
from pathlib import Path
from typing import Any

import orjson
import redis

from genq.common.data.dataset import open_dataset
from genq.common.data.records import is_failure, parse_line
from genq.common.data.shards import shard_lines
from genq.common.errors import GenqError
from genq.common.queue import bitmap
from genq.common.queue import run as runs
from genq.common.queue.keys import RunKeys
from genq.common.queue.replies import blob
from genq.common.store import export as results
from genq.common.task import task_of
from genq.turns import splice
from genq.turns.state import ATTEMPT, END_NAMES, TURN_BITS, VERSION, Standing

Key = tuple[int, int]  # (params_version, attempt) a generation's line carries


def standings(r: redis.Redis, k: RunKeys) -> dict[int, Standing]:
    """Task -> where its conversation stands, for every conversation begun."""
    return {int(task): Standing.decode(raw) for task, raw in r.hscan_iter(k.conv, count=1000)}


def accepted_keys(r: redis.Redis, k: RunKeys, begun: dict[int, Standing] | None = None
                  ) -> tuple[dict[int, list[Key]], bytes]:
    """(task -> the key of each accepted generation, turn 1 first; the done bitmap); `begun`:
    the standings, if the caller has read them already."""
    accepted, _, done_raw = results.accepted_state(r, k)
    keys: dict[int, list[Key]] = {}
    for task, standing in (standings(r, k) if begun is None else begun).items():
        keys[task] = [(e[VERSION], e[ATTEMPT]) for e in standing.made]
    for task in bitmap.set_indices(done_raw):
        if (last := accepted(task)) is not None:
            keys.setdefault(task, []).append(last)
    return keys, done_raw


def _pick(paths: list[Path], keys: dict[int, list[Key]], samples: int
          ) -> tuple[dict[tuple[int, int], tuple[int, int, int]], int]:
    """(task, turn) -> (file number, offset, length) of its accepted line; torn lines."""
    picks: dict[tuple[int, int], tuple[int, int, int]] = {}
    torn = 0
    for file_no, start, line in shard_lines(paths):
        rec = parse_line(line)
        if rec is None or "index" not in rec:
            torn += bool(line.strip())
            continue
        if is_failure(rec) or type(rec["index"]) is not int:
            continue
        task, turn = task_of(rec, samples), rec.get("turn", 1)
        want = keys.get(task)
        if not want or type(turn) is not int or not 0 < turn <= len(want) \
                or (task, turn) in picks:
            continue
        if want[turn - 1] == (rec.get("params_version"), rec.get("attempt")):
            picks[(task, turn)] = (file_no, start, len(line))
    return picks, torn


OPEN_AT_ONCE = 16  # shards held open while lines are copied in task order: a run has thousands


def _lines(paths: list[Path], picks: dict[tuple[int, int], tuple[int, int, int]]
           ) -> Iterator[tuple[int, int, bytes]]:
    """(task, turn, line) of each pick, by task then turn, with at most OPEN_AT_ONCE shards
    open (the least recently read is closed first)."""
    fds: OrderedDict[int, int] = OrderedDict()
    try:
        for (task, turn), (file_no, offset, length) in sorted(picks.items()):
            if file_no in fds:
                fds.move_to_end(file_no)
            else:
                if len(fds) >= OPEN_AT_ONCE:
                    os.close(fds.popitem(last=False)[1])
                fds[file_no] = os.open(paths[file_no], os.O_RDONLY)
            yield task, turn, os.pread(fds[file_no], length, offset)
    finally:
        for fd in fds.values():
            os.close(fd)


def truncated(r: redis.Redis, k: RunKeys, dirs: list[str]) -> Iterator[dict[str, Any]]:
    """The last generation of each done conversation that ended cut at max_tokens, read from
    the shards as the export finds it: what `requeue --continue` continues."""
    begun = standings(r, k)
    keys, done_raw = accepted_keys(r, k, begun)
    last = {task: s.last for task, s in begun.items()
            if s.end == splice.TRUNCATED and bitmap.is_set(done_raw, task)}
    paths = results.shard_paths(dirs, k.run)
    picks, _ = _pick(paths, {task: keys[task] for task in last if task in keys},
                     runs.samples_of(r, k))
    for _task, _turn, line in _lines(paths, {at: where for at, where in picks.items()
                                             if last[at[0]] == at[1]}):
        yield orjson.loads(line)


def export(r: redis.Redis, k: RunKeys, total: int, dirs: list[str], out: str, *,
           conversations: bool = False, include_failed: bool = False,
           allow_ambiguous: bool = False) -> results.ExportResult:
    """One line per accepted generation (by task, then turn), or with `conversations` one row
    per done conversation: {id, index, [sample,] tools, messages}, its made turns in place of
    the row's and cut where it stopped. Written beside `out`, then renamed into place."""
    if include_failed:
        raise GenqError("--include-failed in a --turns all run: a failed conversation's "
                        "accepted turns are written as any; its reason is in `genq status`")
    info = runs.load(r, k)
    keys, done_raw = accepted_keys(r, k)
    paths = results.shard_paths(dirs, k.run)
    picks, torn = _pick(paths, keys, info.samples)
    missing = sorted({task for task, want in keys.items()
                      for turn in range(1, len(want) + 1) if (task, turn) not in picks})
    done = int(r.bitcount(k.done))
    tmp = f"{out}.tmp-{os.getpid()}"
    written = 0
    try:
        with open(tmp, "wb") as w:
            if conversations:
                written = _conversations(w, _lines(paths, picks), info, done_raw, set(missing))
            else:
                for _task, _turn, line in _lines(paths, picks):
                    w.write(line)
                    written += 1
            w.flush()
            os.fsync(w.fileno())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return results.ExportResult(written=written, done=done, missing=missing[:20],
                                torn_lines=torn, shards=len(paths), not_accepted=[],
                                not_accepted_count=0, failed_written=0)


def _conversations(w: Any, lines: Iterator[tuple[int, int, bytes]], info: runs.RunInfo,
                   done_raw: bytes, missing: set[int]) -> int:
    """Write one row per done conversation whose every line was found; how many."""
    dataset = open_dataset(info.dataset, info.dataset_version)
    written, task = 0, -1
    made: list[dict[str, Any]] = []

    def flush() -> int:
        if task < 0 or task in missing or not bitmap.is_set(done_raw, task):
            return 0
        row = dataset.prompt(task // info.samples)
        messages = splice.prompt(row.messages, len(made), made[:-1]) + made[-1:]
        out: dict[str, Any] = {"id": row.id if row.id is not None else row.index,
                               "index": row.index}
        if info.samples > 1:
            out["sample"] = task % info.samples
        out.update(tools=row.tools, messages=messages)
        w.write(orjson.dumps(out) + b"\n")
        return 1

    for now, _turn, line in lines:
        if now != task:
            written += flush()
            task, made = now, []
        made.append(splice.message_of(orjson.loads(line)))
    return written + flush()


def figures(r: redis.Redis, k: RunKeys, total: int) -> dict[str, Any]:
    """What status shows of a `--turns all` run: conversations done of total, generations
    accepted (what export writes), turns per done conversation, how they ended, at which turn
    the truncated ones were cut, and the turns whose prompt ids did not extend the turn
    before's (boundary unstable) of those checked. Read from per-index bitfields turn.lua keeps,
    in a few GETs: no conversation's JSON is read."""
    pipe = r.pipeline(transaction=True)
    for key in (k.done, k.conv_made, k.conv_end):
        pipe.get(key)
    pipe.hmget(k.counters, ["boundary_unstable", "boundary_checked"])
    done_raw, made_raw, end_raw, counters = pipe.execute()
    made, ends = _u16(made_raw), _u16(end_raw)
    ended: Counter[str] = Counter()
    cut: Counter[int] = Counter()
    done = turns = 0
    for task in bitmap.set_indices(blob(done_raw), below=total):
        code = ends[task] if task < len(ends) else 0
        end, last = END_NAMES.get(code >> TURN_BITS, "complete"), code & ((1 << TURN_BITS) - 1)
        done += 1
        turns += last or (made[task] if task < len(made) else 0) + 1
        ended[end] += 1
        if end == splice.TRUNCATED:
            cut[last] += 1
    return {"done": done, "total": total, "generations": sum(made) + done,
            "turns_per_conversation": round(turns / done, 2) if done else None,
            "stopped": dict(ended),
            "truncated_by_turn": {str(t): n for t, n in sorted(cut.items())},
            "boundary_unstable": int(counters[0] or 0), "boundary_checked": int(counters[1] or 0)}


def _u16(raw: bytes | None) -> array:
    """A BITFIELD of u16 values (big-endian, as Redis keeps them) as an array."""
    raw = blob(raw)
    values = array("H", raw[:len(raw) // 2 * 2])
    if sys.byteorder == "little":
        values.byteswap()
    return values

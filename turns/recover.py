"""`genq recover` of a `--turns all` run: each conversation's accepted generations rebuilt from
the shard lines, turn by turn, and where it stands written back as turn.lua and ack.lua left it.

A later turn is always made by the same claim as the turn before it or a later one (a redo of
a truncated conversation re-makes its last turn under a newer version; a redo of all starts
again at turn 1; a consumer that took over goes on at the next turn). So a conversation's chain
is: for turn 1, 2, … in order, the newest (params_version, gen, attempt) line of that turn if it
is not older than the line taken for the turn before; it ends at a turn without one, or at the
line that says how the conversation `ended`.

- ended: the conversation is done, its last line the task's result (what ack.lua set), its
  entry {"made": turns 1..n-1, "end", "last": n}, and its messages kept only when that last
  turn was cut at max_tokens (a `--redo truncated` goes on from them), as ack.lua keeps them.
- midway: its entry {"made": turns 1..n} and their messages, so a consumer goes on at n+1.

The recover rules of common/data/recovery.py apply to the lines and the last: a line refused by
an ``--inflight abort`` switch is no line; a `--redo` that covers the last keeps it aside and
the task runs again (from the made turns, or from turn 1 after a redo of all: state.resume).
A `requeue --continue` still pending keeps its partials as a one-turn run's does
(producer/recover.py): a kept conversation's last line, cut at max_tokens, is its partial, so
its cut turn still goes on from it. Not covered: the boundary_unstable/boundary_checked
counters (no line says them). Unlike `rebuild`, this holds each (task, turn)'s newest line in a
dict and reads the shards twice (a third time for pending partials): 350,000 generations of
100,000 conversations took 16 s and 0.55 GiB at peak (`rebuild` of the same
lines: 4.5 s).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis

from genq.common.data import recovery
from genq.common.data.records import is_failure, parse_line
from genq.common.queue.keys import RunKeys, finish_code
from genq.common.task import task_of
from genq.turns import splice, state
from genq.turns.state import Standing

Key = tuple[int, int, int]  # (params_version, gen, attempt): the newest line of a turn stands
BATCH = 1000  # hash fields a round trip when writing conversations back


@dataclass(frozen=True, slots=True)
class Line:
    """One generation's line, as much of it as the chain and the task's result need."""

    key: Key
    result: recovery.Result
    ended: str


@dataclass
class Rebuilt:
    """What `rebuild` decided: the index results (as common/data/recovery.py keeps them), and
    per task its conversation's entry and packed messages."""

    rec: recovery.Recovered
    conv: dict[int, bytes] = field(default_factory=dict)
    msgs: dict[int, bytes] = field(default_factory=dict)


def _read(raw: bytes, samples: int, total: int) -> tuple[int, int, Line, float] | None:
    """(task, turn, line, created_at) of a readable generation's line of this run's; None
    for a torn, failed or foreign one."""
    rec = parse_line(raw)
    if rec is None or is_failure(rec):
        return None
    try:
        version, attempt = int(rec["params_version"]), int(rec["attempt"])
        result = (version, attempt, finish_code(rec.get("finish_reason")),
                  int(rec.get("completion_tokens") or 0), int(rec.get("prompt_tokens") or 0),
                  int(rec.get("cached_tokens") or 0))
        sample, turn = int(rec.get("sample") or 0), int(rec.get("turn") or 1)
        task = task_of({"index": int(rec["index"]), "sample": sample}, samples)
        if not (0 <= sample < samples and 0 <= task < total and turn > 0) \
                or max(map(abs, result)) >= 1 << 63:
            return None
        line = Line((version, int(rec.get("gen") or 0), attempt), result,
                    str(rec.get("ended") or ""))
        return task, turn, line, float(rec.get("created_at") or 0)
    except (KeyError, TypeError, ValueError):
        return None


def _newest(manifest: dict[str, Any], streams: Iterable[Iterable[bytes]],
            out: recovery.Recovered) -> dict[tuple[int, int], Line]:
    """(task, turn) -> its newest line; counts lines, claims and generations into `out`."""
    rules = recovery.Rules(manifest)
    samples, total = int(manifest.get("samples") or 1), int(manifest["total"])
    newest: dict[tuple[int, int], Line] = {}
    for stream in streams:
        for raw in stream:
            out.lines += 1
            read = _read(raw, samples, total)
            if read is None:
                out.skipped += bool(raw.strip()) and not recovery.failure_line(raw)
                continue
            task, turn, line, created_at = read
            out.seen[task], out.attempt[task] = 1, max(out.attempt[task], line.key[2])
            out.newest_gen = max(out.newest_gen, line.key[1])
            if rules.refused(line.key[0], created_at):
                out.refused += 1
                continue
            known = newest.get((task, turn))
            if known is None or line.key > known.key:  # on a tie, the first seen
                newest[(task, turn)] = line
    return newest


def chains(newest: dict[tuple[int, int], Line]) -> dict[int, list[Line]]:
    """Task -> its accepted generations, turn 1 first (the module docstring's rule)."""
    out: dict[int, list[Line]] = {}
    for task in sorted({task for task, turn in newest if turn == 1}):
        chain: list[Line] = []
        while (line := newest.get((task, len(chain) + 1))) is not None \
                and (not chain or line.key >= chain[-1].key):
            chain.append(line)
            if line.ended:
                break
        out[task] = chain
    return out


def _entry(line: Line) -> state.Entry:
    version, attempt, *_ = line.result
    return [version, attempt]


def rebuild(manifest: dict[str, Any],
            streams: Callable[[], Iterable[Iterable[bytes]]]) -> Rebuilt:
    """Every conversation's chain from the shard lines (read twice: the second time for the
    messages the midway and truncated ones go on from)."""
    rules = recovery.Rules(manifest)
    out = Rebuilt(recovery.Recovered(int(manifest["total"])))
    rec = out.rec
    wanted: dict[tuple[int, int], Key] = {}  # (task, turn) -> the key of a message needed
    for task, chain in chains(_newest(manifest, streams(), rec)).items():
        last = chain[-1]
        if not last.ended:
            out.conv[task] = Standing([_entry(line) for line in chain]).encode()
            wanted.update({(task, t): line.key for t, line in enumerate(chain, 1)})
            continue
        rec.stand(task, last.result, last.key[1],
                  kept=rules.covered(last.result[0], last.result[2]))
        made = [_entry(line) for line in chain[:-1]]
        out.conv[task] = Standing(made, end=last.ended, last=len(chain)).encode()
        if last.result[2] == recovery.LENGTH:
            wanted.update({(task, t): line.key for t, line in enumerate(chain[:-1], 1)})
    out.msgs = _messages(manifest, streams(), wanted)
    return out


def _messages(manifest: dict[str, Any], streams: Iterable[Iterable[bytes]],
              wanted: dict[tuple[int, int], Key]) -> dict[int, bytes]:
    """Task -> pack() of the wanted turns' assistant messages, turn 1 first."""
    samples, total = int(manifest.get("samples") or 1), int(manifest["total"])
    found: dict[tuple[int, int], dict[str, Any]] = {}
    for stream in streams:
        for raw in stream:
            read = _read(raw, samples, total)
            if read is None or (place := read[:2]) in found \
                    or wanted.get(place) != read[2].key:
                continue
            found[place] = splice.message_of(orjson.loads(raw))
    by_task: dict[int, list[dict[str, Any]]] = {}
    for (task, _turn), message in sorted(found.items()):
        by_task.setdefault(task, []).append(message)
    return {task: state.pack(messages) for task, messages in by_task.items()}


def put(r: redis.Redis, k: RunKeys, rebuilt: Rebuilt | None) -> None:
    """Write the conversations back (none: only delete any a replaced run left), in batches
    before the run's state: no consumer reads them until the run is back."""
    r.delete(k.conv, k.conv_msgs, k.conv_made, k.conv_end)
    if rebuilt is None:
        return
    for key, values in ((k.conv, rebuilt.conv), (k.conv_msgs, rebuilt.msgs)):
        items = list(values.items())
        for at in range(0, len(items), BATCH):
            r.hset(key, mapping=dict(items[at:at + BATCH]))
    # The per-index figures status reads, as turn.lua keeps them.
    tasks = list(rebuilt.conv.items())
    for at in range(0, len(tasks), BATCH):
        pipe = r.pipeline(transaction=False)
        for task, raw in tasks[at:at + BATCH]:
            standing = Standing.decode(raw)
            pipe.execute_command("BITFIELD", k.conv_made, "SET", "u16", f"#{task}",
                                 len(standing.made))
            if standing.end:
                pipe.execute_command("BITFIELD", k.conv_end, "SET", "u16", f"#{task}",
                                     standing.ended())
        pipe.execute()

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
its cut turn still goes on from it. Continued turns count as turn.lua and ack.lua counted
them (a made turn's entry keeps its partial's tokens). Not covered: the boundary_unstable/
boundary_checked counters (no line says them). Unlike `rebuild`, this reads the shards
twice (a third time for pending partials) and holds every line's figures in flat arrays
(`Newest`, about 98 B a line) and each conversation's entry: measured before the continued
column (8 B a line more), 818,306 generations of 100,000
conversations took 13.7 s at 149 MB peak RSS (a dict of tuples a line took 14.8 s at 772 MB;
bench/README.md).
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import orjson
import redis

from genq.common.data import recovery
from genq.common.data.records import is_failure, parse_line
from genq.common.queue.keys import FINISH_NAMES, RunKeys, finish_code
from genq.common.task import TaskId
from genq.common.turns import splice, state
from genq.common.turns.state import Standing

Key = tuple[int, int, int]  # (params_version, gen, attempt): the newest line of a turn stands
BATCH = 1000  # hash fields a round trip when writing conversations back


@dataclass(frozen=True, slots=True)
class Line:
    """One generation's line, as much of it as the chain and the task's result need."""

    key: Key
    result: recovery.Result
    ended: str
    cont: int = 0  # tokens of the partial a `requeue --continue` continued it from


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
        tid = TaskId.read(rec)
        gen = int(rec.get("gen") or 0)
        if tid is None or not (tid.sample < samples and tid.task(samples) < total) \
                or max(map(abs, (*result, gen))) >= 1 << 63:
            return None
        task, turn = tid.task(samples), tid.turn
        cont = int((rec.get("continued_from") or {}).get("tokens") or 0)
        return task, turn, Line((version, gen, attempt), result, str(rec.get("ended") or ""),
                                cont), float(rec.get("created_at") or 0)
    except (KeyError, TypeError, ValueError):
        return None


class Newest:
    """Every readable, unrefused line's figures, one slot a line in flat arrays (about 98
    bytes a line, not a dict entry and three tuples), and once `settle` ran, the newest line of
    each (task, turn): task's turn t is at win[start[task] + t - 1], -1 where it has none."""

    FIELDS = ("task", "turn", "version", "gen", "attempt", "finish", "completion", "prompt",
              "cached", "cont")

    def __init__(self, total: int) -> None:
        self.total = total
        self.cols = {name: array("q") for name in self.FIELDS}
        self.ended = array("i")  # into labels; 0: ""
        self.labels, self.names = [""], {"": 0}
        self.start, self.win = array("q"), array("q")

    def add(self, task: int, turn: int, line: Line) -> None:
        values = (task, turn, *line.key, *line.result[2:], line.cont)
        for column, value in zip(self.cols.values(), values, strict=True):
            column.append(value)
        if line.ended not in self.names:
            self.names[line.ended] = len(self.labels)
            self.labels.append(line.ended)
        self.ended.append(self.names[line.ended])

    def key(self, i: int) -> Key:
        cols = self.cols
        return cols["version"][i], cols["gen"][i], cols["attempt"][i]

    def line(self, i: int) -> Line:
        cols = self.cols
        version, attempt = cols["version"][i], cols["attempt"][i]
        result = (version, attempt, cols["finish"][i], cols["completion"][i],
                  cols["prompt"][i], cols["cached"][i])
        return Line((version, cols["gen"][i], attempt), result, self.labels[self.ended[i]],
                    cols["cont"][i])

    def settle(self) -> None:
        """Each (task, turn)'s newest line; a task has a slot for each of its lines, and a
        turn past them is in no chain (turns 1 to t need t lines)."""
        tasks, turns, key = self.cols["task"], self.cols["turn"], self.key
        counts = array("q", bytes(8 * (self.total + 1)))
        for task in tasks:
            counts[task + 1] += 1
        self.start = start = array("q", accumulate(counts))
        self.win = win = array("q", [-1]) * len(tasks)
        for i, task in enumerate(tasks):
            if turns[i] <= start[task + 1] - start[task]:
                at = start[task] + turns[i] - 1
                if win[at] < 0 or key(i) > key(win[at]):  # on a tie, the first seen
                    win[at] = i

    def slot(self, task: int, turn: int) -> int:
        """Where (task, turn)'s newest line is in win; -1 past the task's slots."""
        first = self.start[task]
        return first + turn - 1 if turn <= self.start[task + 1] - first else -1

    def chains(self) -> Iterator[tuple[int, list[int]]]:
        """(task, its accepted generations' lines, turn 1 first) of each task with a turn 1,
        in order (the module docstring's rule)."""
        start, win, ended, key = self.start, self.win, self.ended, self.key
        for task in range(self.total):
            first, end = start[task], start[task + 1]
            if first == end or win[first] < 0:
                continue
            chain: list[int] = []
            for at in range(first, end):
                if (i := win[at]) < 0 or (chain and key(i) < key(chain[-1])):
                    break
                chain.append(i)
                if ended[i]:
                    break
            yield task, chain


def _newest(manifest: dict[str, Any], streams: Iterable[Iterable[bytes]],
            out: recovery.Recovered) -> Newest:
    """Each (task, turn)'s newest line; counts lines, claims and generations into `out`."""
    rules = recovery.Rules(manifest)
    samples, total = int(manifest.get("samples") or 1), int(manifest["total"])
    newest = Newest(total)
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
            if turn < 1 << 62:  # past it, in no chain (and no 64-bit slot)
                newest.add(task, turn, line)
    newest.settle()
    return newest


def _made(rec: recovery.Recovered, lines: list[Line]) -> dict[str, Any]:
    """The made turns' sums (Standing.fig), counted into the run's made:* counters as turn.lua
    counts them."""
    fig: dict[str, Any] = {}
    for line in lines:
        _, _, code, completion, prompt, cached = line.result
        fig = state.counted(fig, prompt, completion, cached, FINISH_NAMES.get(code))
    rec.more.update({"made:ptok_sum": fig.get("p", 0), "made:ctok_sum": fig.get("c", 0),
                     "made:cached_sum": fig.get("k", 0)})
    rec.more.update({f"made:finish:{name}": n for name, n in fig.get("f", {}).items()})
    return fig


def _entry(line: Line, counted: Counter[str]) -> state.Entry:
    """A made turn's entry, as the consumer wrote it; a continued one counts in `counted` as
    turn.lua counted it."""
    version, attempt, *_ = line.result
    if not line.cont:
        return [version, attempt]
    counted[f"continued|{version}"] += 1
    counted[f"saved|{version}"] += line.cont
    return [version, attempt, line.cont]


def rebuild(manifest: dict[str, Any],
            streams: Callable[[], Iterable[Iterable[bytes]]]) -> Rebuilt:
    """Every conversation's chain from the shard lines (read twice: the second time for the
    messages the midway and truncated ones go on from)."""
    rules = recovery.Rules(manifest)
    out = Rebuilt(recovery.Recovered(int(manifest["total"])))
    rec = out.rec
    newest = _newest(manifest, streams(), rec)
    wanted = bytearray(len(newest.win))  # 1 at the slot of each turn whose message is needed
    for task, lines in newest.chains():
        chain, first = [newest.line(i) for i in lines], newest.start[task]
        last = chain[-1]
        if not last.ended:
            out.conv[task] = Standing([_entry(line, rec.more) for line in chain],
                                      fig=_made(rec, chain)).encode()
            wanted[first:first + len(chain)] = b"\1" * len(chain)
            continue
        rec.stand(task, last.result, last.key[1],
                  kept=rules.covered(last.result[0], last.result[2]))
        rec.cont[task] = last.cont  # counted as ack.lua counts it, once it stands
        made = [_entry(line, rec.more) for line in chain[:-1]]
        out.conv[task] = Standing(made, end=last.ended, last=len(chain),
                                  fig=_made(rec, chain[:-1])).encode()
        if last.result[2] == recovery.LENGTH:
            wanted[first:first + len(made)] = b"\1" * len(made)
    out.msgs = _messages(manifest, streams(), newest, wanted)
    return out


def _messages(manifest: dict[str, Any], streams: Iterable[Iterable[bytes]], newest: Newest,
              wanted: bytearray) -> dict[int, bytes]:
    """Task -> pack() of the wanted turns' assistant messages, turn 1 first."""
    samples, total = int(manifest.get("samples") or 1), int(manifest["total"])
    found: dict[int, tuple[int, dict[str, Any]]] = {}  # slot -> (task, message)
    for stream in streams:
        for raw in stream:
            read = _read(raw, samples, total)
            if read is None or (at := newest.slot(*read[:2])) < 0 or not wanted[at] \
                    or at in found or newest.key(newest.win[at]) != read[2].key:
                continue
            found[at] = read[0], splice.message_of(orjson.loads(raw))
    by_task: dict[int, list[dict[str, Any]]] = {}
    for _at, (task, message) in sorted(found.items()):
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

"""Which result stands for each index, decided from a run manifest and the shard lines alone,
and writing that state back into Redis (`genq recover`). The rules are Redis's own:
- a result older than a requeue with ``--inflight abort`` and written after it never stood;
- of the rest, the newest (params_version, generation, attempt) stands, unless a ``--redo``
  issued with a newer version covers it (``truncated``: it ended with ``length``; ``all``:
  any): then it is kept aside and the index runs again. Each recover starts a new generation
  (``gen`` in later lines), telling its claims from older ones under the same attempt.

``rebuild`` reads shard line streams (local files, S3) in about 50 bytes an index."""

from __future__ import annotations

import sys
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar, cast

import orjson
import redis

from genq.common.data.records import is_failure, parse_line
from genq.common.params import REDO_SCOPES
from genq.common.queue import bitmap
from genq.common.queue.keys import FINISH_NAMES, PER_INDEX_BITS, RUNS, RunKeys, finish_code
from genq.common.queue.run import preallocate
from genq.common.task import task_of

# (params_version, attempt, finish code, completion_tokens, prompt_tokens, cached prompt tokens)
Result = tuple[int, int, int, int, int, int]
LENGTH = finish_code("length")
_NONE, _STANDING, _KEPT = 0, 1, 2
V = TypeVar("V")


def _where(flags: bytearray, value: int) -> Iterator[int]:
    """The positions holding ``value``, in order (found in C)."""
    needle = bytes([value])
    pos = flags.find(needle)
    while pos >= 0:
        yield pos
        pos = flags.find(needle, pos + 1)


class _View(Mapping[int, V]):
    """index -> value, for the indices whose flag is ``flag``; the values are read from arrays."""

    def __init__(self, flags: bytearray, flag: int, value: Callable[[int], V]) -> None:
        self._flags, self._flag, self._value = flags, flag, value

    def __getitem__(self, index: int) -> V:
        if type(index) is not int or not 0 <= index < len(self._flags) \
                or self._flags[index] != self._flag:
            raise KeyError(index)
        return self._value(index)

    def __iter__(self) -> Iterator[int]:
        return _where(self._flags, self._flag)

    def __len__(self) -> int:
        return self._flags.count(self._flag)


class Recovered:
    """What ``rebuild`` decided, per index of the data set (0 ≤ index < total), in flat arrays."""

    def __init__(self, total: int = 0) -> None:
        self.state = bytearray(total)  # _NONE, _STANDING or _KEPT
        self.columns = [array("q", bytes(8 * total)) for _ in range(6)]  # one per Result field
        self.seen = bytearray(total)  # 1 where an index was claimed
        self.attempt = array("q", bytes(8 * total))  # the highest attempt seen
        self.gen = array("q", bytes(8 * total))  # the generation of the result kept
        self.cont = array("q", bytes(8 * total))  # tokens of the partial it continued
        self.newest_gen = 0  # the highest generation in any line
        self.standing = _View(self.state, _STANDING, self._row)  # index -> the Result that stands
        self.kept = _View(self.state, _KEPT, self._row)  # set aside by a redo, not done
        self.claims = _View(self.seen, 1, self.attempt.__getitem__)  # index -> highest attempt
        self.lines = 0
        self.skipped = 0  # torn, unparsable, or outside the data set
        self.refused = 0  # written after an abort switch under older parameters
        # Counters beside the results' own, which recovery_turns.py adds for a --turns all run:
        # its made turns' sums (turn.lua's made:*) and its continued turns before the last.
        self.more: Counter[str] = Counter()

    def stand(self, index: int, result: Result, gen: int, *, kept: bool = False) -> None:
        """Set the result of ``index`` from outside ``rebuild`` (a conversation's last
        generation: common/data/recovery_turns.py); ``kept``: set aside by a redo, not done."""
        for column, value in zip(self.columns, result, strict=True):
            column[index] = value
        self.gen[index], self.state[index] = gen, _KEPT if kept else _STANDING

    def _row(self, index: int) -> Result:
        return cast(Result, tuple(column[index] for column in self.columns))


class Rules:
    """The manifest's history turned into two questions about one result."""

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.redo_marks = redo_marks(manifest["history"])
        # (version, time) of every switch that refused older results from then on.
        self.aborts = sorted((int(h["version"]), float(h.get("at") or 0))
                             for h in manifest["history"]
                             if h.get("inflight") == "abort" and int(h["version"]) > 1)

    def refused(self, version: int, created_at: float) -> bool:
        """The rule turn.lua and ack.lua apply (common/queue/lua/prelude.lua's `superseded`):
        a result of an older version written at or after an `--inflight abort` switch."""
        return any(v > version and created_at >= at for v, at in self.aborts)

    def covered(self, version: int, code: int) -> bool:
        marks = self.redo_marks
        return version < marks.get("done", 0) or (code == LENGTH
                                                   and version < marks.get("truncated", 0))


def redo_marks(history: list[dict[str, Any]]) -> dict[str, int]:
    """Redo scope -> the newest version a redo of that scope was issued with."""
    marks: dict[str, int] = {}
    for h in history:
        for scope in REDO_SCOPES.get(h.get("redo") or "", ()):
            marks[scope] = max(marks.get(scope, 0), int(h["version"]))
    return marks


def _light(line: bytes, samples: int = 1) -> tuple[int, Result, float, int, int] | None:
    rec = parse_line(line)
    if rec is None or is_failure(rec):
        return None
    try:
        result = (int(rec["params_version"]), int(rec["attempt"]),
                  finish_code(rec.get("finish_reason")), int(rec.get("completion_tokens") or 0),
                  int(rec.get("prompt_tokens") or 0), int(rec.get("cached_tokens") or 0))
        if min(result) < -(1 << 63) or max(result) >= 1 << 63:
            return None  # no 64-bit counter holds it: not a line genq wrote
        if (task := task_of(rec, samples)) is None:
            return None  # not a task of this run's
        return (task, result, float(rec.get("created_at") or 0),
                int(rec.get("gen") or 0), int((rec.get("continued_from") or {}).get("tokens") or 0))
    except (KeyError, TypeError, ValueError):
        return None


def failure_line(line: bytes) -> bool:
    """A failed task's line: no result, and not unreadable either (read again: they are few)."""
    rec = parse_line(line)
    return rec is not None and is_failure(rec)


def rebuild(manifest: dict[str, Any], streams: Iterable[Iterable[bytes]]) -> Recovered:
    """Every index's standing (or kept) result from every line of every shard stream."""
    rules, total = Rules(manifest), int(manifest["total"])
    samples = int(manifest.get("samples") or 1)
    out = Recovered(total)
    state, columns, seen, claimed = out.state, out.columns, out.seen, out.attempt
    versions, attempts, gens = columns[0], columns[1], out.gen
    for stream in streams:
        for line in stream:
            out.lines += 1
            parsed = _light(line, samples)
            if parsed is None or not 0 <= parsed[0] < total:
                out.skipped += bool(line.strip()) and not failure_line(line)
                continue
            index, result, created_at, gen, cont = parsed
            seen[index], claimed[index] = 1, max(claimed[index], result[1])  # claimed starts at 0
            out.newest_gen = max(out.newest_gen, gen)
            if rules.refused(result[0], created_at):
                out.refused += 1
                continue
            if state[index] == _NONE:
                state[index] = _STANDING
            elif (result[0], gen, result[1]) <= (versions[index], gens[index], attempts[index]):
                continue  # the newest (version, gen, attempt) stands; on a tie, the first seen
            for column, value in zip(columns, result, strict=True):
                column[index] = value
            gens[index], out.cont[index] = gen, cont
    # The newest result decides: if a redo covers it, the index is not done and the result is
    # only kept (an older one cannot stand in for it: it was superseded when this one was).
    finish = columns[2]
    for index in _where(state, _STANDING):
        if rules.covered(versions[index], finish[index]):
            state[index] = _KEPT
    return out


FIELDS = ("acc_version", "acc_attempt", "acc_finish", "acc_tokens", "acc_ptoks", "acc_cached")
# Byte widths of the per-index BITFIELDs, from the one table the Lua scripts' layout follows.
WIDTHS = {name: PER_INDEX_BITS[name] // 8 for name in (*FIELDS, "claims", "acc_cont")}


def _packed(values: Iterable[int], width: int) -> bytes:
    """Big-endian unsigned ``width``-byte values, saturated as BITFIELD ... SAT would."""
    top = (1 << (8 * width)) - 1
    code = next(c for c in "BHIL" if array(c).itemsize == width)
    out = array(code, [v if v <= top else top for v in values])
    if sys.byteorder == "little":
        out.byteswap()
    return out.tobytes()


def _bitfields(rec: Recovered) -> dict[str, bytes]:
    """Each per-index field as BITFIELD keeps it (big-endian), at full size."""
    columns = {**dict(zip(FIELDS, rec.columns, strict=True)), "claims": rec.attempt,
               "acc_cont": rec.cont}
    return {name: _packed(column, WIDTHS[name]) for name, column in columns.items()}


def pending_continuations(manifest: dict[str, Any],
                          rec: Recovered) -> dict[int, tuple[int, int, int]]:
    """index -> (version, attempt, gen) of each truncated result a `requeue --continue` of the
    current version set aside and no answer replaced yet: the partials it still needs."""
    if int(manifest.get("continues") or 0) != int(manifest["params_version"]):
        return {}
    return {i: (row[0], row[1], rec.gen[i]) for i, row in rec.kept.items() if row[2] == LENGTH}


def _counters(rec: Recovered) -> tuple[dict[str, int], Counter]:
    """The run's counters and completion-length histogram over the standing results."""
    finish, ctoks, ptoks, cached = rec.columns[2:]
    names = Counter(FINISH_NAMES.get(finish[i], "other") for i in rec.standing)
    counters = {f"finish:{name}": n for name, n in names.items()}
    counters["ctok_sum"] = sum(ctoks[i] for i in rec.standing)
    counters["ptok_sum"] = sum(ptoks[i] for i in rec.standing)
    counters["cached_sum"] = sum(cached[i] for i in rec.standing)
    for i in rec.standing:  # answers `requeue --continue` continued, as ack.lua counts them
        if rec.cont[i]:
            version = rec.columns[0][i]
            counters[f"continued|{version}"] = counters.get(f"continued|{version}", 0) + 1
            counters[f"saved|{version}"] = counters.get(f"saved|{version}", 0) + rec.cont[i]
    for field, n in rec.more.items():
        counters[field] = counters.get(field, 0) + n
    return counters, Counter(ctoks[i] for i in rec.standing)


def restore(pipe: redis.client.Pipeline, k: RunKeys, manifest: dict[str, Any],
            rec: Recovered, out_dirs: list[str]) -> None:
    """Queue the writes that put the run back, meta last, onto a MULTI pipeline."""
    total = int(manifest["total"])
    counters, hist = _counters(rec)
    finish = rec.columns[2]
    # Every key of the run's state (not heartbeats or rate buckets).
    pipe.delete(k.done, k.failed, k.pending, k.truncated, k.kept, k.leases, k.lease_owner,
                k.claims, k.spent, k.tries, k.acc_attempt, k.acc_version, k.acc_tokens, k.acc_ptoks,
                k.acc_cont, k.acc_cached, k.acc_finish, k.counters, k.length_hist, k.errors,
                k.fail_kind, k.fail_kinds, k.params, k.params_version, k.params_floor,
                k.params_history, k.redo_marks, k.rq_queue, k.rq_wip)
    pipe.set(k.done, bitmap.encode(rec.standing, total))
    pipe.set(k.truncated, bitmap.encode((i for i in rec.standing if finish[i] == LENGTH), total))
    if rec.kept:
        pipe.set(k.kept, bitmap.encode(rec.kept, total))
    for name, data in _bitfields(rec).items():
        pipe.set(getattr(k, name), data)
    preallocate(pipe, k, total)  # the others, empty, at their final size too
    # redis-py's `mapping` type (an invariant union key) rejects dict[str, int] (here and below).
    pipe.hset(k.counters, mapping=counters)  # type: ignore[arg-type]
    if hist:
        pipe.hset(k.length_hist, mapping=dict(hist))
    pipe.hset(k.params, mapping={v: orjson.dumps(p) for v, p in manifest["params"].items()})
    pipe.set(k.params_version, int(manifest["params_version"]))
    if manifest.get("params_floor"):
        pipe.set(k.params_floor, int(manifest["params_floor"]))
    pipe.rpush(k.params_history, *[orjson.dumps(h) for h in manifest["history"]])
    marks = redo_marks(manifest["history"])
    if marks:
        pipe.hset(k.redo_marks, mapping=marks)  # type: ignore[arg-type]
    if out_dirs:
        pipe.sadd(k.outdirs, *out_dirs)
    pipe.sadd(RUNS, k.run)
    pipe.sadd(k.rq_queues, k.rq_queue)
    # The epoch last: services waiting for the run see it back only with everything else.
    pipe.hset(k.meta, mapping={
        "dataset": manifest["dataset"], "fingerprint": manifest["fingerprint"],
        "total": total, "queue": k.queue_name, "created_at": manifest.get("created_at") or 0,
        "epoch": manifest["epoch"], "recovered_at": time.time(),
        "gen": max(int(manifest.get("gen") or 0), rec.newest_gen) + 1,
        "continues": int(manifest.get("continues") or 0),
        **{key: manifest[key] for key in ("rows", "samples", "dataset_version", "turns")
           if key in manifest}})

"""Which result stands for each index, decided from a run manifest and the shard lines alone,
and writing that state back into Redis as if the run had never stopped (`genq recover`).

The rules are the ones Redis applies while the run lives:
- a result whose parameter version is older than a requeue with ``--inflight abort`` and that
  was written after that switch was refused by its ack: it never stood;
- a result of an older version than a ``--redo`` whose scope covers it (``truncated``: it ended
  with ``length``; ``all``: any) was set aside by the redo, even if it was accepted after the
  redo was issued;
- of what remains, the newest (params_version, attempt) decides: it stands, or, if a redo
  covers it, it is kept aside and the index runs again.

``rebuild`` takes the manifest and shard line streams from anywhere (local files, S3).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis

from common.data.records import parse_line
from common.params import REDO_SCOPES
from common.queue import bitmap
from common.queue.keys import FINISH_NAMES, PER_INDEX_BITS, RUNS, RunKeys, finish_code

# (params_version, attempt, finish code, completion_tokens, prompt_tokens)
Result = tuple[int, int, int, int, int]
LENGTH = finish_code("length")


@dataclass
class Recovered:
    standing: dict[int, Result] = field(default_factory=dict)
    kept: dict[int, Result] = field(default_factory=dict)  # set aside by a redo, not done
    claims: dict[int, int] = field(default_factory=dict)  # highest attempt seen per index
    lines: int = 0
    skipped: int = 0  # torn, unparsable, or outside the data set
    refused: int = 0  # written after an abort switch under older parameters


class Rules:
    """The manifest's history turned into two questions about one result."""

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.redo_marks = redo_marks(manifest["history"])
        # (version, time) of every switch that refused older results from then on.
        self.aborts = sorted((int(h["version"]), float(h.get("at") or 0))
                             for h in manifest["history"]
                             if h.get("inflight") == "abort" and int(h["version"]) > 1)

    def refused(self, version: int, created_at: float) -> bool:
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


def _light(line: bytes) -> tuple[int, Result, float] | None:
    rec = parse_line(line)
    if rec is None:
        return None
    try:
        result = (int(rec["params_version"]), int(rec["attempt"]),
                  finish_code(rec.get("finish_reason")), int(rec.get("completion_tokens") or 0),
                  int(rec.get("prompt_tokens") or 0))
        return int(rec["index"]), result, float(rec.get("created_at") or 0)
    except (KeyError, TypeError, ValueError):
        return None


def rebuild(manifest: dict[str, Any], streams: Iterable[Iterable[bytes]]) -> Recovered:
    """Every index's standing (or kept) result from every line of every shard stream."""
    rules, total, out = Rules(manifest), int(manifest["total"]), Recovered()
    for stream in streams:
        for line in stream:
            out.lines += 1
            parsed = _light(line)
            if parsed is None or not 0 <= parsed[0] < total:
                out.skipped += bool(line.strip())
                continue
            index, result, created_at = parsed
            out.claims[index] = max(out.claims.get(index, 0), result[1])
            if rules.refused(result[0], created_at):
                out.refused += 1
                continue
            best = out.standing.get(index)
            if best is None or result[:2] > best[:2]:
                out.standing[index] = result
    # The newest result decides: if a redo covers it, the index is not done and the result is
    # only kept (an older one cannot stand in for it: it was superseded when this one was).
    for index in [i for i, r in out.standing.items() if rules.covered(r[0], r[2])]:
        out.kept[index] = out.standing.pop(index)
    return out


FIELDS = ("acc_version", "acc_attempt", "acc_finish", "acc_tokens", "acc_ptoks")
# Byte widths of the per-index BITFIELDs, from the one table the Lua scripts' layout follows.
WIDTHS = {name: PER_INDEX_BITS[name] // 8 for name in (*FIELDS, "claims")}


def _bitfields(results: dict[int, Result], claims: dict[int, int], size: int) -> dict:
    """Each per-index field as the bytes Redis's BITFIELD keeps (big-endian, #index)."""
    out = {name: bytearray(size * width) for name, width in WIDTHS.items()}
    def put(name: str, index: int, value: int) -> None:
        width = WIDTHS[name]
        value = min(value, (1 << (8 * width)) - 1)  # saturate as BITFIELD ... SAT would
        out[name][index * width:(index + 1) * width] = value.to_bytes(width, "big")

    for index, result in results.items():
        for name, value in zip(FIELDS, result, strict=True):
            put(name, index, value)
    for index, attempt in claims.items():
        put("claims", index, attempt)
    return out


def _counters(standing: dict[int, Result]) -> tuple[dict[str, int], Counter]:
    names = Counter(FINISH_NAMES.get(r[2], "other") for r in standing.values())
    counters = {f"finish:{name}": n for name, n in names.items()}
    counters["ctok_sum"] = sum(r[3] for r in standing.values())
    counters["ptok_sum"] = sum(r[4] for r in standing.values())
    return counters, Counter(r[3] for r in standing.values())


def state_keys(k: RunKeys) -> list[str]:
    """Every key of the run's state that recovery rewrites (not heartbeats or rate buckets)."""
    return [k.done, k.failed, k.pending, k.truncated, k.kept, k.leases, k.lease_owner,
            k.claims, k.spent, k.acc_attempt, k.acc_version, k.acc_tokens, k.acc_ptoks,
            k.acc_finish, k.counters, k.length_hist, k.errors, k.params, k.params_version,
            k.params_floor, k.params_history, k.redo_marks, k.rq_queue, k.rq_wip]


def restore(pipe: redis.client.Pipeline, k: RunKeys, manifest: dict[str, Any],
            rec: Recovered, out_dirs: list[str]) -> None:
    """Queue the writes that put the run back, meta last, onto a MULTI pipeline."""
    total = int(manifest["total"])
    both = {**rec.kept, **rec.standing}
    fields = _bitfields(both, rec.claims, max([*both, *rec.claims], default=-1) + 1)
    counters, hist = _counters(rec.standing)
    pipe.delete(*state_keys(k))
    pipe.set(k.done, bitmap.encode(rec.standing, total))
    pipe.set(k.truncated, bitmap.encode((i for i, r in rec.standing.items() if r[2] == LENGTH),
                                        total))
    if rec.kept:
        pipe.set(k.kept, bitmap.encode(rec.kept, total))
    for name, data in fields.items():
        if data:
            pipe.set(getattr(k, name), bytes(data))
    # redis-py types `mapping` with a union key type, and Mapping's key is invariant: no
    # dict[str, int] matches it, though hset takes one (here and below).
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
        "epoch": manifest["epoch"], "recovered_at": time.time()})

"""A run's registration in Redis: its data set, fingerprint, size and identity."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from redis.typing import EncodableT, FieldT

from genq.common.errors import DatasetError, UsageError
from genq.common.queue.keys import PER_INDEX_BITS, RUNS, RunKeys
from genq.common.queue.replies import blob, text

# A run's --turns: LAST makes one answer a row (its final assistant turn, or the next); ALL
# makes every assistant turn in order (consumer/turns.py).
LAST, ALL = "last", "all"


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    dataset: str
    fingerprint: str
    total: int
    # A fresh token per registration, so services notice a run re-created under its name.
    epoch: str
    gen: int  # the run's generation: each `genq recover` starts the next one
    samples: int = 1  # answers a prompt: task t is row t // samples, sample t % samples
    dataset_version: str | None = None  # an S3 data set's ETag: every node copies that version
    turns: str = LAST  # which assistant turns a row's answers are (LAST or ALL)


def register(r: redis.Redis, k: RunKeys, dataset: str, fingerprint: str, rows: int,
             samples: int = 1, version: str | None = None, *, turns: str = LAST) -> RunInfo:
    """Create the run of rows × samples tasks, or check that an existing run is on the same data
    set (of the same S3 `version`) with as many samples a prompt and the same turns."""
    path = dataset if dataset.startswith("s3://") else os.path.abspath(dataset)
    total = rows * samples
    fields: dict[FieldT, EncodableT] = {
        "dataset": path, "fingerprint": fingerprint, "total": total, "queue": k.queue_name,
        "created_at": time.time(), "epoch": secrets.token_hex(8)}
    if samples > 1:  # a run of one sample a prompt keeps the meta it always had
        fields.update(rows=rows, samples=samples)
    if version:
        fields["dataset_version"] = version
    if turns != LAST:  # likewise: a run of the default keeps its meta, and reads as LAST
        fields["turns"] = turns
    # HSETNX on the fingerprint makes two producers racing to register agree on one data set.
    if r.hsetnx(k.meta, "fingerprint", fingerprint):
        pipe = r.pipeline(transaction=False)
        pipe.hset(k.meta, mapping=fields)
        pipe.sadd(RUNS, k.run)
        preallocate(pipe, k, total)
        pipe.execute()
    info = load(r, k)
    if info.fingerprint != fingerprint:
        raise DatasetError(f"run {k.run!r} is registered with data set {info.dataset} "
                           f"(fingerprint {info.fingerprint[:16]}); {path} differs: use another "
                           "--run for a new data set")
    if version and info.dataset_version and info.dataset_version != version:
        raise DatasetError(f"run {k.run!r} is registered with version {info.dataset_version} "
                           f"of {path}; the bucket now holds {version}: put that version back, "
                           "or use another --run for the new one")
    if info.samples != samples:
        raise UsageError(f"run {k.run!r} has {info.samples} samples a prompt, not {samples}: "
                         "give its --samples, or another --run")
    if info.turns != turns:
        raise UsageError(f"run {k.run!r} makes --turns {info.turns}, not {turns}: give its "
                         "--turns, or another --run")
    return info


def preallocate(pipe: redis.client.Pipeline, k: RunKeys, total: int) -> None:
    """Queue the creation of each per-index key not there yet, at its final size."""
    for name, bits in PER_INDEX_BITS.items():
        pipe.set(getattr(k, name), bytes((total * bits + 7) // 8), nx=True)


def load(r: redis.Redis, k: RunKeys) -> RunInfo:
    meta = {text(key): text(value) for key, value in r.hgetall(k.meta).items()}
    if "total" not in meta:
        raise UsageError(f"unknown run {k.run!r}: start it with `genq produce DATASET`, or "
                         f"if Redis lost it, rebuild it with `genq recover --shards DIR`")
    return RunInfo(dataset=meta["dataset"], fingerprint=meta["fingerprint"],
                   total=int(meta["total"]), epoch=meta["epoch"], gen=int(meta.get("gen") or 0),
                   samples=int(meta.get("samples") or 1),
                   dataset_version=meta.get("dataset_version") or None,
                   turns=meta.get("turns") or LAST)


def samples_of(r: redis.Redis, k: RunKeys) -> int:
    """The run's samples a prompt (1 for a run made before samples, or of one)."""
    return int(r.hget(k.meta, "samples") or 1)


class Ends:
    """Says each end of a run once: when first seen finished, and after each requeue."""

    def __init__(self) -> None:
        self.seen: int | None = None  # the version last seen finished; None: not finished

    def new(self, finished: bool, version: int) -> bool:
        said, self.seen = self.seen, version if finished else None
        return finished and said != version


def finished(r: redis.Redis, k: RunKeys, total: int) -> bool:
    """Every prompt done or failed, nothing queued or leased (until a requeue brings work)."""
    pipe = r.pipeline(transaction=False)
    pipe.bitcount(k.done)
    pipe.bitcount(k.failed)
    pipe.llen(k.rq_queue)
    pipe.zcard(k.leases)
    done, failed, queued, leased = pipe.execute()
    return int(done) + int(failed) >= total and not queued and not leased


OK, LOST, REPLACED = "ok", "lost", "replaced"

# A consumer checks its run every 0.5 s and beats every 1 s, through an outage too: this long
# after Redis (re)starts, every live one following a run it forgot has said so (with margin for a
# loaded node). Before then, their silence proves nothing.
SETTLE_S = 8


def unsettled_s(r: redis.Redis) -> int:
    """Seconds until Redis has been up SETTLE_S (0 once it has, or when INFO is not allowed)."""
    try:
        uptime = int(r.info("server")["uptime_in_seconds"])
    except redis.ResponseError:
        return 0
    return max(0, SETTLE_S - uptime)


def judge(current: str | None, epoch: str) -> str:
    """OK while Redis holds the run of `epoch`, LOST once it forgot it, REPLACED once another
    took its name."""
    return LOST if current is None else OK if current == epoch else REPLACED


NO_REASON = "(no reason recorded)"


def failure_reasons(r: redis.Redis, k: RunKeys, indices: Sequence[int]) -> list[str]:
    """The reason each of these failed indices (ascending) failed for, as fail_kind names it."""
    if not indices:
        return []
    lo = indices[0]
    numbers = blob(r.getrange(k.fail_kind, lo, indices[-1]))
    names = {int(n): text(kind) for kind, n in r.hgetall(k.fail_kinds).items()}
    names.update({0: NO_REASON, 255: "(one of many other reasons)"})
    return [names.get(numbers[i - lo] if i - lo < len(numbers) else 0, NO_REASON)
            for i in indices]

"""A run's registration in Redis: its data set, fingerprint and size, checked on every use."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import redis

from common.errors import DatasetError, UsageError
from common.keys import PER_INDEX_BITS, RUNS, RunKeys


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    run: str
    dataset: str
    fingerprint: str
    total: int


def register(r: redis.Redis, k: RunKeys, dataset: str, fingerprint: str, total: int) -> RunInfo:
    """Create the run, or check that an existing run is on the same data set."""
    path = os.path.abspath(dataset)
    fields = {"dataset": path, "fingerprint": fingerprint, "total": total,
              "queue": k.queue_name, "created_at": time.time()}
    # HSETNX on the fingerprint makes two producers racing to register agree on one data set.
    if r.hsetnx(k.meta, "fingerprint", fingerprint):
        r.hset(k.meta, mapping=fields)
        r.sadd(RUNS, k.run)
        preallocate(r, k, total)
    info = load(r, k)
    if info.fingerprint != fingerprint:
        raise DatasetError(
            f"run {k.run!r} is registered with data set {info.dataset} (fingerprint "
            f"{info.fingerprint[:16]}); {path} differs: use another --run for a new data set"
        )
    return info


def preallocate(r: redis.Redis, k: RunKeys, total: int) -> None:
    """Create the per-index bitmaps and bitfields at their final size (see PER_INDEX_BITS)."""
    pipe = r.pipeline(transaction=False)
    for name, bits in PER_INDEX_BITS.items():
        pipe.set(getattr(k, name), bytes((total * bits + 7) // 8), nx=True)
    pipe.execute()


def load(r: redis.Redis, k: RunKeys) -> RunInfo:
    meta = {key.decode(): value.decode() for key, value in r.hgetall(k.meta).items()}
    if "total" not in meta:
        raise UsageError(f"unknown run {k.run!r}: start it with `genq produce DATASET`")
    return RunInfo(run=k.run, dataset=meta["dataset"], fingerprint=meta["fingerprint"],
                   total=int(meta["total"]))


def settled_count(r: redis.Redis, k: RunKeys) -> tuple[int, int]:
    """(done, failed) from the bitmaps, read together."""
    pipe = r.pipeline(transaction=False)
    pipe.bitcount(k.done)
    pipe.bitcount(k.failed)
    done, failed = pipe.execute()
    return int(done), int(failed)

"""Finding unfinished indices and enqueueing them as RQ jobs: the producer's core, shared with
consumers so a run can top itself up."""

from __future__ import annotations

import itertools
import pickle
import zlib
from collections.abc import Iterator

import redis

from genq.common.errors import RunStateLost
from genq.common.queue import bitmap
from genq.common.queue.keys import RunKeys
from genq.common.queue.scripts import ScriptRunner, enqueue_call
from genq.common.queue.tasks import FUNC

ENQUEUE_BATCH = 1000


def free_indices(r: redis.Redis, k: RunKeys, total: int) -> Iterator[int]:
    """Indices neither done, failed nor pending, in order (a snapshot; enqueue re-checks)."""
    pipe = r.pipeline(transaction=False)
    for key in (k.done, k.failed, k.pending):
        pipe.get(key)
    return bitmap.clear_indices(bitmap.union(pipe.execute(), total), total)


def enqueue(r: redis.Redis, k: RunKeys, indices: list[int], runner: ScriptRunner,
            epoch: str = "") -> int:
    """Enqueue these indices (skipping settled or pending ones); how many. RunStateLost if the
    run in Redis is not of `epoch`."""
    count = 0
    for start in range(0, len(indices), ENQUEUE_BATCH):
        # RQ's data field is zlib(pickle((func, instance, args, kwargs))), as Job.to_dict writes.
        jobs = [(i, zlib.compress(pickle.dumps((FUNC, None, (i,), {}))), f"{FUNC}({i})")
                for i in indices[start:start + ENQUEUE_BATCH]]
        added = int(runner(enqueue_call(k, jobs, epoch)))
        if added < 0:
            raise RunStateLost(f"run {k.run!r} is no longer in Redis as epoch {epoch}")
        count += added
    return count


def top_up(r: redis.Redis, k: RunKeys, total: int, want: int, runner: ScriptRunner,
           epoch: str = "") -> int:
    """Bring up to `want` more unfinished indices into the queue; returns how many."""
    picked = list(itertools.islice(free_indices(r, k, total), want))
    return enqueue(r, k, picked, runner, epoch) if picked else 0

"""A consumer's heartbeat and RQ worker entry, expiring if it dies; `run_state` in beats keeps a
producer from registering a lost run anew."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from genq.common.queue.keys import RunKeys
from genq.common.queue.scripts import iso_now

HEARTBEAT_TTL_S = 15
RQ_WORKER_TTL_S = 30
# A consumer silent this long is dead (killed, host lost): its entries are pruned so the
# consumers set and rq's worker sets do not grow with every consumer a long run ever had.
PRUNE_AFTER_S = 4 * RQ_WORKER_TTL_S


async def announce(r: aioredis.Redis, k: RunKeys, name: str, now: int, beat: dict[str, Any],
                   *, birth: str, held: list[str]) -> None:
    """Refresh both entries in one round trip; prune dead consumers' entries when seen."""
    worker = k.rq_worker(name)
    pipe = r.pipeline(transaction=False)
    pipe.set(k.consumer(name), orjson.dumps(beat), ex=HEARTBEAT_TTL_S)
    pipe.zadd(k.consumers, {name: now})
    pipe.hset(worker, mapping={
        "birth": birth, "last_heartbeat": iso_now(), "queues": k.queue_name,
        "pid": os.getpid(), "hostname": socket.gethostname(),
        "state": "busy" if held else "idle", "successful_job_count": beat.get("acked", 0)})
    if held:
        pipe.hset(worker, "current_job", held[0])  # rq reads one job id; this shows the first
    else:
        # rq-dashboard fetches any current_job it finds: "" made its Workers tab answer 500.
        pipe.hdel(worker, "current_job")
    pipe.expire(worker, RQ_WORKER_TTL_S)
    pipe.sadd(k.rq_workers, worker)
    pipe.sadd(k.rq_workers_of_queue, worker)
    pipe.zrangebyscore(k.consumers, "-inf", now - PRUNE_AFTER_S)
    dead = (await pipe.execute())[-1]
    if dead:
        pipe = r.pipeline(transaction=False)
        forget(pipe, k, [d.decode() for d in dead])
        await pipe.execute()


def forget(pipe: Pipeline, k: RunKeys, names: list[str]) -> None:
    workers = [k.rq_worker(name) for name in names]
    pipe.zrem(k.consumers, *names)
    pipe.srem(k.rq_workers, *workers)
    pipe.srem(k.rq_workers_of_queue, *workers)


async def withdraw(r: aioredis.Redis, k: RunKeys, name: str) -> None:
    pipe = r.pipeline(transaction=False)
    forget(pipe, k, [name])
    pipe.delete(k.consumer(name), k.rq_worker(name))
    await pipe.execute()


async def record_server(r: aioredis.Redis, k: RunKeys, server: str, context_length: int | None,
                        capacity: int) -> None:
    """What a server said about itself, kept after its consumers go: `genq requeue` checks
    max_tokens against it."""
    entry = {"context_length": context_length, "capacity": capacity, "at": int(time.time())}
    await r.hset(k.servers, server, orjson.dumps(entry))

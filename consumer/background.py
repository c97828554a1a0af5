"""A consumer's background loops, beside its slots: lease renewal, and housekeeping (the run's
state, the parameter version, the reaper, the heartbeat, the queue top-up, the server's load).
Each runs under consumer/shutdown.py's supervisor: Redis trouble is ridden out here, anything
else stops the consumer."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import TYPE_CHECKING

import orjson
import structlog

from common.errors import REDIS_TROUBLE, RunStateLost
from common.queue import feed
from consumer import presence
from consumer.follow import follow_load, follow_server, unconfirmed
from consumer.reuse import refresh
from consumer.runstate import OK, REPLACED

if TYPE_CHECKING:
    from consumer.worker import Consumer

logger = structlog.get_logger("consumer")


async def keep_leases(c: Consumer) -> None:
    """Renew every held lease each third of the visibility timeout; drop the lost ones."""
    period = c.s.visibility_timeout / 3
    while not c.finished:
        await asyncio.sleep(period)
        held = list(c.held.values())
        try:
            lost = await c.q.renew([i.lease for i in held])
        except REDIS_TROUBLE as e:
            logger.warning("renew_failed", error=str(e))
            continue
        for inflight in held:
            if inflight.lease.job_id in lost:
                c.abort(inflight, "lost")

async def housekeeping(c: Consumer) -> None:
    """Heartbeat, reaper, parameter-version watch and server load, about once a second; the
    server's context and the capacity of a server without a load endpoint every 2.5 s."""
    tick = 0
    while not c.finished:
        try:
            if await check_run(c) != OK:
                await heartbeat(c)
                await asyncio.sleep(0.5)
                continue
            await watch_version(c)
            if tick % 2 == 0:
                await c.q.reap()
                await heartbeat(c)
                await top_up(c)
            if tick % 2 == 0 or unconfirmed(c):
                await follow_load(c)  # the slot count follows the server's load
            if tick % 5 == 0:
                await follow_server(c)  # the server's context (and capacity without a load)
        except REDIS_TROUBLE as e:
            logger.warning("housekeeping_failed", error=str(e))
        tick += 1
        await asyncio.sleep(0.5)

async def check_run(c: Consumer) -> str:
    was = c.runstate.state
    state = await c.runstate.check(c.r)
    if state != OK and was == OK:
        # Redis forgot these leases with the run: free the server now. A result written
        # after `genq recover` would share its attempt number with the index's next claim.
        c.abort_all("lost")
    if state == REPLACED:
        c.halt()  # cached parameters and data set are another run's: stop
    elif state == OK and was != OK:
        c.params.clear()  # versions may have been renumbered by a later requeue
        c.version = 0
    return state

async def top_up(c: Consumer) -> None:
    """Queue more unfinished prompts when the queue runs low, so the server stays full
    after a redo or when no producer is running; the enqueue script prevents doubles."""
    if await c.r.llen(c.k.rq_queue) >= c.capacity:
        return
    try:
        added = await asyncio.to_thread(feed.top_up, c.sync, c.k, c.total,
                                        2 * c.capacity, c.sync_scripts,
                                        epoch=c.runstate.epoch)
    except RunStateLost:
        return  # the run vanished since this tick's check; the next check says so
    if added:
        logger.debug("topped_up", jobs=added)

async def watch_version(c: Consumer) -> None:
    version = int(await c.r.get(c.k.params_version) or 1)
    if version <= c.version:
        return
    previous, c.version = c.version, version
    await c.runstate.keep_manifest(c.sync)
    if not previous:
        return
    last = await c.r.lindex(c.k.params_history, -1)
    policy = orjson.loads(last).get("inflight", "abort") if last else "abort"
    logger.info("params_changed", version=version, inflight=policy)
    if policy == "abort":
        for inflight in list(c.held.values()):
            if inflight.lease.version < version:
                c.abort(inflight, f"parameters changed to version {version}")

async def heartbeat(c: Consumer) -> None:
    now = (await c.r.time())[0]
    c.started_at = c.started_at or now
    beat = {"name": c.s.name, "server": c.s.server, "capacity": c.capacity,
            "inflight": len(c.held), "load": c.load,
            "load_history": list(c.load_history), "host": socket.gethostname(),
            "pid": os.getpid(), "acked": c.acked, "started_at": c.started_at,
            "context_length": c.context_length, "out": os.path.abspath(c.s.out),
            "run_state": c.runstate.state, "probe_kept": await refresh(c)}
    await presence.announce(c.r, c.k, c.s.name, now, beat, birth=c.birth,
                            held=list(c.held))

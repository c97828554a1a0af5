"""Which SGLang server a consumer drives: each server has one lease in Redis, so identical
replicas (``--scale consumer=N``) need no per-replica configuration.

A consumer is given a list of servers (``--server`` repeated, or ``GENQ_SERVERS``) and takes
the first one nobody drives. The lease is a Redis string with a TTL, renewed every third of its
length and deleted on exit; a consumer that dies (SIGKILL, OOM, lost host) stops renewing, the
key expires, and a spare waiting for any of the servers takes it over within the lease time.
While it waits, a spare drives nothing: two consumers on one server would each keep the
server's full capacity in flight and show as one row in the status table.

The lease is per server, not per run: a server's capacity is shared by every run on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace

import redis.asyncio as aioredis
import structlog

from common.cli import SERVICE_SOCKET_TIMEOUT_S
from common.errors import REDIS_TROUBLE
from common.log import REDIS_OUTAGE
from common.queue.keys import RunKeys, server_lease
from consumer.settings import ConsumeSettings

logger = structlog.get_logger("consumer")

# Keep the lease if it is still ours; take it back if it expired meanwhile (Redis was away
# longer than the lease and nobody else took the server); refuse if another consumer holds it.
RENEW = """
local owner = redis.call('GET', KEYS[1])
if owner == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if not owner then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]); return 1 end
return 0
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

Serve = Callable[[ConsumeSettings], Awaitable[int]]


def parse_servers(text: str | None) -> list[str]:
    """GENQ_SERVERS: URLs separated by commas and/or whitespace, in order of preference."""
    return [u.rstrip("/") for u in re.split(r"[,\s]+", text or "") if u]


def owner_of(token: bytes | str | None) -> str:
    """The readable part of a lease token: consumer name and run."""
    if token is None:
        return "nobody"
    parts = (token.decode() if isinstance(token, bytes) else token).split("|")
    return f"{parts[0]} (run {parts[1]})" if len(parts) > 1 else parts[0]


async def try_take(r: aioredis.Redis, urls: list[str], token: str,
                   lease_s: float) -> tuple[str | None, dict[str, str]]:
    """The first free server, now leased to `token`; else None and who drives each one."""
    owners: dict[str, str] = {}
    for url in urls:
        if await r.set(server_lease(url), token, nx=True, px=int(lease_s * 1000)):
            return url, {}
        owners[url] = owner_of(await r.get(server_lease(url)))
    return None, owners


async def settled(r: aioredis.Redis, k: RunKeys) -> bool:
    """Every prompt of the run is done or failed (a spare in --burst mode then has no job)."""
    total = await r.hget(k.meta, "total")
    if total is None:
        return False
    return int(await r.bitcount(k.done)) + int(await r.bitcount(k.failed)) >= int(total)


async def acquire(r: aioredis.Redis, s: ConsumeSettings, token: str) -> str | None:
    """Lease one of the servers, waiting as a spare while all are driven. None: stop asked
    (SIGTERM/SIGINT) or, with --burst, the run settled while waiting."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        url: str | None = None
        owners: dict[str, str] = {}
        with contextlib.suppress(*REDIS_TROUBLE):  # a blip: the loop below tries again
            url, owners = await try_take(r, list(s.servers), token, s.server_lease)
        last: dict[str, str] = {}
        while url is None:
            if owners and owners != last:
                # Said once per change, not every poll: a spare may wait for days.
                event = "server_busy" if len(owners) == 1 else "spare_waiting"
                logger.warning(event, driven_by=owners, lease_s=s.server_lease)
                last = owners
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=min(1.0, s.server_lease / 3))
            if stop.is_set():
                return None
            try:
                if s.burst and await settled(r, RunKeys(s.run)):
                    logger.info("run_settled", spare=True)
                    return None
                url, owners = await try_take(r, list(s.servers), token, s.server_lease)
            except REDIS_TROUBLE as e:
                REDIS_OUTAGE.seen(e)
        logger.info("server_leased", leased=url, lease_s=s.server_lease, took_over=bool(last))
        return url
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def keep(r: aioredis.Redis, url: str, token: str, lease_s: float,
               lost: asyncio.Event) -> None:
    """Renew every third of the lease. If another consumer holds the server now (this one was
    frozen or cut off from Redis past the lease), stop driving it: SIGTERM ourselves, so the
    consumer gives its work back exactly as when a supervisor stops it."""
    ms = int(lease_s * 1000)
    while True:
        await asyncio.sleep(lease_s / 3)
        try:
            kept = await r.eval(RENEW, 1, server_lease(url), token, ms)
        except REDIS_TROUBLE as e:
            REDIS_OUTAGE.seen(e)
            continue
        if not kept:
            logger.error("server_lease_lost", driven_by=owner_of(await r.get(server_lease(url))))
            lost.set()
            os.kill(os.getpid(), signal.SIGTERM)
            return


async def supervised(keeping: Awaitable[None]) -> None:
    """The lease keeper rides out Redis trouble itself; anything else is a bug that would leave
    the server driven without a lease (a spare would take it): log it and stop the consumer."""
    try:
        await keeping
    except Exception:
        logger.exception("background_task_crashed", task="server_lease",
                         consequence="the consumer stops and gives its tasks back")
        os.kill(os.getpid(), signal.SIGTERM)


async def drive(s: ConsumeSettings, serve: Serve) -> int:
    """Lease a server, run `serve` on it while renewing the lease, release it on the way out.
    Exit code 3 when the lease was lost, so a supervisor restarts this replica as a spare."""
    if s.share_server:
        structlog.contextvars.bind_contextvars(server=s.server)
        return await serve(s)
    r = aioredis.Redis.from_url(s.redis_url, socket_connect_timeout=5,
                                socket_timeout=SERVICE_SOCKET_TIMEOUT_S)
    token = f"{s.name}|{s.run}|{uuid.uuid4().hex}"
    try:
        url = await acquire(r, s, token)
        if url is None:
            return 0
        structlog.contextvars.bind_contextvars(server=url)
        lost = asyncio.Event()
        keeper = asyncio.create_task(supervised(keep(r, url, token, s.server_lease, lost)))
        try:
            code = await serve(replace(s, server=url))
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            with contextlib.suppress(*REDIS_TROUBLE):
                if await r.eval(RELEASE, 1, server_lease(url), token):
                    logger.info("server_released")
        return 3 if lost.is_set() else code
    finally:
        await r.aclose()

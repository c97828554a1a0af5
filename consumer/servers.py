"""Which SGLang server a consumer drives: one lease per server in Redis (not per run), so that
identical replicas need no configuration of their own; a spare waits, driving nothing."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import structlog

from genq.common.cli import SERVICE_SOCKET_TIMEOUT_S
from genq.common.errors import REDIS_TROUBLE
from genq.common.log import REDIS_OUTAGE
from genq.common.queue.keys import RunKeys, server_lease
from genq.common.queue.replies import text
from genq.common.queue.scripts import ScriptRunner, expire_call, reap_call, server_call
from genq.common.report import runhealth
from genq.consumer import shutdown
from genq.consumer.settings import ConsumeSettings

logger = structlog.get_logger("consumer")

def identity(url: str) -> str:
    """The server as every node names it: a loopback URL names a server on this node only, so it
    is qualified by the host's name (``http://127.0.0.1:30000#node-a``): two nodes' servers on
    the same local port are two servers. Any other URL already names one server."""
    host = urlsplit(url).hostname or ""
    try:
        local = ipaddress.ip_address(host).is_loopback or ipaddress.ip_address(host).is_unspecified
    except ValueError:
        local = host == "localhost" or host.endswith(".localhost")
    return f"{url}#{socket.gethostname()}" if local else url


def owner_of(token: bytes | str | None) -> str:
    """The readable part of a lease token: consumer name and run."""
    if token is None:
        return "nobody"
    parts = text(token).split("|")
    return f"{parts[0]} (run {parts[1]})" if len(parts) > 1 else parts[0]


def process_start(pid: int) -> str | None:
    """When a process started (/proc/PID/stat field 22), or None if there is none or it is a
    zombie (dead, only not reaped yet by its parent: it drives nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return ""  # cannot tell: taken as alive
    fields = stat.rsplit(")", 1)[-1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def pid_space() -> str:
    """Where a pid means the same process: this host, this boot, this pid namespace."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""  # not Linux: no holder can be proved gone
    return f"{socket.gethostname()}/{boot}/{namespace}"


def new_token(name: str, run: str) -> str:
    """name|run|pid space|pid|process start|random: enough to prove later its holder gone."""
    pid = os.getpid()
    return f"{name}|{run}|{pid_space()}|{pid}|{process_start(pid)}|{uuid.uuid4().hex}"


def provably_gone(token: bytes | str | None) -> bool:
    """The holder ran in this pid space and its process is gone: no need to wait its lease out."""
    if not token:
        return False
    parts = text(token).split("|")
    if len(parts) < 6 or not parts[2] or parts[2] != pid_space() or not parts[3].isdigit():
        return False
    pid = int(parts[3])
    if pid == os.getpid():
        return True  # this very process holds no lease yet: the pid was its predecessor's
    started = process_start(pid)
    return started is None or (started != "" and started != parts[4])


class Held:
    """Whether our server lease is surely ours now: until one lease after the start of the last
    call that took or renewed it (Redis counts the expiry from later). Past that (frozen, cut
    off) a spare may have taken the server, so nothing is claimed until a renewal succeeds."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s, self.until = lease_s, 0.0

    def renewed(self, since: float) -> None:
        self.until = since + self.lease_s

    def __call__(self) -> bool:
        return time.monotonic() < self.until


async def try_take(r: aioredis.Redis, s: ConsumeSettings, token: str, *, free: bool = True
                   ) -> tuple[str | None, dict[str, str], str | None]:
    """(first server taken, now ours, dead holder taken from), else (None, who drives each).
    A server with no lease is taken only when `free`; one whose holder is provably gone is."""
    owners: dict[str, str] = {}
    ms = int(s.server_lease * 1000)
    for url in s.servers:
        lease = server_lease(identity(url))
        if free and await r.set(lease, token, nx=True, px=ms):
            return url, {}, None
        holder = await r.get(lease)
        if holder is not None and provably_gone(holder) and await ScriptRunner(r)(
                server_call("server_take", lease, holder=text(holder), token=token, ms=ms)):
            return url, {}, text(holder)
        owners[url] = owner_of(holder)
    return None, owners, None


async def end_leases_of(r: aioredis.Redis, k: RunKeys, url: str, predecessor: str) -> None:
    """A dead predecessor's tasks (running and claimed ahead) go back to the queue now."""
    if predecessor.split("|")[1] != k.run:
        return  # another run's consumer: its leases live in that run and expire there
    runner = ScriptRunner(r)
    ended = await runner(expire_call(k, identity(url)))
    returned = await runner(reap_call(k))
    logger.info("server_taken_over", predecessor=owner_of(predecessor), leases_ended=ended,
                tasks_returned=len(returned))


async def settled(r: aioredis.Redis, k: RunKeys) -> bool:
    """Every prompt of the run is done or failed (a spare in --burst mode then has no job)."""
    total = await r.hget(k.meta, "total")
    return total is not None and (
        int(await r.bitcount(k.done)) + int(await r.bitcount(k.failed)) >= int(total))


async def acquire(r: aioredis.Redis, s: ConsumeSettings, token: str,
                  held: Held) -> str | None:
    """Lease one of the servers, waiting as a spare while all are driven; None when stopped or
    (--burst) the run settled. A spare takes a server with no lease only after Redis held the
    same run for a whole lease, so a live holder renews first; one whose holder is provably gone
    at its next poll."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reaper, k = ScriptRunner(r), RunKeys(s.run)
    try:
        taken: tuple[str | None, dict[str, str], str | None] = (None, {}, None)
        tried = time.monotonic()
        with contextlib.suppress(*REDIS_TROUBLE):  # a blip: the loop below tries again
            taken = await try_take(r, s, token)
        url, owners, predecessor = taken
        last: dict[str, str] = {}
        seen, since = None, 0.0  # the run as Redis last answered, and since when
        while url is None:
            if owners and owners != last:
                # Said once per change, not every poll: a spare may wait for days.
                event = "server_busy" if len(owners) == 1 else "spare_waiting"
                logger.warning(event, driven_by=owners, lease_s=s.server_lease)
                last = owners
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(1.0, s.server_lease / 3)):
                    await stop.wait()
            if stop.is_set():
                return None
            try:
                run = await r.hmget(k.meta, ["epoch", "recovered_at"])
                if run != seen:
                    seen, since = run, time.monotonic()
                    if run[0] is None:
                        logger.warning("spare_waiting_for_run", reason=f"run {k.run!r} is not "
                                       "in Redis: no server is taken until it is",
                                       command=runhealth.recover_command(k.run, []))
                if run[0] is None:
                    continue
                if s.burst and await settled(r, k):
                    logger.info("run_settled", spare=True)
                    return None
                # A spare reaps while it waits: a dead consumer's tasks come back at the end
                # of their visibility timeout even when no other process of the run reaps.
                await reaper(reap_call(k))
                tried = time.monotonic()
                url, owners, predecessor = await try_take(
                    r, s, token, free=time.monotonic() - since >= s.server_lease)
            except REDIS_TROUBLE as e:
                seen = None
                REDIS_OUTAGE.seen(e)
        held.renewed(tried)
        logger.info("server_leased", leased=url, lease_s=s.server_lease,
                    took_over=bool(last or predecessor))
        if predecessor:
            with contextlib.suppress(*REDIS_TROUBLE):  # else the leases expire as usual
                await end_leases_of(r, k, url, predecessor)
        return url
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def keep(r: aioredis.Redis, name: str, token: str, held: Held, lost: asyncio.Event) -> None:
    """Renew every third of the lease; once another holds it, or on a bug, SIGTERM ourselves (the
    work goes back)."""
    ms, runner, pause = int(held.lease_s * 1000), ScriptRunner(r), held.lease_s / 3
    try:
        while not lost.is_set():
            await asyncio.sleep(pause)
            pause, since = held.lease_s / 3, time.monotonic()
            try:
                kept = await runner(server_call("server_renew", server_lease(name),
                                                token=token, ms=ms))
            except REDIS_TROUBLE as e:
                REDIS_OUTAGE.seen(e)
                pause = min(pause, 1.0)  # claims may wait for this renewal: try again soon
                continue
            if kept:
                held.renewed(since)
            else:
                holder = await r.get(server_lease(name))
                logger.error("server_lease_lost", driven_by=owner_of(holder))
                lost.set()
    except Exception:
        logger.exception("background_task_crashed", task="server_lease",
                         consequence="the consumer stops and gives its tasks back")
    os.kill(os.getpid(), signal.SIGTERM)


async def drive(s: ConsumeSettings,
                serve: Callable[[ConsumeSettings, Callable[[], bool]], Awaitable[int]]) -> int:
    """Lease a server, run `serve` on it (told whether the lease is surely still ours), release
    it; exit code 3 when the lease was lost (restart as a spare)."""
    if s.share_server:
        structlog.contextvars.bind_contextvars(server=identity(s.server))
        return await serve(replace(s, server_id=identity(s.server)), lambda: True)
    r = aioredis.Redis.from_url(s.redis_url, socket_connect_timeout=5,
                                socket_timeout=SERVICE_SOCKET_TIMEOUT_S)
    token, held = new_token(s.name, s.run), Held(s.server_lease)
    try:
        url = await acquire(r, s, token, held)
        if url is None:
            return 0
        name = identity(url)
        structlog.contextvars.bind_contextvars(server=name)
        lost = asyncio.Event()
        keeper = asyncio.create_task(keep(r, name, token, held, lost))
        try:
            code = await serve(replace(s, server=url, server_id=name), held)
        finally:
            await shutdown.cancel_and_wait([keeper])
            with contextlib.suppress(*REDIS_TROUBLE):
                if await ScriptRunner(r)(server_call("server_release", server_lease(name),
                                                     token=token)):
                    logger.info("server_released")
        return 3 if lost.is_set() else code
    finally:
        await r.aclose()

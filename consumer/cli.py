"""`genq consume --server URL`: wire settings, Redis, the data set, the output shard and the
SGLang client together, then run the consumer until the run is settled or a signal comes."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import signal
import socket
import tempfile
import time

import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff

from common import log
from common.cli import (
    SERVICE_SOCKET_TIMEOUT_S,
    add_common,
    add_redis_wait,
    connect,
    guarded,
    risky_redis_settings,
    run_keys,
    stop_on_signals,
)
from common.data import manifest as manifests
from common.data.dataset import open_dataset
from common.data.shard_repair import repair_shards
from common.data.shards import ShardWriter
from common.errors import GenqError, ServerUnavailable
from common.queue import run as runs
from common.sglang.client import SGLang
from consumer import runstate, servers, shipping
from consumer.servers import parse_servers
from consumer.settings import ConsumeSettings
from consumer.worker import Consumer

logger = structlog.get_logger("consumer")
# Redis connections of one consumer: its calls are short Lua scripts, so a few dozen keep up
# with thousands of slots.
REDIS_CONNECTIONS = 64


def parse(argv: list[str] | None) -> ConsumeSettings:
    p = argparse.ArgumentParser(prog="genq consume", description=__doc__)
    p.add_argument("--server", action="append", default=[],
                   help="SGLang base URL, e.g. http://gpu0:30000; repeatable: the consumer "
                        "leases one that no other consumer drives (env GENQ_SERVERS, a list)")
    p.add_argument("--server-lease", type=float, default=15.0,
                   help="seconds a dead consumer keeps its server from spares (default 15)")
    p.add_argument("--share-server", action="store_true",
                   help="drive the first server even if another consumer already does")
    p.add_argument("--concurrency", type=int,
                   help="requests kept in flight (default: the server's max_running_requests)")
    p.add_argument("--visibility-timeout", type=float, default=15.0,
                   help="task lease length in seconds, renewed every third of it; a consumer "
                        "that dies unseen has its tasks back this long after (default 15)")
    p.add_argument("--out", default="out", help="directory for output shards (default ./out)")
    p.add_argument("--burst", action="store_true",
                   help="exit once every prompt of the run is done or failed")
    p.add_argument("--max-attempts", type=int, default=3,
                   help="attempts before a task goes to the failed registry (default 3)")
    p.add_argument("--request-timeout", type=float, default=3600.0,
                   help="longest one generation may take, in seconds (default 3600)")
    p.add_argument("--stall-timeout", type=float, default=60.0,
                   help="seconds a streamed answer may stay silent before the server is "
                        "taken as hung and the task given back (default 60)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGTERM (default 10)")
    p.add_argument("--server-wait", type=float, default=10.0,
                   help="seconds to wait for the server to answer at start (default 10)")
    p.add_argument("--name", help="consumer name shown in status (default host-pid)")
    p.add_argument("--poll", type=float, default=0.2, help="idle poll period, seconds")
    shipping.add_flags(p)
    add_redis_wait(p, "--burst")
    add_common(p)
    a = p.parse_args(argv)
    if a.concurrency is not None and a.concurrency < 1:
        p.error("--concurrency must be >= 1")
    if a.stall_timeout <= 0 or a.request_timeout <= 0:
        p.error("--stall-timeout and --request-timeout must be > 0")
    if a.visibility_timeout <= 0 or a.max_attempts < 1:
        p.error("--visibility-timeout must be > 0 and --max-attempts >= 1")
    urls = [u.rstrip("/") for u in a.server] or parse_servers(os.environ.get("GENQ_SERVERS"))
    if not urls:
        p.error("--server URL (or GENQ_SERVERS) is required")
    for url in urls:
        if not re.match(r"^https?://", url):
            p.error(f"--server {url!r} must be an http:// or https:// URL")
    if a.server_lease <= 0:
        p.error("--server-lease must be > 0")
    name = a.name or f"{socket.gethostname()}-{os.getpid()}"
    return ConsumeSettings(
        redis_url=a.redis_url, run=a.run, server=urls[0],
        concurrency=a.concurrency, visibility_timeout=a.visibility_timeout, out=a.out,
        burst=a.burst, max_attempts=a.max_attempts, request_timeout=a.request_timeout,
        grace=a.grace, name=name, poll=a.poll, server_wait=a.server_wait,
        redis_wait=a.redis_wait, stall_timeout=a.stall_timeout,
        servers=tuple(urls), server_lease=a.server_lease, share_server=a.share_server,
        **shipping.settings(p, a))


@guarded
def main(argv: list[str] | None = None) -> int:
    s = parse(argv)
    log.setup()
    structlog.contextvars.bind_contextvars(run=s.run)
    check_writable(s.out)
    # Started before Redis (compose, restart loops): wait for it here, before the server
    # lease below needs it; a stop while waiting exits cleanly with nothing claimed.
    probe = connect(s.redis_url, socket_timeout=SERVICE_SOCKET_TIMEOUT_S, wait=True,
                    stop=stop_on_signals(), give_up_after=s.redis_wait if s.burst else None)
    if probe is None:
        logger.info("consumer_stopped", acked=0)
        return 0
    probe.close()
    quiet_gc()
    # One free server of the list, leased for as long as serve() runs (consumer/servers.py).
    return asyncio.run(servers.drive(s, serve))


def check_writable(out: str) -> None:
    """An output directory this user cannot write fails at start, in one line naming the fix,
    before anything is claimed (not as a traceback from the first shard or manifest)."""
    path = os.path.abspath(out)
    while not os.path.isdir(path):  # made later; its nearest existing parent must allow that
        path = os.path.dirname(path)
    try:
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        uid = os.getuid()
        raise GenqError(f"cannot write to the output directory {out} as uid {uid}: {e.strerror}; "
                        f"make it writable by uid {uid} (e.g. chown {uid} on the host) or "
                        "choose another --out") from None


def quiet_gc() -> None:
    """Each task allocates short-lived objects by the hundred; with Python's default thresholds
    the cyclic collector makes a full collection every ~1,000 tasks, walking everything
    start-up loaded. What is loaded by now stays out of collections, and the youngest
    generation is collected every 10,000 allocations instead of 700."""
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


async def wait_for_server(server: SGLang, s: ConsumeSettings) -> tuple[int, str, int | None]:
    """Wait (up to --server-wait) until the server is warm, then read what it is."""
    deadline = time.monotonic() + s.server_wait
    while True:
        try:
            await server.health()
            capacity = s.concurrency or await server.capacity()
            if not capacity:
                raise GenqError(f"{s.server} reports no max_running_requests in /v1/loads or "
                                "/get_server_info; pass --concurrency")
            return capacity, await server.model(), await server.context_length()
        except ServerUnavailable as e:
            if time.monotonic() >= deadline:
                raise GenqError(f"cannot reach SGLang server {s.server}: {e}") from None
            logger.info("waiting_for_server", error=str(e))
            await asyncio.sleep(1.0)


async def serve(s: ConsumeSettings) -> int:
    k = run_keys(s.run)
    stopped = stop_on_signals()  # until the loop's own handlers take over, below
    sync = connect(s.redis_url, socket_timeout=SERVICE_SOCKET_TIMEOUT_S, wait=True,
                   stop=stopped, give_up_after=s.redis_wait if s.burst else None)
    if sync is None:  # stopped while waiting for Redis; nothing was claimed
        logger.info("consumer_stopped", acked=0)
        return 0
    info = runs.load(sync, k)
    for risk in risky_redis_settings(sync):
        logger.warning("redis_settings", risk=risk)
    dataset = open_dataset(info.dataset)
    dataset.verify(info.fingerprint)
    runstate.check_outdir(sync, k, s.out, info.epoch)
    manifests.upkeep(sync, k, [s.out], info.epoch)  # before the first shard line exists
    for path, cut in repair_shards(s.out, s.run):
        logger.warning("torn_tail_repaired", shard=str(path), bytes_removed=cut)
    writer = ShardWriter(s.out, s.run, s.name, rotate_every=s.shard_records)
    sync.sadd(k.outdirs, os.path.abspath(s.out))
    server = SGLang(s.server, request_timeout=s.request_timeout,
                    stall_timeout=s.stall_timeout)
    # A blocking pool: slots wait for a free connection. redis-py's default pool raises "Too
    # many connections" past 100, and a server without --max-running-requests can ask for
    # thousands of slots.
    pool = aioredis.BlockingConnectionPool.from_url(
        s.redis_url, max_connections=REDIS_CONNECTIONS, timeout=None, socket_connect_timeout=5,
        socket_timeout=SERVICE_SOCKET_TIMEOUT_S,
        retry=AsyncRetry(NoBackoff(), 1))  # see service_retry
    client = aioredis.Redis(connection_pool=pool)
    ship = shipping.Shipping.start(s, k, writer, client)
    rc = 0
    try:
        capacity, model, context = await wait_for_server(server, s)
        consumer = Consumer(s, client, k, sync=sync, total=info.total, dataset=dataset,
                            sink=writer, server=server, capacity=capacity, model=model,
                            runstate=runstate.RunState(k, info.epoch, s.out),
                            context_length=context)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, consumer.request_stop)
        if stopped.is_set():  # a signal came while starting up
            consumer.request_stop()
        logger.info("consumer_started", capacity=capacity, model=model, context_length=context,
                    shard=str(writer.path))
        await consumer.run()
        logger.info("consumer_stopped", acked=consumer.acked, crashed=consumer.crashed or None)
        if consumer.runstate.failure:
            raise GenqError(consumer.runstate.failure)
        if ship is not None:
            writer.close()  # the last shard joins the backlog
            rc = await ship.finish(s.ship_wait if s.burst else min(s.ship_wait, s.grace))
    finally:
        if ship is not None:
            await ship.cancel()
        await server.close()
        await client.aclose()
        sync.close()
        writer.close()
        dataset.close()
    return 1 if consumer.crashed else rc

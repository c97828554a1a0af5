"""`genq consume --server URL`: wire settings, Redis, the data set, the output shard and the
SGLang client together, then run the consumer until the run is settled or a signal comes."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import time

import redis.asyncio as aioredis
import structlog

from common import log
from common import run as runs
from common.cli import (
    SERVICE_SOCKET_TIMEOUT_S,
    add_common,
    connect,
    guarded,
    risky_redis_settings,
    run_keys,
)
from common.dataset import open_dataset
from common.errors import GenqError, ServerUnavailable
from common.shards import ShardWriter, repair_shards
from consumer import faults, shipping
from consumer.settings import ConsumeSettings
from consumer.sglang import SGLang
from consumer.worker import Consumer

logger = structlog.get_logger("consumer")


def parse(argv: list[str] | None) -> ConsumeSettings:
    p = argparse.ArgumentParser(prog="genq consume", description=__doc__)
    p.add_argument("--server", required=True, help="SGLang base URL, e.g. http://gpu0:30000")
    p.add_argument("--concurrency", type=int,
                   help="requests kept in flight (default: the server's max_running_requests)")
    p.add_argument("--visibility-timeout", type=float, default=60.0,
                   help="lease length in seconds, renewed every third of it (default 60)")
    p.add_argument("--out", default="out", help="directory for output shards (default ./out)")
    p.add_argument("--burst", action="store_true",
                   help="exit once every prompt of the run is done or failed")
    p.add_argument("--max-attempts", type=int, default=3,
                   help="attempts before a task goes to the failed registry (default 3)")
    p.add_argument("--request-timeout", type=float, default=3600.0,
                   help="read timeout of one generation in seconds (default 3600)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGTERM (default 10)")
    p.add_argument("--server-wait", type=float, default=10.0,
                   help="seconds to wait for the server to answer at start (default 10)")
    p.add_argument("--name", help="consumer name shown in status (default host-pid)")
    p.add_argument("--poll", type=float, default=0.2, help="idle poll period, seconds")
    shipping.add_flags(p)
    add_common(p)
    a = p.parse_args(argv)
    if a.concurrency is not None and a.concurrency < 1:
        p.error("--concurrency must be >= 1")
    if a.visibility_timeout <= 0 or a.max_attempts < 1:
        p.error("--visibility-timeout must be > 0 and --max-attempts >= 1")
    if not re.match(r"^https?://", a.server):
        p.error(f"--server {a.server!r} must be an http:// or https:// URL")
    name = a.name or f"{socket.gethostname()}-{os.getpid()}"
    return ConsumeSettings(
        redis_url=a.redis_url, run=a.run, server=a.server.rstrip("/"),
        concurrency=a.concurrency, visibility_timeout=a.visibility_timeout, out=a.out,
        burst=a.burst, max_attempts=a.max_attempts, request_timeout=a.request_timeout,
        grace=a.grace, name=name, poll=a.poll, server_wait=a.server_wait,
        **shipping.settings(p, a))


@guarded
def main(argv: list[str] | None = None) -> int:
    s = parse(argv)
    log.setup()
    structlog.contextvars.bind_contextvars(run=s.run, server=s.server)
    return asyncio.run(serve(s))


async def wait_for_server(server: SGLang, s: ConsumeSettings) -> tuple[int, str]:
    deadline = time.monotonic() + s.server_wait
    while True:
        try:
            capacity = s.concurrency or await server.capacity()
            if not capacity:
                raise GenqError(f"{s.server} does not report max_running_requests; "
                                "pass --concurrency")
            return capacity, await server.model()
        except ServerUnavailable as e:
            if time.monotonic() >= deadline:
                raise GenqError(f"cannot reach SGLang server {s.server}: {e}") from None
            logger.info("waiting_for_server", error=str(e))
            await asyncio.sleep(1.0)


async def serve(s: ConsumeSettings) -> int:
    k = run_keys(s.run)
    sync = connect(s.redis_url, socket_timeout=SERVICE_SOCKET_TIMEOUT_S)
    info = runs.load(sync, k)
    for risk in risky_redis_settings(sync):
        logger.warning("redis_settings", risk=risk)
    dataset = open_dataset(info.dataset)
    dataset.verify(info.fingerprint)
    for path, cut in repair_shards(s.out, s.run):
        logger.warning("torn_tail_repaired", shard=str(path), bytes_removed=cut)
    writer = ShardWriter(s.out, s.run, s.name, rotate_every=s.shard_records)
    sink = faults.wrap(writer, os.environ.get("GENQ_FAULT"))
    sync.sadd(k.outdirs, os.path.abspath(s.out))
    server = SGLang(s.server, request_timeout=s.request_timeout,
                    connections=s.concurrency or 1024)
    client = aioredis.Redis.from_url(s.redis_url, socket_connect_timeout=5,
                                     socket_timeout=SERVICE_SOCKET_TIMEOUT_S)
    ship = shipping.Shipping.start(s, k, writer, client)
    rc = 0
    try:
        capacity, model = await wait_for_server(server, s)
        consumer = Consumer(s, client, k, sync=sync, total=info.total, dataset=dataset, sink=sink,
                            server=server, capacity=capacity, model=model)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, consumer.request_stop)
        logger.info("consumer_started", capacity=capacity, model=model, shard=str(sink.path))
        await consumer.run()
        logger.info("consumer_stopped", acked=consumer.acked)
        if ship is not None:
            sink.close()  # the last shard joins the backlog
            rc = await ship.finish(s.ship_wait if s.burst else min(s.ship_wait, s.grace))
    finally:
        if ship is not None:
            await ship.cancel()
        await server.close()
        await client.aclose()
        sync.close()
        sink.close()
        dataset.close()
    return rc

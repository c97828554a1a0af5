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
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff

from genq.common import log, params
from genq.common.cli import (
    SERVICE_SOCKET_TIMEOUT_S,
    add_common,
    add_redis_wait,
    connect,
    guarded,
    risky_redis_settings,
    run_keys,
    stop_on_signals,
)
from genq.common.data import manifest as manifests
from genq.common.data.dataset import open_dataset
from genq.common.data.rows import Dataset
from genq.common.data.shard_repair import repair_shards
from genq.common.data.shards import ShardWriter, safe_name
from genq.common.errors import REDIS_TROUBLE, GenqError, ServerUnavailable, UsageError
from genq.common.queue import run as runs
from genq.common.queue.keys import RunKeys
from genq.common.queue.replies import text
from genq.common.report import runhealth
from genq.common.sglang.client import SGLang
from genq.common.store import s3 as store
from genq.common.store.ship import Shipper
from genq.common.task import request_body
from genq.consumer import servers, shutdown
from genq.consumer.runstate import RunState
from genq.consumer.settings import ConsumeSettings
from genq.consumer.structured import invalid_keep
from genq.consumer.worker import Consumer

logger = structlog.get_logger("consumer")
REDIS_CONNECTIONS = 64
MAX_CLAIMS = 254  # claims are counted in a u8 saturating at 255: a limit past 254 never fires


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="genq consume", description=__doc__)
    p.add_argument("--server", action="append", default=[],
                   help="SGLang base URL; repeatable: the consumer leases one no other "
                        "consumer drives (env GENQ_SERVERS, a list)")
    p.add_argument("--server-lease", type=float, default=15.0,
                   help="seconds a dead consumer keeps its server from spares (default 15)")
    p.add_argument("--share-server", action="store_true",
                   help="drive the first server even if another consumer already does")
    p.add_argument("--concurrency", type=int,
                   help="requests kept in flight (default: the server's max_running_requests)")
    p.add_argument("--visibility-timeout", type=float, default=15.0,
                   help="task lease length in seconds, renewed every third of it (default 15)")
    p.add_argument("--out", default="out", help="directory for output shards (default ./out)")
    p.add_argument("--burst", action="store_true",
                   help="exit once every prompt of the run is done or failed")
    p.add_argument("--max-attempts", type=int, default=3,
                   help="attempts before a task goes to the failed registry (default 3)")
    p.add_argument("--max-claims", type=int,
                   help="claims of a task, refunded ones too, before it goes to the failed "
                        f"registry (default 10 x --max-attempts, at most {MAX_CLAIMS})")
    p.add_argument("--request-timeout", type=float, default=3600.0,
                   help="longest one generation may take, in seconds (default 3600)")
    p.add_argument("--stall-timeout", type=float, default=60.0,
                   help="seconds an answer may show no progress (no load change; with "
                        "--stream, no chunk) before the task is given back (default 60)")
    p.add_argument("--stream", action="store_true",
                   help="stream answers: silence seen per answer, fewer tokens/s (docs/SGLANG.md)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGTERM (default 10)")
    p.add_argument("--max-retry-after", type=float, default=60.0, metavar="S",
                   help="longest pause a server's Retry-After may ask, in seconds (default 60)")
    p.add_argument("--server-wait", type=float, default=10.0,
                   help="seconds to wait for the server to answer at start (default 10)")
    p.add_argument("--name", help="consumer name shown in status (default host-pid)")
    p.add_argument("--poll", type=float, default=0.2, help="idle poll period, seconds")
    p.add_argument("--s3-uri", metavar="URI", default=os.environ.get("GENQ_S3_URI") or None,
                   help="ship closed shards to s3://bucket/prefix (env GENQ_S3_URI)")
    p.add_argument("--shard-records", type=int, default=500, metavar="N",
                   help="close a shard after this many records (default 500)")
    p.add_argument("--shard-minutes", type=float, default=10.0, metavar="M",
                   help="with --s3-uri, also close a shard this old (default 10)")
    p.add_argument("--delete-shipped", action="store_true",
                   help="remove a shard's local copy once S3 holds it, verified")
    p.add_argument("--ship-wait", type=float, default=600.0, metavar="S",
                   help="seconds --burst waits at the end for the backlog to ship (default 600)")
    add_redis_wait(p, "--burst")
    add_common(p)
    return p


def parse(argv: list[str] | None) -> ConsumeSettings:
    p = parser()
    a = p.parse_args(argv)
    if a.concurrency is not None and a.concurrency < 1:
        p.error("--concurrency must be >= 1")
    if a.stall_timeout <= 0 or a.request_timeout <= 0 or a.server_lease <= 0:
        p.error("--stall-timeout, --request-timeout and --server-lease must be > 0")
    if a.max_retry_after < 0:
        p.error("--max-retry-after must be >= 0")
    if a.visibility_timeout <= 0 or a.max_attempts < 1:
        p.error("--visibility-timeout must be > 0 and --max-attempts >= 1")
    if a.max_claims is None:
        a.max_claims = min(10 * a.max_attempts, MAX_CLAIMS)
    if not 1 <= a.max_claims <= MAX_CLAIMS:
        p.error(f"--max-claims must be 1-{MAX_CLAIMS}")
    # GENQ_SERVERS: URLs separated by commas and/or whitespace, in order of preference.
    listed = [u for u in re.split(r"[,\s]+", os.environ.get("GENQ_SERVERS", "")) if u]
    urls = [u.rstrip("/") for u in a.server or listed]
    if not urls:
        p.error("--server URL (or GENQ_SERVERS) is required")
    for url in urls:
        if not re.match(r"^https?://", url):
            p.error(f"--server {url!r} must be an http:// or https:// URL")
    if a.shard_records < 1 or a.shard_minutes <= 0 or a.ship_wait < 0:
        p.error("--shard-records must be >= 1, --shard-minutes > 0 and --ship-wait >= 0")
    if a.s3_uri:
        try:
            store.parse_uri(a.s3_uri)
        except UsageError as e:
            p.error(str(e))
    try:
        invalid_keep()  # read again where it is used (consumer/structured.py): refused here
    except UsageError as e:
        p.error(str(e))
    named = {f.name: getattr(a, f.name) for f in fields(ConsumeSettings) if f.name in vars(a)}
    return ConsumeSettings(**{**named, "server": urls[0], "servers": tuple(urls),
                              "name": a.name or f"{socket.gethostname()}-{os.getpid()}",
                              "keep_local": not a.delete_shipped})


@guarded
def main(argv: list[str] | None = None) -> int:
    s = parse(argv)
    log.setup()
    structlog.contextvars.bind_contextvars(run=s.run)
    check_writable(s.out)
    # Started before Redis (compose, restart loops): wait here, before the server lease needs it.
    probe = connect(s.redis_url, socket_timeout=SERVICE_SOCKET_TIMEOUT_S, wait=True,
                    stop=stop_on_signals(), give_up_after=s.redis_wait if s.burst else None)
    if probe is None:
        logger.info("consumer_stopped", acked=0)
        return 0
    probe.close()
    # Each task allocates short-lived objects by the hundred: the default thresholds made a
    # full collection, walking everything start-up loaded, every ~1,000 tasks.
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    return asyncio.run(shutdown.to_the_end(drive_shipping_leftovers(s)))


def check_writable(out: str) -> None:
    """Fail at start, in one line naming the fix, on an output directory this user cannot write."""
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


def run_outdir(k: RunKeys, out: str, epoch: str) -> str:
    """Where this run's output goes: `out`, or `out/{run}-{epoch}` when `out` holds an earlier run
    of this name that Redis no longer has (compose's `down -v`, then `up -d`): the new run goes
    beside it, and the earlier output stays as it is, recoverable from `out`."""
    found = manifests.find(out, k.run)
    if found is None or found["epoch"] == epoch:
        return out
    mine = os.path.join(out, f"{k.run}-{epoch}")
    os.makedirs(mine, exist_ok=True)  # the manifest is written before the first shard
    fix = runhealth.recover_command(k.run, [os.path.abspath(out)])
    logger.warning("earlier_run_kept", out=out, epoch=found["epoch"], writing_to=mine,
                   reason=f"{out} holds an earlier run {k.run!r} (epoch {found['epoch']}, "
                          f"parameters v{found['params_version']}); it stays as it is and "
                          f"this run writes to {mine}; `{fix} --replace` would bring the "
                          "earlier one back in place of this one")
    return mine


async def wait_for_server(server: SGLang, s: ConsumeSettings) -> tuple[int, str, int | None]:
    """Wait (up to --server-wait) until the server is warm, then read what it is."""
    deadline = time.monotonic() + s.server_wait
    while True:
        try:
            await server.health()
            capacity = s.concurrency or await server.capacity()
            if not capacity:
                raise GenqError(f"{s.server} reports no max_running_requests in /v1/loads; "
                                "pass --concurrency")
            return capacity, await server.model(), await server.context_length()
        except ServerUnavailable as e:
            if time.monotonic() >= deadline:
                raise GenqError(f"cannot reach SGLang server {s.server}: {e}") from None
            logger.info("waiting_for_server", error=str(e))
            await asyncio.sleep(1.0)


async def check_token_ids(server: SGLang, s: ConsumeSettings, current: dict[str, Any],
                          model: str) -> None:
    """A run that keeps token ids needs whole answers and a server that returns ids: say so at
    start, in one line, rather than write a run of records without them."""
    if not current.get("return_token_ids"):
        return
    if s.stream:
        raise GenqError("this run keeps token ids (genq produce --token-ids), and SGLang sends "
                        "none in streamed answers: run this consumer without --stream")
    ask = request_body([{"role": "user", "content": "Hi"}], {**current, "max_tokens": 1}, model)
    try:
        await server.chat(ask, -1)
    except ServerUnavailable as e:
        if "without token ids" not in str(e):
            raise
        raise GenqError(f"{s.server} returns no token ids (return_token_ids), and this run "
                        "keeps them (genq produce --token-ids): use an SGLang that does "
                        "(0.5.x), or a run without --token-ids") from None


def redis_client(url: str) -> aioredis.Redis:
    """A blocking pool of a few dozen connections serves thousands of slots (redis-py's default
    raises past 100)."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=REDIS_CONNECTIONS, timeout=None, socket_connect_timeout=5,
        socket_timeout=SERVICE_SOCKET_TIMEOUT_S,
        retry=AsyncRetry(NoBackoff(), 1))  # see common.cli.service_retry
    return aioredis.Redis(connection_pool=pool)


def prepare(s: ConsumeSettings, k: RunKeys, stopped: threading.Event
            ) -> tuple[ConsumeSettings, redis.Redis, runs.RunInfo, Dataset, ShardWriter] | None:
    """Connect, read the run, open (index) the data set and repair the shards: seconds on a big
    data set, run in a thread so that the server lease is renewed meanwhile. The settings come
    back with the run's own output directory (run_outdir). None if stopped while waiting for
    Redis, or for the run it lost (`genq recover`)."""
    sync = connect(s.redis_url, socket_timeout=SERVICE_SOCKET_TIMEOUT_S, wait=True,
                   stop=stopped, give_up_after=s.redis_wait if s.burst else None)
    if sync is None or not runhealth.lost_run_back(sync, k, stopped, "consumer",
                                                   "exiting on an unknown run"):
        return None
    info = runs.load(sync, k)
    for risk in risky_redis_settings(sync):
        logger.warning("redis_settings", risk=risk)
    dataset = open_dataset(info.dataset, info.dataset_version)
    dataset.verify(info.fingerprint)
    s = replace(s, out=run_outdir(k, s.out, info.epoch))
    sync.sadd(k.outdirs, os.path.abspath(s.out))  # every manifest lists every output dir
    manifests.upkeep(sync, k, [s.out], info.epoch)  # before the first shard line exists
    for path, cut in repair_shards(s.out, s.run):
        logger.warning("torn_tail_repaired", shard=str(path), bytes_removed=cut)
    return s, sync, info, dataset, ShardWriter(s.out, s.run, s.name,
                                               rotate_every=s.shard_records)


async def serve(s: ConsumeSettings, lease_held: Callable[[], bool]) -> int:
    k = run_keys(s.run)
    stopped = stop_on_signals()  # until the loop's own handlers take over, below
    ready = await asyncio.to_thread(prepare, s, k, stopped)
    if ready is None:  # stopped while waiting for Redis; nothing was claimed
        logger.info("consumer_stopped", acked=0)
        return 0
    s, sync, info, dataset, writer = ready
    server = SGLang(s.server, request_timeout=s.request_timeout, stall_timeout=s.stall_timeout,
                    stream=s.stream)
    client = redis_client(s.redis_url)
    shipper, shipping = start_shipping(s, k, writer, client)
    rc = 0
    try:
        capacity, model, context = await wait_for_server(server, s)
        await check_token_ids(server, s, params.current(sync, k)[1], model)
        consumer = Consumer(s, client, k, sync=sync, total=info.total, samples=info.samples,
                            turns=info.turns, dataset=dataset,
                            sink=writer, server=server, capacity=capacity, model=model,
                            runstate=RunState(k, info.epoch, s.out, info.gen),
                            context_length=context, lease_held=lease_held)
        signalled = stop_on_signals_of(consumer, already=stopped.is_set())
        logger.info("consumer_started", capacity=capacity, model=model, context_length=context,
                    shard=str(writer.path))
        await consumer.run()
        logger.info("consumer_stopped", acked=consumer.acked, crashed=consumer.crashed or None)
        if consumer.runstate.failure:
            raise GenqError(consumer.runstate.failure)
        if shipper is not None:
            writer.close()  # the last shard joins the backlog
            # A signalled stop ships within its grace, --burst too: Slurm kills at KillWait.
            wait = s.ship_wait if s.burst and not signalled else min(s.ship_wait, s.grace)
            rc = await finish_shipping(shipper, wait)
    finally:
        await shutdown.cancel_and_wait(shipping)
        await server.close()
        await client.aclose()
        sync.close()
        writer.close()
        dataset.close()
    return 1 if consumer.crashed else rc


_SAME_STOP_S = 2.0  # a SIGTERM this soon after the first is the same stop, told twice


def stop_on_signals_of(consumer: Consumer, already: bool) -> list[float]:
    """SIGTERM and SIGINT stop the consumer, and a second one gives everything back now; but
    a SIGTERM within 2 s of the first is the same stop: Slurm signals every process of a task
    and the task's script passes the signal on too. Ctrl-C twice always aborts. The list
    holds when the first signal came (empty: none yet); `already`: one came while starting."""
    first: list[float] = [time.monotonic()] if already else []

    def on(sig: signal.Signals) -> None:
        now = time.monotonic()
        if sig == signal.SIGTERM and first and now - first[0] < _SAME_STOP_S:
            return
        first.append(now)
        consumer.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, on, sig)
    if already:
        consumer.request_stop()
    return first


# --- shipping to S3: --burst waits for every shard at the end, a signalled stop its grace ----
def shipper_died(task: asyncio.Task) -> None:
    """A shipper that stops on its own is a bug: say so at once, not at exit."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("shipper_died", error=repr(task.exception()))


def start_shipping(s: ConsumeSettings, k: RunKeys, writer: ShardWriter,
                   client: aioredis.Redis) -> tuple[Shipper | None, list[asyncio.Task]]:
    """The shipper and its task, or (None, []) without --s3-uri."""
    if not s.s3_uri:
        return None, []
    shipper = Shipper(store.parse_uri(s.s3_uri), k, writer.name, s.out, client,
                      keep_local=s.keep_local)
    writer.on_close = shipper.closed
    # The run manifest `genq recover` needs (written beside the shards) goes along.
    shipper.watch(Path(s.out) / f"{s.run}.manifest.json", f"{writer.name}/{store.MANIFEST}")
    found = shipper.scan()
    if found:
        logger.info("unshipped_shards_found", shards=found, out=s.out)
    task = asyncio.create_task(shipper.run(writer, s.shard_minutes * 60))
    task.add_done_callback(shipper_died)
    return shipper, [task]


async def drive_shipping_leftovers(s: ConsumeSettings) -> int:
    """Drive a server (servers.drive); while this consumer waits for one as a spare, ship the
    leftover shards a dead consumer left in its --out: else they wait unseen for as long as the
    spare does, or for ever. Serving, its own shipper takes over; stopped first, it says what it
    leaves unshipped."""
    client = redis_client(s.redis_url)
    try:
        shipper = await leftover_shipper(s, run_keys(s.run), client)
        if shipper is None:
            return await servers.drive(s, serve)
        task = asyncio.create_task(shipper.run())
        task.add_done_callback(shipper_died)
        served = False

        async def serve_alone(settings: ConsumeSettings, held: Callable[[], bool]) -> int:
            nonlocal served
            served = True
            await shutdown.cancel_and_wait([task])  # one shipper a directory: serve's own
            return await serve(settings, held)
        try:
            rc = await servers.drive(s, serve_alone)
            if not served:
                rc = max(rc, await finish_shipping(shipper, min(s.ship_wait, s.grace)))
        finally:
            await shutdown.cancel_and_wait([task])
        return rc
    finally:
        await client.aclose()


async def leftover_shipper(s: ConsumeSettings, k: RunKeys, client: aioredis.Redis
                           ) -> Shipper | None:
    """A shipper holding the closed shards of the run Redis has now in --out (or in the run's
    own directory there, run_outdir), when a spare could wait with some; None otherwise."""
    if not s.s3_uri or s.share_server:  # a shared server is served at once, shipping and all
        return None
    try:
        raw = await client.hget(k.meta, "epoch")
    except REDIS_TROUBLE:
        return None  # serve says what is wrong with Redis
    epoch = None if raw is None else text(raw)
    mine = [d for d in (s.out, os.path.join(s.out, f"{k.run}-{epoch}"))
            if epoch and (manifests.find(d, k.run) or {}).get("epoch") == epoch]
    if not mine:  # shards of an earlier run of this name are not this run's to ship
        return None
    shipper = Shipper(store.parse_uri(s.s3_uri), k, safe_name(s.name), mine[0], client,
                      keep_local=s.keep_local)
    found = shipper.scan()
    if not found:
        return None
    logger.info("unshipped_shards_found", shards=found, out=mine[0], waiting_for_a_server=True)
    return shipper


async def finish_shipping(shipper: Shipper, wait: float) -> int:
    """Ship what is left within `wait` seconds; 1, with one clear line, if some could not."""
    left = await shipper.finish(wait)
    if not left:
        logger.info("all_shipped", shards=shipper.shipped, bytes=shipper.bytes)
        return 0
    print(f"genq: error: {len(left)} shard(s) not shipped to {shipper.uri} after "
          f"{wait:g}s ({shipper.last_error or 'no answer yet'}); they stay in "
          f"{shipper.out} and ship when a consumer starts there again with --s3-uri: "
          f"{', '.join(p.name for p in left[:5])}{' …' if len(left) > 5 else ''}",
          file=sys.stderr)
    return 1

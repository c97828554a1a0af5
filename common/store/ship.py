"""Ship closed shards (and the manifest) to S3 from one asyncio task per consumer, boto3 in
threads. A shard is uploaded, verified, then recorded in ``genq:<run>:shipped`` before its local
copy may go; on S3 trouble it stays on disk, retried with backoff (backlog: ``genq:<run>:ship``)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import redis
import structlog

from genq.common.data.shards import closed_shards
from genq.common.errors import REDIS_TROUBLE, StoreUnavailable
from genq.common.queue.keys import RunKeys
from genq.common.store import s3 as store

logger = structlog.get_logger("shipper")

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 10.0  # one cheap retry per 10 s at worst: a backlog drains soon after S3 is back
# A failed upload: retried with backoff, the shard kept on disk meanwhile.
SHIP_TROUBLE: tuple[type[Exception], ...] = (StoreUnavailable, *REDIS_TROUBLE)


@dataclass
class Item:
    path: Path
    key: str
    shard: bool  # shards are compressed and counted; other files go as they are
    size: int
    version: tuple[int, int] = (0, 0)  # (mtime_ns, size) of a watched file when queued
    records: int = 0  # a shard's lines: results on this disk only until it ships


def _prepare(item: Item) -> tuple[bytes, dict[str, str]]:
    raw = item.path.read_bytes()
    meta = {"raw-sha256": hashlib.sha256(raw).hexdigest(), "source": item.path.name}
    if not item.shard:
        return raw, meta
    meta["records"] = str(raw.count(b"\n"))
    return store.compress(raw), meta


class Shipper:
    def __init__(self, uri: store.S3Uri, keys: RunKeys, consumer: str, out_dir: str | Path,
                 r: Any, *, keep_local: bool = True) -> None:
        self.uri, self.k, self.consumer, self.out = uri, keys, consumer, Path(out_dir)
        self.r, self.keep_local = r, keep_local
        self.s3 = store.client()
        self.queue: dict[Path, Item] = {}
        self.wake = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self.shipped = self.bytes = self.failures = 0
        self.last_error: str | None = None
        self.watched: dict[Path, str] = {}
        self.sent: dict[Path, tuple[int, int]] = {}
        self.sink: Any = None  # the shard writer, whose open shard is unshipped too
        self.published: int | None = None  # the unshipped figure last put in Redis

    def closed(self, path: Path) -> None:
        """The shard writer's on_close hook: called from any thread, never blocks."""
        self.loop.call_soon_threadsafe(self.add_shard, path)

    def add_shard(self, path: Path) -> None:
        if path not in self.queue:
            try:
                size, records = path.stat().st_size, path.read_bytes().count(b"\n")
            except FileNotFoundError:
                size = records = 0
            self.queue[path] = Item(path, store.shard_key(self.uri, path), True, size,
                                    records=records)
        self.wake.set()

    def watch(self, path: Path, name: str) -> None:
        """Ship ``path`` (the run manifest) as ``<prefix>/<run>/<name>`` whenever it changes."""
        self.watched[path] = name

    def check_watched(self) -> None:
        for path, name in self.watched.items():
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            version = (st.st_mtime_ns, st.st_size)
            queued = self.queue.get(path)
            if self.sent.get(path) != version and (queued is None or queued.version != version):
                key = self.uri.key(self.k.run, name)
                self.queue[path] = Item(path, key, False, st.st_size, version)

    def scan(self) -> int:
        """Queue every finished shard of the run in the output directory not shipped yet."""
        found = closed_shards(self.out, self.k.run)
        for path in found:
            self.add_shard(path)
        return len(found)

    async def run(self, sink: Any = None, max_age_s: float | None = None) -> None:
        """Ship until cancelled; close ``sink``'s shard when it is older than ``max_age_s``."""
        self.sink = sink
        with contextlib.suppress(*REDIS_TROUBLE):  # reported again after the first upload
            await self.report()
        while True:
            if sink is not None and max_age_s:
                await asyncio.to_thread(sink.rotate_if_older, max_age_s)
            self.check_watched()
            if self.unshipped() != self.published:  # acks add to it between ships
                with contextlib.suppress(*REDIS_TROUBLE):
                    await self.report()
            if not self.queue:
                self.wake.clear()
                # the age rotation needs a tick; asyncio.timeout, as 3.11's wait_for can
                # drop a cancellation that lands as the wait ends
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await self.wake.wait()
                continue
            item = next(iter(self.queue.values()))
            try:
                await self.ship(item)
            except SHIP_TROUBLE as e:
                await self.failed(item, e)
                continue
            if self.queue.get(item.path) is item:  # not replaced by a newer version meanwhile
                del self.queue[item.path]
            self.sent[item.path] = item.version
            self.failures = 0
            with contextlib.suppress(*REDIS_TROUBLE):  # the next report carries it
                await self.report()

    async def ship(self, item: Item) -> None:
        if item.shard and await self.shipped_before(item):
            self.drop_local(item)  # shipped before this consumer (re)started
            return
        try:
            body, meta = await asyncio.to_thread(_prepare, item)
        except FileNotFoundError:
            return  # another consumer on this directory shipped and removed it
        started = time.monotonic()
        key = await asyncio.to_thread(self.upload, item, body, meta)
        if item.shard:
            entry = {"sha256": meta["raw-sha256"], "bytes": len(body),
                     "records": int(meta["records"]), "shard": item.path.name}
            await mark_shipped(self.r, self.k, item.key, key, entry)
            self.drop_local(item)
        self.shipped += item.shard
        self.bytes += len(body)
        logger.info("shipped", key=key, bytes=len(body), raw_bytes=item.size,
                    seconds=round(time.monotonic() - started, 3), backlog=len(self.queue) - 1)

    async def shipped_before(self, item: Item) -> bool:
        """Recorded as shipped: under its key, or by an older genq under its per-name key, then
        only if that record names this very file (a reused name's shard 1 is another)."""
        if await self.r.hexists(self.k.shipped, item.key):
            return True
        legacy = await self.r.hget(self.k.shipped, store.legacy_shard_key(self.uri, item.path))
        return legacy is not None and orjson.loads(legacy).get("shard") == item.path.name

    def upload(self, item: Item, body: bytes, meta: dict[str, str]) -> str:
        """Upload under the item's key and return the key used: one holding other content is
        never overwritten (the shard goes beside it)."""
        key = item.key
        with store.as_unavailable(f"uploading {item.path.name} to {self.uri}"):
            if item.shard:
                there = store.head(self.s3, self.uri, key)
                seen = (there or {}).get("Metadata", {}).get("raw-sha256")
                if seen == meta["raw-sha256"]:
                    return key
                if there is not None:  # named after its content, so a retry finds it again
                    key = key.replace(store.SUFFIX, f"-{meta['raw-sha256'][:16]}{store.SUFFIX}")
            store.put_verified(self.s3, self.uri, key, body, meta)
        return key

    def drop_local(self, item: Item) -> None:
        if not self.keep_local:
            item.path.unlink(missing_ok=True)

    async def failed(self, item: Item, e: Exception) -> None:
        self.failures += 1
        self.last_error = str(e) or type(e).__name__
        if self.queue.get(item.path) is item:  # to the back: one bad file must not block all
            self.queue[item.path] = self.queue.pop(item.path)
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** min(self.failures - 1, 10))
        delay *= 0.5 + random.random() / 2
        logger.warning("ship_failed", shard=item.path.name, error=self.last_error,
                       retry_in_s=round(delay, 1), backlog=len(self.queue))
        with contextlib.suppress(*REDIS_TROUBLE):  # Redis down too: the log line reports it
            await self.report()
        await asyncio.sleep(delay)

    def unshipped(self) -> int:
        """Results acknowledged on this disk and not in S3 yet: queued shards and the open one."""
        open_now = self.sink.open_records if self.sink is not None else 0
        return open_now + sum(i.records for i in self.queue.values() if i.shard)

    async def report(self) -> None:
        """This consumer's backlog and last error in genq:<run>:ship; fields removed once clear.
        Its unshipped figure stays, 0 or not: a dead consumer's last one says what it took."""
        me, pending = self.consumer, [i.size for i in self.queue.values() if i.shard]
        backlog = {f"pending|{me}": len(pending), f"pending_bytes|{me}": sum(pending)}
        unshipped = self.unshipped()
        error = {f"error|{me}": self.last_error or "", f"error_at|{me}": round(time.time(), 3)}
        pipe = self.r.pipeline(transaction=True)
        for fields, present in ((backlog, pending), (error, self.failures)):
            if present:
                pipe.hset(self.k.ship, mapping=fields)
            else:
                pipe.hdel(self.k.ship, *fields)
        pipe.hset(self.k.ship, f"unshipped|{me}", unshipped)
        await pipe.execute()
        self.published = unshipped

    async def finish(self, timeout: float) -> list[Path]:
        """Wait until the queue is empty or ``timeout`` passes; what is still unshipped."""
        deadline = time.monotonic() + timeout
        await asyncio.sleep(0)  # let shards closed just now (call_soon_threadsafe) join
        self.check_watched()
        while self.queue and time.monotonic() < deadline:
            self.wake.set()
            await asyncio.sleep(0.05)
        # The run loop may be stopped before it reports the last ship: the figure an exited
        # consumer leaves is what it leaves (0 once every shard is in S3), not an older one.
        with contextlib.suppress(*REDIS_TROUBLE):
            await self.report()
        return list(self.queue)


async def mark_shipped(r: Any, k: RunKeys, field: str, key: str, entry: dict) -> bool:
    """Record the shard as shipped once, however often it was uploaded."""
    entry = {**entry, "key": key}
    while True:
        async with r.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(k.shipped)
                if await pipe.hexists(k.shipped, field):
                    await pipe.unwatch()
                    return False
                pipe.multi()
                pipe.hset(k.shipped, field, orjson.dumps(entry))
                pipe.hincrby(k.ship, "shards", 1)
                pipe.hincrby(k.ship, "bytes", entry["bytes"])
                pipe.hincrby(k.ship, "records", entry["records"])
                await pipe.execute()
                return True
            except redis.WatchError:
                continue

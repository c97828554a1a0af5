"""The consumer's side of shipping to S3: its flags, starting the shipper beside the loop, and
draining it on the way out (``--burst`` waits for every shard; a signalled stop waits its
grace), saying plainly what could not be shipped."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import structlog

from common.errors import UsageError
from common.queue.keys import RunKeys
from common.store import s3 as store
from common.store.ship import Shipper

logger = structlog.get_logger("consumer")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--s3-uri", metavar="URI", default=os.environ.get("GENQ_S3_URI") or None,
                   help="ship closed shards to s3://bucket/prefix (env GENQ_S3_URI); "
                        "credentials, region and AWS_ENDPOINT_URL as boto3 finds them")
    p.add_argument("--shard-records", type=int, default=500, metavar="N",
                   help="close a shard after this many records (default 500)")
    p.add_argument("--shard-minutes", type=float, default=10.0, metavar="M",
                   help="with --s3-uri, also close a shard this old (default 10)")
    p.add_argument("--delete-shipped", action="store_true",
                   help="remove a shard's local copy once S3 holds it, verified")
    p.add_argument("--ship-wait", type=float, default=600.0, metavar="S",
                   help="seconds --burst waits at the end for the backlog to ship "
                        "(default 600)")


def settings(p: argparse.ArgumentParser, a: argparse.Namespace) -> dict[str, Any]:
    if a.shard_records < 1 or a.shard_minutes <= 0 or a.ship_wait < 0:
        p.error("--shard-records must be >= 1, --shard-minutes > 0 and --ship-wait >= 0")
    if a.s3_uri:
        try:
            store.parse_uri(a.s3_uri)
        except UsageError as e:
            p.error(str(e))
    return {"s3_uri": a.s3_uri, "shard_records": a.shard_records,
            "shard_minutes": a.shard_minutes, "keep_local": not a.delete_shipped,
            "ship_wait": a.ship_wait}


def _died(task: asyncio.Task) -> None:
    """A shipper that stops on its own is a bug: say so at once, not at exit."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("shipper_died", error=repr(task.exception()))


class Shipping:
    """The shipper task of one consumer; ``start`` returns None when no URI is given."""

    def __init__(self, shipper: Shipper, task: asyncio.Task) -> None:
        self.shipper, self.task = shipper, task

    @classmethod
    def start(cls, s: Any, k: RunKeys, writer: Any, client: Any) -> Shipping | None:
        if not s.s3_uri:
            return None
        shipper = Shipper(store.parse_uri(s.s3_uri), k, writer.name, s.out, client,
                          keep_local=s.keep_local)
        writer.on_close = shipper.closed
        # The run manifest `genq recover` needs (written beside the shards) goes along.
        shipper.watch(Path(s.out) / f"{s.run}.manifest.json", f"{writer.name}/{store.MANIFEST}")
        found = shipper.scan()
        if found:
            logger.info("unshipped_shards_found", shards=found, out=s.out)
        task = asyncio.create_task(shipper.run(writer, s.shard_minutes * 60))
        task.add_done_callback(_died)
        return cls(shipper, task)

    async def finish(self, wait: float) -> int:
        """Ship what is left within ``wait`` seconds; 1, with one clear line, if some of it
        could not be."""
        left = await self.shipper.finish(wait)
        if not left:
            logger.info("all_shipped", shards=self.shipper.shipped, bytes=self.shipper.bytes)
            return 0
        print(f"genq: error: {len(left)} shard(s) not shipped to {self.shipper.uri} after "
              f"{wait:g}s ({self.shipper.last_error or 'no answer yet'}); they stay in "
              f"{self.shipper.out} and ship when a consumer starts there again with --s3-uri: "
              f"{', '.join(p.name for p in left[:5])}{' …' if len(left) > 5 else ''}",
              file=sys.stderr)
        return 1

    async def cancel(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

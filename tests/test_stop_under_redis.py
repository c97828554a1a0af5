"""A consumer's S3 shipper ends when it is stopped, even while it talks to Redis.

On Python 3.11, redis-py's asyncio client awaits its socket writes through `asyncio.wait_for`,
which drops a cancellation that lands as the write completes: a task looping on Redis calls then
survives a single `cancel()`, and whoever awaits it (the consumer's exit, `asyncio.run`'s own
cleanup) waits for ever. This test stops a real loop on a real Redis many times over, so a
single lost cancellation among them is caught."""

from __future__ import annotations

import asyncio
import random

import redis.asyncio as aioredis

from genq.common.queue.keys import RunKeys
from genq.common.store import s3 as store
from genq.common.store.ship import Shipper
from genq.consumer.shutdown import cancel_and_wait

TRIALS = 30


def test_the_shipper_ends_when_stopped_while_it_reports(redis_url, run_name, tmp_path,
                                                       monkeypatch) -> None:
    """The shipper's report (a Redis transaction) runs as often as it can while it is stopped."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")

    async def trial(shipper: Shipper) -> bool:
        async def busy() -> None:
            while True:
                await shipper.report()

        task = asyncio.create_task(busy())
        await asyncio.sleep(random.random() * 0.003)
        stopping = asyncio.create_task(cancel_and_wait([task]))
        # asyncio.wait, not asyncio.timeout: a timeout's cancel would go to the task awaited
        # A cancel not lost ends it in milliseconds; 5 s leaves room for a loaded machine (CI
        # runs two test workers a core), while a cancel lost for good still never ends it.
        await asyncio.wait([stopping], timeout=5)
        if stopping.done():
            return True
        while not task.done():  # ended here, or asyncio.run's cleanup would wait for ever
            task.cancel()
            await asyncio.wait([task], timeout=0.1)
        await stopping
        return False

    async def main() -> int:
        r = aioredis.Redis.from_url(redis_url)
        shipper = Shipper(store.parse_uri("s3://bucket/prefix"), RunKeys(run_name), "c1",
                          tmp_path, r)
        shipper.failures, shipper.last_error = 1, "S3 refused"  # the report writes both halves
        ended = [await trial(shipper) for _ in range(TRIALS)]
        await r.aclose()
        return ended.count(False)

    assert asyncio.run(main()) == 0

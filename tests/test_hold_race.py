"""A task given back can be claimed again by another slot before the first slot has let go
of it; the new claim must stay held, so its lease is renewed. Found by the real-SGLang tier:
with thousands of slots bouncing tasks off a restarting server, the first slot's clean-up
dropped the new claim from the renewal set, its lease expired under a running request, and
the task failed with "lease expired" (--max-attempts 1). The interleaving is replayed here
step by step against a real Redis and the real scripts."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aioredis
from pipeline import write_dataset

from genq.common.data.dataset import open_dataset
from genq.common.queue import feed, scripts
from genq.common.queue.keys import RunKeys
from genq.consumer.runstate import RunState
from genq.consumer.settings import ConsumeSettings
from genq.consumer.worker import Consumer


def test_letting_go_of_a_task_keeps_a_newer_claim_of_it_held(redis_url, run_name, tmp_path):
    k = RunKeys(run_name)
    sync = redis.Redis.from_url(redis_url)
    sync.hset(k.meta, mapping={"total": 1, "dataset": "/x", "fingerprint": "f", "epoch": "e"})
    feed.enqueue(sync, k, [0], scripts.ScriptRunner(sync))
    s = ConsumeSettings(redis_url=redis_url, run=run_name, server="http://s", concurrency=4,
                        visibility_timeout=30, out="/tmp", burst=True, max_attempts=3,
                        request_timeout=60, grace=1, name="w", poll=0.1, server_wait=1)

    dataset = open_dataset(write_dataset(tmp_path / "d.jsonl", 1))

    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url)
        c = Consumer(s, client, k, sync=sync, total=1, dataset=dataset, sink=None,  # type: ignore
                     server=None, capacity=4, model="m", runstate=RunState(k, "", "out"))
        [first] = await c.claim(1)  # slot A runs the task...
        lease = first.lease
        await c.queue.release(lease, refund=True, reason="server unavailable")  # ...gives it back
        [second] = await c.claim(1)  # slot B claims it before A has resumed
        c.let_go(first)  # A's clean-up
        assert c.held == {lease.job_id: second}
        assert await c.queue.renew([i.lease for i in c.held.values()]) == set()  # still renewed
        c.let_go(second)
        assert c.held == {}
        await client.aclose()

    try:
        asyncio.run(main())
    finally:
        sync.close()

"""A claim reads its tasks' data set rows off the event loop, in one thread hop for the whole
claim (a JSON-lines row is a disk read; the loop must keep renewing leases and streaming
meanwhile), and a row that cannot be read stays with its task to be settled there."""

from __future__ import annotations

import asyncio
import threading

import redis
import redis.asyncio as aioredis
from pipeline import write_dataset

from genq.common.data.dataset import open_dataset
from genq.common.data.rows import Prompt
from genq.common.errors import BadTask
from genq.common.queue import feed, scripts
from genq.common.queue.keys import RunKeys
from genq.consumer.runstate import RunState
from genq.consumer.settings import ConsumeSettings
from genq.consumer.worker import Consumer


def test_a_claim_reads_its_rows_in_a_thread(redis_url, run_name, tmp_path):
    k = RunKeys(run_name)
    sync = redis.Redis.from_url(redis_url)
    path = write_dataset(tmp_path / "d.jsonl", 3)
    with open(path, "a") as f:
        f.write('{"id": "bad", "neither": 1}\n')  # row 3: no messages, no prompt
    dataset = open_dataset(path)
    readers: set[str] = set()
    prompt = dataset.prompt

    def watched(index: int) -> Prompt:
        readers.add(threading.current_thread().name)
        return prompt(index)

    dataset.prompt = watched  # type: ignore[method-assign]
    sync.hset(k.meta, mapping={"total": 4, "dataset": str(path), "fingerprint": "f",
                               "epoch": "e"})
    feed.enqueue(sync, k, [0, 1, 2, 3], scripts.ScriptRunner(sync))
    s = ConsumeSettings(redis_url=redis_url, run=run_name, server="http://s", concurrency=4,
                        visibility_timeout=30, out=str(tmp_path), burst=True, max_attempts=3,
                        request_timeout=60, grace=1, name="w", poll=0.1, server_wait=1)

    async def main() -> list:
        client = aioredis.Redis.from_url(redis_url)
        c = Consumer(s, client, k, sync=sync, total=4, dataset=dataset, sink=None,  # type: ignore
                     server=None, capacity=4, model="m", runstate=RunState(k, "", "out"))
        got = await c.claim(4)
        await client.aclose()
        return got

    try:
        got = asyncio.run(main())
    finally:
        sync.close()
    assert len(readers) == 1 and threading.main_thread().name not in readers
    by_index = {i.lease.index: i.prompt for i in got}
    assert all(isinstance(by_index[n], Prompt) for n in (0, 1, 2))
    assert isinstance(by_index[3], BadTask)

"""Partial answers `genq requeue --continue` left for the consumers: zstd JSON per truncated
index, deleted by the ack that accepts its continuation."""

from __future__ import annotations

from typing import Any

import orjson
import redis
import redis.asyncio as aioredis
import zstandard

from genq.common.data.records import task_of
from genq.common.queue.keys import RunKeys
from genq.common.queue.replies import blob

# What a partial carries: the answer so far and which result it was.
FIELDS = ("reasoning_content", "content", "completion_tokens", "prompt_tokens", "params_version",
          "attempt")


def put_all(r: redis.Redis, k: RunKeys, records: list[dict[str, Any]], samples: int = 1) -> int:
    """Store the partials of these records, each under its task (replacing any older set); the
    bytes they take."""
    packer = zstandard.ZstdCompressor(level=3)
    packed = {str(task_of(rec, samples)):
              packer.compress(orjson.dumps({f: rec.get(f) for f in FIELDS})) for rec in records}
    pipe = r.pipeline(transaction=True)
    pipe.delete(k.partials)
    items = list(packed.items())
    for start in range(0, len(items), 1000):  # bounded commands, however many partials
        pipe.hset(k.partials, mapping=dict(items[start:start + 1000]))
    pipe.execute()
    return sum(len(v) for v in packed.values())


async def get(r: aioredis.Redis, k: RunKeys, index: int) -> dict[str, Any] | None:
    raw = blob(await r.hget(k.partials, str(index)))
    return orjson.loads(zstandard.ZstdDecompressor().decompress(raw)) if raw else None


async def drop(r: aioredis.Redis, k: RunKeys, index: int) -> None:
    await r.hdel(k.partials, str(index))

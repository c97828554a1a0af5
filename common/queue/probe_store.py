"""Answers of `genq requeue --probe`, kept so committing the pivot does not generate them
again: each used once, for a request whose body hashes the same as the probe's. The hash
expires KEEP_S after the probe, so an uncommitted one stops costing consumers a lookup."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis

from common.queue.keys import RunKeys

KEEP_S = 3600  # a probe's answers wait this long for the pivot to be committed
# The Completion fields a stored answer carries (common.sglang.stream.Completion).
FIELDS = ("finish_reason", "content", "reasoning_content", "prompt_tokens",
          "completion_tokens", "max_tokens", "continued_from")


def digest(body: dict[str, Any]) -> str:
    """The request's identity: its body with keys sorted, without the transport's options."""
    same = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return hashlib.sha256(orjson.dumps(same, option=orjson.OPT_SORT_KEYS)).hexdigest()


def replace_all(r: redis.Redis, k: RunKeys, answers: dict[int, tuple[dict, Any]]) -> None:
    """Store a probe's answers {index: (body, completion)}, replacing any older probe's."""
    pipe = r.pipeline(transaction=True)
    pipe.delete(k.probe)
    if answers:
        pipe.hset(k.probe, mapping={
            str(i): orjson.dumps({"digest": digest(body),
                                  "completion": {f: getattr(c, f) for f in FIELDS}})
            for i, (body, c) in answers.items()})
        pipe.expire(k.probe, KEEP_S)
    pipe.execute()


async def take(r: aioredis.Redis, k: RunKeys, index: int,
               body: dict[str, Any]) -> dict[str, Any] | None:
    """The stored answer to exactly this request, removed as it is handed out; else None."""
    raw = await r.hget(k.probe, str(index))
    if raw is None:
        return None
    entry = orjson.loads(raw)
    if entry.get("digest") != digest(body):
        return None  # probed under other parameters: not this request's answer
    if not await r.hdel(k.probe, str(index)):
        return None  # another consumer took it first
    return entry["completion"]

"""The consumers' heartbeats as every reader sees them; consumer/presence.py writes each one
(an expiring JSON object, and the name in the run's consumers set scored with its last beat)."""

from __future__ import annotations

import contextlib
from typing import Any, cast

import orjson
import redis

from genq.common.queue.keys import RunKeys


def read(r: redis.Redis, k: RunKeys, names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """The live heartbeats (JSON objects) by consumer name: of these names, or of every one."""
    if names is None:
        # cast: redis-py's annotation covers ZRANGE with and without scores.
        names = [n.decode() for n in cast(list[bytes], r.zrange(k.consumers, 0, -1))]
    beats = {}
    for name, raw in zip(names, r.mget([k.consumer(n) for n in names]) if names else [],
                         strict=True):
        with contextlib.suppress(orjson.JSONDecodeError):
            if raw is not None and isinstance(beat := orjson.loads(raw), dict):
                beats[name] = beat
    return beats

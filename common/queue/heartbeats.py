"""The consumers' heartbeats as every reader sees them; consumer/presence.py writes each one
(an expiring JSON object, and the name in the run's consumers set scored with its last beat)."""

from __future__ import annotations

from typing import Any, cast

import orjson
import redis

from common.queue.keys import RunKeys


def decode(raw: bytes | str | None) -> dict[str, Any] | None:
    """One heartbeat; None where it expired or is not a JSON object."""
    try:
        beat = orjson.loads(raw) if raw is not None else None
    except orjson.JSONDecodeError:
        return None
    return beat if isinstance(beat, dict) else None


def read(r: redis.Redis, k: RunKeys, names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """The live heartbeats by consumer name: of these names, or of every consumer in the set."""
    if names is None:
        # cast: redis-py's annotation covers ZRANGE with and without scores.
        names = [n.decode() for n in cast(list[bytes], r.zrange(k.consumers, 0, -1))]
    raws = r.mget([k.consumer(n) for n in names]) if names else []
    beats = {n: decode(raw) for n, raw in zip(names, raws, strict=True)}
    return {n: beat for n, beat in beats.items() if beat is not None}

"""Where a conversation stands between its turns, as Redis keeps it: the accepted generations
before its last (one entry each: the key its line is found by, and its figures), the made
assistant messages they hold (the next turn's prompt needs them, on whichever consumer takes the
conversation next), and once its last turn is made, how it ended.

A made turn is written to the consumer's shard first, then turn.lua records it here, iff the
task's lease is still ours: the same write-then-acknowledge rule as every result. The last turn
is acknowledged by ack.lua like any task's result; its key is the index's acc_version and
acc_attempt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis
import zstandard

from genq.common.queue.keys import FINISH_NAMES, RunKeys, finish_code
from genq.common.turns import splice

# One accepted generation: [params version, attempt], the key its line is found by (a
# recover's generation is not needed: attempts rise across recovers), then for a turn
# continued by `requeue --continue` its partial's tokens (turn.lua uncounts it if set aside).
Entry = list[int]
VERSION, ATTEMPT = 0, 1
COMPLETE = "complete"  # a conversation that reached its last turn (else splice.DIVERGED, ...)
# How a conversation ended, as conv_end keeps it (top 3 bits of 16; the turn below them).
# splice.UNANSWERED: its last made turn called tools no result answers (at the row's end, or
# stopped where the row has none). The even codes are the 2-bit ones of before, so a run's
# bitfield written by an older genq reads the same.
END_CODES = {COMPLETE: 2, splice.DIVERGED: 4, splice.TRUNCATED: 6, splice.UNANSWERED: 1}
END_NAMES = {code: name for name, code in END_CODES.items()}
TURN_BITS = 13

# Standing.fig: the made turns' sums, {"p", "c", "k": prompt, completion, cached tokens; "f":
# finish name -> count}. turn.lua adds its change to the run's made:* counters, so turns a
# conversation begun again sets aside are taken back (the last turn is ack.lua's to count).

_compress = zstandard.ZstdCompressor(level=3)
_decompress = zstandard.ZstdDecompressor()


@dataclass
class Standing:
    made: list[Entry] = field(default_factory=list)  # turns 1..n, before the last
    messages: list[dict[str, Any]] = field(default_factory=list)  # their assistant messages
    end: str = ""  # once its last turn is made: an END_CODES name
    last: int = 0  # that turn's number
    fig: dict[str, Any] = field(default_factory=dict)  # the made turns' sums (above)

    def ended(self) -> int:
        """conv_end's value: how it ended and at which turn; 0 while it runs."""
        if not self.end:
            return 0
        return END_CODES[self.end] << TURN_BITS | min(self.last, (1 << TURN_BITS) - 1)

    def encode(self) -> bytes:
        out: dict[str, Any] = {"made": self.made}
        if self.fig:
            out["fig"] = self.fig
        if self.end:
            out.update(end=self.end, last=self.last)
        return exact(orjson.dumps(out))

    @classmethod
    def decode(cls, raw: bytes | None) -> Standing:
        if not raw:
            return cls()
        got = orjson.loads(raw)
        return cls(made=got.get("made", []), end=got.get("end", ""), last=got.get("last", 0),
                   fig=got.get("fig") or {})


def counted(fig: dict[str, Any], prompt: int, completion: int, cached: int,
            finish: str | None) -> dict[str, Any]:
    """`fig` with one made turn's tokens and finish reason added, as ack.lua counts a result's
    (the whole answer's tokens; its finish as FINISH_NAMES names it)."""
    name = FINISH_NAMES[finish_code(finish)]
    names = dict(fig.get("f") or {})
    names[name] = names.get(name, 0) + 1
    return {"p": fig.get("p", 0) + prompt, "c": fig.get("c", 0) + completion,
            "k": fig.get("k", 0) + cached, "f": names}


def pack(messages: list[dict[str, Any]]) -> bytes:
    return exact(_compress.compress(orjson.dumps(messages)))


def exact(raw: bytes) -> bytes:
    """A copy in memory of its own size: orjson's output keeps the 4 KiB buffer it was written
    in, zstd's its bound, and recover holds one of each a conversation (4 GB at a million)."""
    return bytes(memoryview(raw))


def unpack(raw: bytes) -> list[dict[str, Any]]:
    return orjson.loads(_decompress.decompress(raw))


async def resume(r: aioredis.Redis, k: RunKeys, task: int, version: int) -> Standing:
    """Where a claimed conversation goes on from: its made turns with their messages. It begins
    again at turn 1 when those messages are gone (it ended, and is asked again whole) or a
    `requeue --redo all` issued at or below `version` covers its first turn."""
    pipe = r.pipeline(transaction=False)
    pipe.hget(k.conv, str(task))
    pipe.hget(k.conv_msgs, str(task))
    pipe.hget(k.redo_marks, "done")
    raw, msgs, redo_all = await pipe.execute()
    standing = Standing.decode(raw)
    messages = unpack(msgs) if msgs else []
    made = standing.made
    if len(messages) < len(made) or (
            made and redo_all and made[0][VERSION] < int(redo_all) <= version):
        return Standing()
    return Standing(made=made, messages=messages[:len(made)], fig=standing.fig)

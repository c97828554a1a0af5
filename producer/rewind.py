"""`genq requeue --redo missing` of a `--turns all` run: a lost node's turns made again.

Each conversation whose accepted turns (export_turns.py's keys) the given outputs (the shards
shipped to S3, or shard directories) do not all hold goes back to its earliest turn none of them
holds: the turns before it are kept, with their messages read from those outputs for the next
turn's prompt, and that turn and the ones after it are made again under the requeue's version
(lua/rewind.lua; redo.lua undoes the done ones' results as it undoes any). No turn before it is
asked again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
import redis

from genq.common.queue.keys import RunKeys
from genq.common.queue.scripts import ScriptRunner, rewind_call
from genq.common.store import export as results
from genq.common.store import export_turns as export
from genq.common.turns import splice, state
from genq.common.turns.state import Standing

BATCH = 500  # conversations a rewind.lua call


@dataclass
class Rewinds:
    """task -> the turn it is made again from; and the kept turns' entries and messages."""

    turn: dict[int, int] = field(default_factory=dict)
    kept: dict[int, list[state.Entry]] = field(default_factory=dict)
    messages: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    fig: dict[int, dict[str, Any]] = field(default_factory=dict)  # the kept turns' sums

    def describe(self) -> str:
        kept = sum(turn - 1 for turn in self.turn.values())
        return (f"redo missing: {len(self.turn)} conversations made again from their earliest "
                f"missing turn; {kept} turns before those kept, not asked again")


def find(r: redis.Redis, k: RunKeys, dirs: list[str], samples: int) -> Rewinds:
    """Each conversation's earliest accepted turn none of the shards in `dirs` holds."""
    keys, _ = export.accepted_keys(r, k)
    paths = results.shard_paths(dirs, k.run)
    export._pick(paths, keys, samples)
    out = Rewinds()
    for task, first, end in keys.tasks():
        lost = next((at for at in range(first, end) if keys.file_no[at] == export.NOT_FOUND),
                    None)
        if lost is not None:
            out.turn[task] = lost - first + 1
            out.kept[task] = [[keys.versions[at], keys.attempts[at]] for at in range(first, lost)]
            out.messages[task] = []
    # The lines found, turn 1 first, stop at a task's first turn not found: the kept ones.
    for task, _turn, line in export._lines(paths, keys):
        if task in out.messages and len(out.messages[task]) < len(out.kept[task]):
            rec = orjson.loads(line)
            out.messages[task].append(splice.message_of(rec))
            out.fig[task] = state.counted(
                out.fig.get(task, {}), int(rec.get("prompt_tokens") or 0),
                int(rec.get("completion_tokens") or 0), int(rec.get("cached_tokens") or 0),
                rec.get("finish_reason"))
    return out


def apply(r: redis.Redis, k: RunKeys, rewinds: Rewinds) -> int:
    """Put each conversation back to its kept turns; how many went back."""
    runner, items, count = ScriptRunner(r), [], 0
    for task, kept in rewinds.kept.items():
        messages, fig = rewinds.messages[task], rewinds.fig.get(task, {})
        items.append((task, Standing(kept, fig=fig).encode(),
                      state.pack(messages) if kept else b""))
    for at in range(0, len(items), BATCH):
        count += int(runner(rewind_call(k, items[at:at + BATCH])))
    return count

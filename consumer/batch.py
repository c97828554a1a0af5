"""Calls from many slots made as one. While one flush runs, the calls that come meanwhile wait
and go together in the next: the shape of a group commit. A lone call costs one turn of the
event loop; under load one Redis round trip (or one fdatasync) serves dozens of slots, so the
cost per task falls exactly when the consumer is busiest."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

I = TypeVar("I")  # noqa: E741
R = TypeVar("R")

# The most items one flush takes: keeps a Lua script's argument lists and its time holding
# Redis small (a 128-result ack runs in about a millisecond).
MAX_BATCH = 128


class Batcher(Generic[I, R]):
    """``await batcher(item)`` returns this item's share of ``flush(items)`` (a list of results
    in the same order) or raises what that flush raised."""

    def __init__(self, flush: Callable[[list[I]], Awaitable[list[R]]],
                 limit: int = MAX_BATCH) -> None:
        self.flush, self.limit = flush, limit
        self.waiting: list[tuple[I, asyncio.Future[R]]] = []
        self.task: asyncio.Task[None] | None = None

    async def __call__(self, item: I) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self.waiting.append((item, future))
        if self.task is None:
            self.task = asyncio.create_task(self.run())
        return await future

    async def run(self) -> None:
        batch: list[tuple[I, asyncio.Future[R]]] = []
        try:
            await asyncio.sleep(0)  # the slots woken in this turn of the loop join the batch
            while self.waiting:
                batch, self.waiting = self.waiting[:self.limit], self.waiting[self.limit:]
                try:
                    results = await self.flush([item for item, _ in batch])
                except Exception as e:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(e)
                    continue
                for (_, future), result in zip(batch, results, strict=True):
                    if not future.done():  # its caller may have been cancelled meanwhile
                        future.set_result(result)
            batch = []
        finally:
            self.task = None
            for _, future in batch + self.waiting:  # cancelled mid-flush: nobody waits forever
                future.cancel()
            self.waiting = []
